"""One rank: ``python -m memtune.worker RUN_DIR``.

Started once per GPU (or CPU process) by ``deepspeed``, ``torchrun`` or ``srun``; it reads
RANK / LOCAL_RANK / WORLD_SIZE from the environment and the resolved ``config.yaml`` and
``ds_config.json`` from the run dir. It never touches Hydra.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memtune import quiet
from memtune.config import (
    RunConfig,
    checkpointed_layers,
    grad_accumulation_steps,
    load_run_config,
)
from memtune.data.batching import (
    LengthGroupedSampler,
    PackedDataset,
    collate_packed,
    collate_padded,
)
from memtune.data.cache import load_split
from memtune.data.encode import IGNORE_INDEX, DataStats, Sample
from memtune.exit_codes import EXIT_NON_FINITE, EXIT_REQUEUE
from memtune.rank.checkpoint import export_adapter, load_checkpoint, save_checkpoint
from memtune.rank.loop import (
    Hooks,
    NonFiniteLoss,
    StopRequested,
    TrainResult,
    eval_shard,
    evaluate,
    gather_values,
    train,
)
from memtune.rank.loss import CausalLMLoss, resolve_loss_kind
from memtune.rank.model import (
    add_lora,
    choose_attention,
    count_parameters,
    load_base_model,
    load_tokenizer,
    method_label,
)
from memtune.rank.optim import build_optimizer, scheduler_factory
from memtune.rank.telemetry import (
    NullLogger,
    RunLogger,
    peak_key,
    reset_window_peak,
    window_peak_gib,
)


@dataclass
class RankContext:
    cfg: RunConfig
    run_dir: Path
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    tokenizer: Any
    data_stats: DataStats


AfterTrain = Callable[[Any, RankContext], None]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def init_distributed() -> tuple[int, int, int, torch.device]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(
                f"memtune.worker: ${name} is not set. Start ranks through train.py "
                "(or deepspeed / torchrun / srun), not by hand."
            )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    with quiet.drop_stdout_lines():
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    device = torch.device(accel.device_name(local_rank) if accel.device_name() != "cpu" else "cpu")
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def _batches(loader: Any, sampler: Any, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Micro batches forever, epoch after epoch; ``skip`` fast-forwards a resumed run to the
    exact micro batch it stopped before."""
    epoch, skip = divmod(skip, len(loader))
    while True:
        sampler.set_epoch(epoch)
        yield from itertools.islice(iter(loader), skip, None)
        skip = 0
        epoch += 1


_STOP_SIGNALS_SEEN = 0


def _on_stop_signal(signum: int, frame: Any) -> None:
    global _STOP_SIGNALS_SEEN
    _STOP_SIGNALS_SEEN += 1


def catch_stop_signals() -> None:
    """From the first moment of a rank: SIGTERM / SIGUSR2 only raise a flag (their default
    would kill the rank mid-load); the loop reads it at the next step boundary."""
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, _on_stop_signal)


