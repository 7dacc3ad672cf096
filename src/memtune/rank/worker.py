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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memtune import quiet
from memtune.config import (
    ConfigError,
    RunConfig,
    checkpointing_label,
    grad_accumulation_steps,
    load_run_config,
    sequence_parallel_size,
)
from memtune.data.encode import DataStats, load_tokenizer
from memtune.data.loaders import eval_batches, make_loader
from memtune.exit_codes import (
    EXIT_CONFIG,
    EXIT_NON_FINITE,
    EXIT_OOM,
    EXIT_PEER_LOST,
    EXIT_REQUEUE,
)
from memtune.rank.build import build_rank
from memtune.rank.checkpoint import (
    export_final,
    follow_schedule,
    load_checkpoint,
    load_checkpoint_any_world,
    save_checkpoint,
)
from memtune.rank.loop import (
    Hooks,
    NonFiniteLoss,
    StopRequested,
    TrainResult,
    evaluate,
    gather_values,
    train,
)
from memtune.rank.memory_check import check, verdict
from memtune.rank.model import method_label
from memtune.rank.sequence_parallel import SequenceGroups, shard_batch
from memtune.rank.telemetry import (
    NullLogger,
    RunLogger,
    memory_snapshot,
    peak_key,
    reset_window_peak,
    window_peak_gib,
)
from memtune.rundir import OomReport, RunDir, Summary, TrainState


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
        state = TrainState(
            step=step,
            label_tokens=result.label_tokens,
            input_tokens=result.input_tokens,
            losses=result.losses[:step],
            skipped=[s for s in result.skipped if s <= step],
            wall_s=result.wall_s,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            data_dir=self.data_dir,
        )
        save_checkpoint(self.engine, self.run_dir, state, self.cfg.trainer.keep_last)
        self.saved_step = step


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows of steps after the checkpoint: the resumed run logs them again."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r and json.loads(r)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def checkpoint_note(cfg: RunConfig) -> str:
    label = checkpointing_label(cfg)
    return label if label == "off" else f"on for {label}"


def sequence_note(groups: SequenceGroups) -> str:
    if groups.sp == 1:
        return ""
    return f" · each sequence split over {groups.sp} ranks (Ulysses)"


def batching_summary(cfg: RunConfig) -> str:
    if cfg.data.packing:
        return f"packed into rows of {cfg.data.max_seq_len} tokens"
    grouped = ", grouped by length" if cfg.data.group_by_length else ""
    return f"padded per micro batch{grouped}"


def run(run_dir: str | Path, after_train: AfterTrain | None = None) -> TrainResult:
    catch_stop_signals()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    cfg = load_run_config(rd.config)
    ds_config = json.loads(rd.ds_config.read_text())
    rank, local_rank, world, device = init_distributed()
    failed = False
    try:
        seed_everything(cfg.trainer.seed)
        print0 = print if rank == 0 else (lambda *a, **k: None)
        tokenizer = load_tokenizer(cfg)
        data_record = rd.read_data()
        stats = DataStats(**data_record.train)
        groups = SequenceGroups.of(rank, world, sequence_parallel_size(cfg))
        pad_id = tokenizer.pad_token_id
        loader, sampler = make_loader(cfg, data_record.dir, pad_id, groups.dp_rank, groups.dp)
        start_rss_gib = memory_snapshot(device).get("rss_gib", 0.0)  # CPU: before the model
        parts = build_rank(cfg, ds_config, device, local_rank)
        engine, attn = parts.engine, parts.attention
        compiled = f" · {parts.compiled_layers} layers compiled" if parts.compiled_layers else ""
        if parts.mlp_tiles:
            compiled += f" · MLP in {parts.mlp_tiles} tiles"
        if parts.offloaded_layers:
            compiled += f" · {parts.offloaded_layers} layers' inputs offloaded to the host"
        trainable, total, optimizer_note = parts.trainable, parts.total, parts.optimizer_note

        t = cfg.trainer
        print0(
            f"memtune: {cfg.model.name_or_path} · attention {attn}{compiled} · {method_label(cfg)} "
            f"r={cfg.peft.r} on {cfg.peft.target} · {trainable:,} trainable of {total:,} "
            f"parameters ({100 * trainable / total:.3f}%)\n"
            f"memtune: {world} rank(s) · ZeRO-{cfg.zero.stage} · {t.precision} · batch "
            f"{t.micro_batch_size} × accum {grad_accumulation_steps(cfg)} × {groups.dp} "
            f"{'ranks' if groups.sp == 1 else 'data-parallel groups'} = "
            f"{t.global_batch_size}{sequence_note(groups)} · activation checkpointing "
            f"{checkpoint_note(cfg)} · {optimizer_note}\n"
            f"memtune: batches: {batching_summary(cfg)}",
            flush=True,
        )
        ctx = RankContext(cfg, run_dir, rank, local_rank, world, device, tokenizer, stats)
        result = TrainResult()
        resume = rd.read_resume()
        checkpoint = resume.checkpoint
        if checkpoint:
            # launcher.prepare recorded what changed, having checked the checkpoint allows it.
            layout = ("launcher.num_ranks", "zero.stage")  # what the engine files depend on
            moved = {k: v for k, v in resume.changed.items() if k in layout}
            if not moved:
                state = load_checkpoint(engine, Path(checkpoint), rank)
            else:
                state = load_checkpoint_any_world(engine, Path(checkpoint), rank)
                what = ", ".join(f"{k} {old} → {new}" for k, (old, new) in moved.items())
                print0(f"memtune: resuming from its gathered optimizer state ({what})", flush=True)
            follow_schedule(engine, cfg.trainer.lr)
            result = TrainResult(
                steps=state.step,
                label_tokens=state.label_tokens,
                input_tokens=state.input_tokens,
                losses=state.losses,
                skipped=state.skipped,
                wall_s=state.wall_s,
            )
            if rank == 0:
                _truncate_metrics(rd.metrics, result.steps)
            print0(f"memtune: resumed at step {result.steps} from {checkpoint}", flush=True)
        resolved = json.loads(json.dumps(_config_dict(run_dir)))
        logger = (
            RunLogger(run_dir, t.max_steps, cfg.logger, resolved, done=result.steps)
            if rank == 0
            else NullLogger()
        )
        val_batches = None
        if data_record.val:
            val_batches = eval_batches(
                cfg, data_record.dir, pad_id, groups.dp_rank, groups.dp, full_rows=groups.sp > 1
            )
            if groups.sp > 1:
                val_batches = [shard_batch(b, groups, pad_id) for b in val_batches]
        hooks = RunHooks(engine, run_dir, cfg, data_record.dir, val_batches, logger, device)
        batches = _batches(loader, sampler, skip=result.steps * grad_accumulation_steps(cfg))
        if groups.sp > 1:
            batches = (shard_batch(b, groups, pad_id) for b in batches)
        try:
            try:
                result = train(engine, batches, cfg, device, logger, result, hooks)
                hooks.evaluate(result.steps)
            except BaseException as err:
                if not is_out_of_memory(err):
                    raise
                done = hooks.result_at_stop.steps if hooks.result_at_stop else result.steps
                raise RankOutOfMemory(rank, done + 1, memory_snapshot(device), str(err)) from err
            starts = [row[0] for row in gather_values([start_rss_gib], device)]  # collective
            vs_plan = memory_vs_plan(rd, result.peak_memory, device, starts)
            logger.summarize(
                {
                    f"memory/rank{c['rank']}/vs_plan/{c['measure'].replace(' ', '_')}": c
                    for c in vs_plan.checks
                }
            )
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
        n_tensors, outputs = export_final(engine.module.model, tokenizer, run_dir, rank == 0)
        if rank == 0:
            eval_loss = hooks.eval_losses.get(result.steps)
            _write_summary(
                ctx,
                result,
                trainable,
                total,
                n_tensors,
                attn,
                eval_loss,
                vs_plan,
                parts.compiled_layers,
                outputs,
            )
        return result
    except (SystemExit, NonFiniteLoss):
        raise  # agreed by every rank in a collective: they all end here together
    except BaseException:
        failed = True  # this rank alone: the others are in a collective it will never join
        raise
    finally:
        if dist.is_initialized() and not failed:
            dist.barrier()
            dist.destroy_process_group()


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OOM, or a host allocation that failed (torch's CPU allocator, or Python's)."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def lost_peer(err: BaseException) -> bool:
    """gloo's error when the other side of a collective went away."""
    text = str(err)
    return "Connection reset by peer" in text or "Connection closed by peer" in text


class RankOutOfMemory(Exception):
    """This rank could not allocate what a step needed; main() reports it and exits EXIT_OOM."""

    def __init__(self, rank: int, step: int, memory: dict[str, float], error: str):
        super().__init__(error)
        self.rank, self.step, self.memory, self.error = rank, step, memory, error


def report_out_of_memory(run_dir: Path, oom: RankOutOfMemory, device_type: str) -> None:
    """Say which rank ran out at which step, against its plan, and leave RUN_DIR/oom-rankN.json
    for the job (which adds what to change, and with plan.auto_fit restarts)."""
    rd = RunDir(run_dir)
    plan = rd.read_plan()
    planned = plan.total_gib if plan is not None else None
    key = peak_key(torch.device(device_type))
    error = oom.error.splitlines()[0][:500] if oom.error else ""
    rd.write_oom_report(OomReport(oom.rank, oom.step, planned, oom.memory, key, error))
    plan_part = f"planned {planned:.2f} GiB" if planned is not None else "no plan.json"
    print(
        f"memtune: out of memory: rank {oom.rank} at step {oom.step} ({plan_part}, "
        f"{key.replace('_gib', '').replace('_', ' ')} {oom.memory.get(key, 0.0):.2f} GiB when "
        f"it failed): {error}",
        file=sys.stderr,
        flush=True,
    )