class RunHooks(Hooks):
    """Periodic evaluation and checkpoints, and the stop flag SIGTERM / SIGUSR2 raise."""

    def __init__(
        self,
        engine: Any,
        run_dir: Path,
        cfg: RunConfig,
        data_dir: str,
        val_batches: list[dict[str, torch.Tensor]] | None,
        logger: NullLogger,
        device: torch.device,
    ):
        self.engine, self.run_dir, self.cfg, self.data_dir = engine, run_dir, cfg, data_dir
        self.val_batches, self.logger, self.device = val_batches, logger, device
        self.eval_losses: dict[int, float] = {}
        self.saved_step = -1
        self.result_at_stop: TrainResult | None = None

    def stop_requested(self) -> bool:
        return _STOP_SIGNALS_SEEN > 0

    def evaluate(self, step: int) -> None:
        if self.val_batches is None or step in self.eval_losses:
            return
        # Peak of the training so far, then a fresh window for the evaluation alone: the two
        # are logged side by side, per rank, so eval can be seen not to raise the peak.
        train_peak = window_peak_gib(self.device)
        windowed = reset_window_peak(self.device)
        loss = evaluate(self.engine, self.val_batches, self.device)
        peaks = gather_values(
            [train_peak, window_peak_gib(self.device) if windowed else -1.0], self.device
        )
        self.eval_losses[step] = loss
        memory = {
            f"rank{r}": {"train_peak_gib": t, "eval_peak_gib": e}
            for r, (t, e) in enumerate(peaks)
            if e >= 0
        }
        row = {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)), "eval/memory": memory}
        self.logger.log(step, row)
        self.logger.info(f"memtune: step {step}: eval loss {loss:.4f}")

    def after_step(self, step: int, result: TrainResult) -> None:
        if self.cfg.trainer.eval_every and step % self.cfg.trainer.eval_every == 0:
            self.evaluate(step)
        every = self.cfg.trainer.save_every
        if every and step % every == 0 and step < self.cfg.trainer.max_steps:
            self.save(step, result)
        self.result_at_stop = result

    def save(self, step: int, result: TrainResult) -> None:
        state = {
            "step": step,
            "label_tokens": result.label_tokens,
            "input_tokens": result.input_tokens,
            "losses": result.losses[:step],
            "skipped": [s for s in result.skipped if s <= step],
            "wall_s": result.wall_s,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "data_dir": self.data_dir,
        }
        save_checkpoint(self.engine, self.run_dir, step, state, self.cfg.trainer.keep_last)
        self.saved_step = step


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows of steps after the checkpoint: the resumed run logs them again."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r and json.loads(r)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def build_engine(
    cfg: RunConfig, model: Any, device: torch.device, ds_config: dict[str, Any]
) -> tuple[Any, str]:
    """The DeepSpeed engine around memtune's loss module, with the configured optimizer and
    schedule; returns it and a line naming the optimizer (bench/gpu_check.py builds its
    engine here too)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, optimizer_note = build_optimizer(cfg, params, device)
    loss_kind = resolve_loss_kind(cfg.trainer.loss, device)
    engine, _, _, _ = deepspeed.initialize(
        model=CausalLMLoss(model, loss_kind, cfg.trainer.loss_chunk_tokens),
        optimizer=optimizer,
        model_parameters=params if optimizer is None else None,
        lr_scheduler=scheduler_factory(cfg),
        config=ds_config,
    )
    return engine, optimizer_note


def checkpoint_note(cfg: RunConfig) -> str:
    k, layers = checkpointed_layers(cfg), int(cfg.model.architecture["num_hidden_layers"])
    return "off" if k == 0 else "on" if k == layers else f"on for {k} of {layers} layers"


def batching_summary(cfg: RunConfig) -> str:
    if cfg.data.packing:
        return f"packed into rows of {cfg.data.max_seq_len} tokens"
    grouped = ", grouped by length" if cfg.data.group_by_length else ""
    return f"padded per micro batch{grouped}"


def eval_batches(
    cfg: RunConfig, prepared_dir: str, pad_token_id: int, rank: int, world: int
) -> list[dict[str, torch.Tensor]]:
    """This rank's validation micro batches, collated once (the split is small)."""
    val = load_split(prepared_dir, "val")
    samples = []
    for i in eval_shard(len(val), rank, world):
        s = val[max(i, 0)]
        samples.append(s if i >= 0 else Sample(s.input_ids, [IGNORE_INDEX] * len(s.labels)))
    micro = cfg.trainer.micro_batch_size
    return [
        collate_padded(samples[a : a + micro], pad_token_id) for a in range(0, len(samples), micro)
    ]


def make_loader(
    cfg: RunConfig, prepared_dir: str, pad_token_id: int, rank: int, world: int
) -> tuple[Any, Any]:
    """The rank's DataLoader over the preprocessed cache: padded, length-grouped or packed."""
    from torch.utils.data import DataLoader, DistributedSampler

    base = load_split(prepared_dir, "train")
    micro, seed = cfg.trainer.micro_batch_size, cfg.trainer.seed
    dataset: Any = base
    collate_fn: Any = partial(collate_padded, pad_token_id=pad_token_id)
    if cfg.data.packing:
        dataset = PackedDataset(base, cfg.data.max_seq_len)
        collate_fn = partial(collate_packed, pad_token_id=pad_token_id)
    if cfg.data.group_by_length:
        sampler: Any = LengthGroupedSampler(base.lengths, micro, world, rank, seed)
    else:
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
    if len(sampler) < micro:
        raise RuntimeError(
            f"rank {rank} gets {len(sampler)} items per epoch, fewer than one micro batch "
            f"({micro}); use more data or a smaller trainer.micro_batch_size"
        )
    loader = DataLoader(
        dataset,
        batch_size=micro,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=cfg.data.num_workers,
        drop_last=True,
    )
    return loader, sampler


def run(run_dir: str | Path, after_train: AfterTrain | None = None) -> TrainResult:
    from transformers.integrations import HfDeepSpeedConfig

    catch_stop_signals()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir / "config.yaml")
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    rank, local_rank, world, device = init_distributed()
    try:
        seed_everything(cfg.trainer.seed)
        print0 = print if rank == 0 else (lambda *a, **k: None)
        tokenizer = load_tokenizer(cfg)
        attn = choose_attention(cfg.model.attn_implementation, device.type)
        # Kept alive while loading: makes from_pretrained place weights partitioned (ZeRO-3).
        hf_ds = HfDeepSpeedConfig(ds_config) if cfg.zero.stage == 3 else None
        gpu = local_rank if device.type == "cuda" else None
        model = add_lora(load_base_model(cfg, attn, gpu), cfg)
        trainable, total = count_parameters(model)

        data_record = json.loads((run_dir / "data.json").read_text())
        stats = DataStats(**data_record["train"])
        loader, sampler = make_loader(cfg, data_record["dir"], tokenizer.pad_token_id, rank, world)
        engine, optimizer_note = build_engine(cfg, model, device, ds_config)
        del hf_ds

        t = cfg.trainer
        print0(
            f"memtune: {cfg.model.name_or_path} · attention {attn} · {method_label(cfg)} "
            f"r={cfg.peft.r} on {cfg.peft.target} · {trainable:,} trainable of {total:,} "
            f"parameters ({100 * trainable / total:.3f}%)\n"
            f"memtune: {world} rank(s) · ZeRO-{cfg.zero.stage} · {t.precision} · batch "
            f"{t.micro_batch_size} × accum {grad_accumulation_steps(cfg)} × {world} ranks = "
            f"{t.global_batch_size} · activation checkpointing "
            f"{checkpoint_note(cfg)} · {optimizer_note}\n"
            f"memtune: batches: {batching_summary(cfg)}",
            flush=True,
        )
        ctx = RankContext(cfg, run_dir, rank, local_rank, world, device, tokenizer, stats)
        result = TrainResult()
        checkpoint = json.loads((run_dir / "resume.json").read_text())["checkpoint"]
        if checkpoint:
            state = load_checkpoint(engine, Path(checkpoint), rank)
            result = TrainResult(
                steps=state["step"],
                label_tokens=state["label_tokens"],
                input_tokens=state["input_tokens"],
                losses=state["losses"],
                skipped=state.get("skipped", []),
                wall_s=state["wall_s"],
            )
            if rank == 0:
                _truncate_metrics(run_dir / "metrics.jsonl", result.steps)
            print0(f"memtune: resumed at step {result.steps} from {checkpoint}", flush=True)
        resolved = json.loads(json.dumps(_config_dict(run_dir)))
        logger = (
            RunLogger(run_dir, t.max_steps, cfg.logger, resolved, done=result.steps)
            if rank == 0
            else NullLogger()
        )
        val_batches = None
        if data_record["val"]:
            val_batches = eval_batches(cfg, data_record["dir"], tokenizer.pad_token_id, rank, world)
        hooks = RunHooks(engine, run_dir, cfg, data_record["dir"], val_batches, logger, device)
        batches = _batches(loader, sampler, skip=result.steps * grad_accumulation_steps(cfg))
        try:
            result = train(engine, batches, cfg, device, logger, result, hooks)
            hooks.evaluate(result.steps)
        except StopRequested as stop:
            if hooks.saved_step != stop.last_step and stop.last_step > 0:
                hooks.save(stop.last_step, hooks.result_at_stop or result)
            print0(
                f"memtune: stopped by a signal after step {stop.last_step}; checkpoint saved. "
                f"Run the same command again to continue (exit code {EXIT_REQUEUE}).",
                flush=True,
            )
            raise SystemExit(EXIT_REQUEUE) from None
        finally:
            logger.close()
        if hooks.saved_step != result.steps:
            hooks.save(result.steps, result)
        if after_train is not None:
            after_train(engine, ctx)
        adapter_dir = run_dir / "adapter"
        n_tensors = export_adapter(engine.module.model, adapter_dir, is_writer=rank == 0)
        if rank == 0:
            tokenizer.save_pretrained(str(adapter_dir))
            eval_loss = hooks.eval_losses.get(result.steps)
            _write_summary(ctx, result, trainable, total, n_tensors, attn, eval_loss)
        return result
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _config_dict(run_dir: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def _write_summary(
    ctx: RankContext,
    result: TrainResult,
    trainable: int,
    total: int,
    n_tensors: int,
    attn: str,
    eval_loss: float | None,
) -> None:
    key = peak_key(ctx.device)
    summary = {
        "run_dir": str(ctx.run_dir),
        "steps": result.steps,
        "label_tokens": result.label_tokens,
        "input_tokens": result.input_tokens,
        "loss_first": result.losses[0],
        "loss_last": result.losses[-1],
        "skipped_steps": result.skipped,
        "wall_s": round(result.wall_s, 2),
        "tokens_per_s": round(result.input_tokens / max(result.wall_s, 1e-9), 1),
        "world_size": ctx.world_size,
        "zero_stage": ctx.cfg.zero.stage,
        "attention": attn,
        "trainable_params": trainable,
        "total_params": total,
        "adapter_tensors": n_tensors,
        "eval_loss": eval_loss,
        "data": ctx.data_stats.as_dict(),
        "peak_memory_gib": [m[key] for m in result.peak_memory],
        "memory": result.peak_memory,
    }
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    memory = {
        "measure": "CUDA allocator (GiB)" if ctx.device.type == "cuda" else "process RSS (GiB)",
        "ranks": [{"rank": r, **m} for r, m in enumerate(result.peak_memory)],
    }
    (ctx.run_dir / "memory.json").write_text(json.dumps(memory, indent=2) + "\n")
    what = "peak allocated" if ctx.device.type == "cuda" else "peak RSS"
    per_rank = ", ".join(f"rank{r} {m[key]:.2f} GiB" for r, m in enumerate(result.peak_memory))
    print(
        f"\nmemtune: done in {result.wall_s:.1f} s · {result.steps} steps · "
        f"{result.input_tokens:,} tokens ({result.label_tokens:,} labelled) · "
        f"{summary['tokens_per_s']:,} tokens/s\n"
        f"memtune: loss {result.losses[0]:.4f} → {result.losses[-1]:.4f}"
        + (f" · eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        + (
            f" · {len(result.skipped)} non-finite step(s) skipped: {result.skipped}"
            if result.skipped
            else ""
        )
        + "\n"
        f"memtune: {what} per rank: {per_rank}\n"
        f"memtune: data: {ctx.data_stats.line()}\n"
        f"memtune: adapter ({n_tensors} tensors, {trainable:,} parameters) in "
        f"{ctx.run_dir / 'adapter'}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m memtune.worker RUN_DIR")
    try:
        run(args[0])
    except NonFiniteLoss as err:
        print(f"memtune: stopped: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_NON_FINITE) from None
    finally:
        # Python puts default handlers back while it shuts down; train.py may still re-send a
        # stop then, and SIGUSR2's default would turn a clean exit into a signal death.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


if __name__ == "__main__":
    main()