def _config_dict(run_dir: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.load(RunDir(run_dir).config), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


@dataclass
class VsPlan:
    checks: list[dict[str, Any]]
    lines: list[str]


def memory_vs_plan(
    rd: RunDir, measured: list[dict[str, float]], device: torch.device, start_rss: list[float]
) -> VsPlan:
    """Each rank's peak next to the plan it was admitted with (rank.memory_check); nothing
    when the run dir has no plan.json (a run dir laid out by an older memtune)."""
    record = rd.read_plan()
    if record is None:
        return VsPlan([], [])
    checks = check(record, measured, device.type, start_rss)
    return VsPlan([c.as_dict() for c in checks], verdict(record, checks, device.type))


def _write_summary(
    ctx: RankContext,
    result: TrainResult,
    trainable: int,
    total: int,
    n_tensors: int,
    attn: str,
    eval_loss: float | None,
    vs_plan: VsPlan,
    compiled_layers: int = 0,
    outputs: dict[str, list[Any]] | None = None,
) -> None:
    key = peak_key(ctx.device)
    rd = RunDir(ctx.run_dir)
    summary = Summary(
        run_dir=str(ctx.run_dir),
        steps=result.steps,
        label_tokens=result.label_tokens,
        input_tokens=result.input_tokens,
        loss_first=result.losses[0],
        loss_last=result.losses[-1],
        skipped_steps=result.skipped,
        wall_s=round(result.wall_s, 2),
        tokens_per_s=round(result.input_tokens / max(result.wall_s, 1e-9), 1),
        world_size=ctx.world_size,
        zero_stage=ctx.cfg.zero.stage,
        attention=attn,
        compiled_layers=compiled_layers,
        trainable_params=trainable,
        total_params=total,
        adapter_tensors=n_tensors,
        eval_loss=eval_loss,
        data=ctx.data_stats.as_dict(),
        peak_memory_gib=[m[key] for m in result.peak_memory],
        memory=result.peak_memory,
        memory_vs_plan=vs_plan.checks,
        outputs=outputs or {},
    )
    rd.write_summary(summary)
    measure = "CUDA allocator (GiB)" if ctx.device.type == "cuda" else "process RSS (GiB)"
    rd.write_memory(measure, result.peak_memory, vs_plan.checks)
    what = "peak allocated" if ctx.device.type == "cuda" else "peak RSS"
    per_rank = ", ".join(f"rank{r} {m[key]:.2f} GiB" for r, m in enumerate(result.peak_memory))
    print(
        f"\nmemtune: done in {result.wall_s:.1f} s · {result.steps} steps · "
        f"{result.input_tokens:,} tokens ({result.label_tokens:,} labelled) · "
        f"{summary.tokens_per_s:,} tokens/s\n"
        f"memtune: loss {result.losses[0]:.4f} → {result.losses[-1]:.4f}"
        + (f" · eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        + (
            f" · {len(result.skipped)} non-finite step(s) skipped: {result.skipped}"
            if result.skipped
            else ""
        )
        + "\n"
        f"memtune: {what} per rank: {per_rank}\n"
        + "".join(f"memtune: vs plan: {line}\n" for line in vs_plan.lines)
        + f"memtune: data: {ctx.data_stats.line()}\n"
        f"memtune: adapter ({n_tensors} tensors, {trainable:,} parameters) in "
        f"{rd.adapter}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m memtune.worker RUN_DIR")
    try:
        run(args[0])
        code = 0
    except NonFiniteLoss as err:
        print(f"memtune: stopped: {err}", file=sys.stderr, flush=True)
        code = EXIT_NON_FINITE
    except RankOutOfMemory as oom:
        report_out_of_memory(Path(args[0]), oom, "cuda" if torch.cuda.is_available() else "cpu")
        code = EXIT_OOM
    except RuntimeError as err:
        if not lost_peer(err):
            raise
        # Another rank stopped first (its own message says why); no traceback for this one.
        print(
            "memtune: a rank stopped, so this one lost its connection to it (see its message)",
            file=sys.stderr,
            flush=True,
        )
        code = EXIT_PEER_LOST
    except ConfigError as err:  # e.g. the loaded model is not the planned one (rank.build)
        print(f"memtune: config error: {err}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    except SystemExit as stop:
        if stop.code != EXIT_REQUEUE:
            raise
        code = EXIT_REQUEUE
    finally:
        # Python puts default handlers back while it shuts down; train.py may still re-send a
        # stop then, and SIGUSR2's default would turn a clean exit into a signal death.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    leave(code)


def leave(code: int) -> None:
    """End a rank whose work is done (results written, files closed, process group destroyed)
    without the interpreter's teardown of the native libraries: there, now and then, a C++
    thread still joinable is destroyed and the rank aborts ("terminate called without an
    active exception", SIGABRT, the job exits 250) after a complete run — seen twice in six
    full test runs on 2 CPU ranks, never reproduced alone. Real errors (any other exception)
    still take Python's normal exit, with their traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
