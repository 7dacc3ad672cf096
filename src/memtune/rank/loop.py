"""The training loop, top to bottom: micro-steps, accumulation, clipping, schedule, guards.

The loss of every micro-step is a *sum* over its units — label tokens (SFT), or pairs (a
preference objective, rank.preference) — scaled so that one optimizer step averages over all
units of all ranks and accumulation steps. Micro batch 4 × accumulation 1 and micro batch 1 ×
accumulation 4 then give the same update, and so do one rank and two ranks with the same global
batch, and a sequence split over two ranks (each rank's sum covers its shard's targets).
DeepSpeed divides by the accumulation steps in ``backward`` and averages over data-parallel
ranks when it reduces gradients (summing over the ranks of a sequence-parallel group); the
scale undoes both so only the unit count normalises.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from memtune.config import RunConfig
from memtune.config.decisions import Decisions
from memtune.rank.experts import RouterStats
from memtune.rank.loss import label_count
from memtune.rank.sequence_parallel import gradient_averaging_ranks
from memtune.rank.telemetry import NullLogger, memory_snapshot
from memtune.rundir import TrainState


class NonFiniteLoss(RuntimeError):
    """Raised on every rank when a step's loss or gradient norm is not finite.

    Raised before the optimizer step (loss) or after DeepSpeed has discarded the step (gradient
    norm), so the weights never see a non-finite update.
    """


class StopRequested(Exception):
    """A rank got SIGTERM / SIGUSR2, or saw its launcher end: every rank stops at this step
    boundary."""

    def __init__(self, last_step: int, launchers_lost: int = 0):
        super().__init__(f"stop requested after step {last_step}")
        self.last_step = last_step
        self.launchers_lost = launchers_lost
        """The ranks that saw their launcher (train.py) end: the cause, where no signal came
        (on a node whose train.py lives, the stop came from another node's)."""


class Hooks:
    """What the loop asks of its surroundings; the defaults do nothing."""

    def stop_requested(self) -> bool:
        """A stop signal reached this rank."""
        return False

    def launcher_lost(self) -> bool:
        """This rank's launcher (train.py) has ended: a stop too."""
        return False

    def after_step(self, step: int, result: TrainResult) -> None:
        pass


@dataclass
class TrainResult:
    steps: int = 0
    label_tokens: int = 0
    input_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    """Steps whose update was discarded (non-finite loss or gradient norm)."""
    wall_s: float = 0.0
    peak_memory: list[dict[str, float]] = field(default_factory=list)
    preference: dict[str, float] = field(default_factory=dict)
    """The last step's train/rewards/… (a preference objective; not in a checkpoint)."""

    # The counters and a checkpoint's trainer_state.json convert here, both ways, and nowhere
    # else.
    @classmethod
    def resumed_from(cls, state: TrainState) -> TrainResult:
        return cls(
            steps=state.step,
            label_tokens=state.label_tokens,
            input_tokens=state.input_tokens,
            losses=state.losses,
            skipped=state.skipped,
            wall_s=state.wall_s,
        )

    def state_at(self, step: int, world_size: int, data_dir: str) -> TrainState:
        """The checkpoint record of this run at ``step`` (the counters are the step's own)."""
        return TrainState(
            step=step,
            label_tokens=self.label_tokens,
            input_tokens=self.input_tokens,
            losses=self.losses[:step],
            skipped=[s for s in self.skipped if s <= step],
            wall_s=self.wall_s,
            world_size=world_size,
            data_dir=data_dir,
        )


def lr_factor(cfg: RunConfig) -> Callable[[int], float]:
    """Linear warmup to lr, then cosine down to lr·min_lr_ratio at max_steps."""
    t = cfg.trainer

    def factor(done: int) -> float:  # `done` optimizer steps taken so far
        if done < t.warmup_steps:
            return (done + 1) / (t.warmup_steps + 1)
        progress = min(1.0, (done - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "labels",
    "shift_labels",
    "cu_seq_lens",
    "max_length",
    "sequence_index",  # preference pairs (data.batching.collate_packed)
    "shift_sequence_index",  # … cut into a sequence-parallel shard (rank.sequence_parallel)
    "pair_index",
    "reference_logps",  # precomputed (rank.reference)
    "pixel_values",  # images (data.batching, patchified on the rank; rank.vision)
    "image_grid_thw",
    "mm_token_type_ids",
)


def loss_units(batch: dict[str, torch.Tensor]) -> int:
    """What one step's loss averages over: label tokens (SFT), or pairs (a preference
    objective: fillers, pair_index -1, excluded; under sequence parallelism counted once per
    group, ``loss_pairs``)."""
    if "loss_pairs" in batch:
        return int(batch["loss_pairs"])
    if "pair_index" in batch:
        return int((batch["pair_index"] >= 0).sum())
    return label_count(batch)


def _pair_stats(engine: Any) -> torch.Tensor | None:
    """The preference loss's sums for the micro batch it just ran (rank.preference)."""
    return getattr(engine.module, "stats", None)


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of real samples in a batch (padding excluded), for throughput."""
    if "real_tokens" in batch:
        return int(batch["real_tokens"])
    return int(batch["attention_mask"].sum())


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_values(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values``, on every rank (a collective: all ranks must call it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def gather_memory(device: torch.device) -> list[dict[str, float]]:
    """Every rank's memory snapshot, on every rank (a collective: all ranks must call it)."""
    mine = memory_snapshot(device)
    keys = sorted(mine)
    rows = gather_values([mine[k] for k in keys], device)
    return [dict(zip(keys, row, strict=True)) for row in rows]


def _poisoned_scale(micro_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale``, or NaN where this rank's micro loss is not finite.

    A non-finite loss value does not by itself make the gradients non-finite (the gradient of
    an infinite cross-entropy term can be finite). Backpropagating with a NaN scale does: every
    gradient of the step becomes NaN, the reduction spreads that to every rank, and DeepSpeed's
    own check of the global gradient norm discards the step on all ranks at once (no extra
    collective). No host sync: the choice is made on the device.
    """
    finite = torch.isfinite(micro_loss.detach())
    return torch.where(finite, torch.full_like(finite, scale, dtype=torch.float32), math.nan)


def _note_skip(
    step: int,
    loss: float,
    result: TrainResult,
    logger: NullLogger,
    mode: str,
    max_skipped: int,
) -> None:
    """DeepSpeed discarded this step's update (non-finite gradient norm): record, warn or stop."""
    what = f"loss {loss}" if not math.isfinite(loss) else "gradient norm is not finite"
    if mode == "stop":
        raise NonFiniteLoss(
            f"step {step}: {what}; DeepSpeed discarded the update, weights are untouched. "
            "Lower trainer.lr or check the data (trainer.on_nonfinite=skip skips such steps)."
        )
    result.skipped.append(step)
    run = 0
    while run < len(result.skipped) and result.skipped[-1 - run] == step - run:
        run += 1
    logger.info(
        f"memtune: step {step}: {what}; update skipped ({len(result.skipped)} skipped so far, "
        f"{run} in a row; the learning-rate schedule waits)"
    )
    if run >= max_skipped:
        raise NonFiniteLoss(
            f"step {step}: {run} steps in a row were not finite "
            f"(trainer.max_skipped_steps={max_skipped}); stopped. The weights are those of "
            f"step {step - run}. Lower trainer.lr or check the data."
        )


def train(
    engine: Any,
    batches: Iterator[dict[str, torch.Tensor]],
    cfg: RunConfig,
    d: Decisions,
    device: torch.device,
    logger: NullLogger,
    result: TrainResult | None = None,
    hooks: Hooks | None = None,
) -> TrainResult:
    """Run optimizer steps ``result.steps + 1 … max_steps`` (a resumed run passes its result)."""
    t = cfg.trainer
    gas = d.batch.accumulation
    world = dist.get_world_size() if dist.is_initialized() else 1
    averaged_over = gradient_averaging_ranks(d.zero_stage, world, d.sequence_parallel)
    result = result or TrainResult()
    hooks = hooks or Hooks()
    engine.train()
    coef = t.router_aux_loss_coef  # a mixture's balance loss added to the objective's
    routing = RouterStats(engine.module, device, capture=coef > 0)  # and logged
    start = time.perf_counter() - result.wall_s
    for step in range(result.steps + 1, t.max_steps + 1):
        step_start = time.perf_counter()
        micro = [next(batches) for _ in range(gas)]
        counts = torch.tensor(
            [
                sum(loss_units(b) for b in micro),
                sum(label_count(b) for b in micro),
                sum(real_tokens(b) for b in micro),
                float(hooks.stop_requested()),
                float(hooks.launcher_lost()),
            ],
            dtype=torch.float64,
            device=device,
        )
        units, label_tokens, input_tokens, stops, lost = (
            int(x) for x in _all_reduce_sum(counts).tolist()
        )
        if stops or lost:  # agreed by all ranks in the same collective: all stop here together
            raise StopRequested(step - 1, lost)
        scale = averaged_over * gas / units

        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        pair_sums: torch.Tensor | None = None
        for i, batch in enumerate(micro):
            batch = {k: v.to(device) for k, v in batch.items() if k != "real_tokens"}
            if routing:
                real = batch.get("attention_mask")
                routing.mask = None if real is None else real.flatten().bool()
            micro_loss = engine(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
            step_loss = micro_loss
            if coef > 0:  # in the loss's units (a sum over them), so the step averages it
                aux = routing.take_aux_loss() * (coef * loss_units(batch))
                step_loss = micro_loss + aux.to(micro_loss.dtype)
            engine.backward(step_loss * _poisoned_scale(micro_loss, scale))
            loss_sum += micro_loss.detach().float()
            stats = _pair_stats(engine)
            if stats is not None:
                pair_sums = stats if pair_sums is None else pair_sums + stats
            if i < gas - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step

        loss = float(_all_reduce_sum(loss_sum).item()) / units
        preference = pair_means(pair_sums, "train")
        result.preference = preference
        if not math.isfinite(loss) and t.on_nonfinite == "stop":
            raise NonFiniteLoss(
                f"step {step}: loss is {loss}; stopped before the optimizer step, weights are "
                "untouched. Lower trainer.lr or check the data (trainer.on_nonfinite=skip "
                "skips such steps instead)."
            )
        lr = engine.get_lr()[0]  # the rate this step applies (the scheduler moves on in step())
        skipped_before = engine.skipped_steps
        engine.step()
        if engine.skipped_steps != skipped_before:
            _note_skip(step, loss, result, logger, t.on_nonfinite, t.max_skipped_steps)
        elif not math.isfinite(loss):  # cannot happen: a poisoned step always overflows
            raise NonFiniteLoss(f"step {step}: loss {loss} but DeepSpeed applied the step")

        result.steps = step
        result.label_tokens += label_tokens
        result.input_tokens += input_tokens
        result.losses.append(loss)
        if step % t.log_every == 0 or step == t.max_steps:
            memory = gather_memory(device)
            moe = routing.metrics(_all_reduce_sum) if routing else {}
            grad_norm = engine.get_global_grad_norm()
            step_s = time.perf_counter() - step_start
            logger.log(
                step,
                {
                    "train/loss": loss,
                    "train/lr": lr,
                    "train/grad_norm": None if grad_norm is None else float(grad_norm),
                    "train/skipped": bool(result.skipped and result.skipped[-1] == step),
                    "train/label_tokens": label_tokens,
                    "train/input_tokens": input_tokens,
                    "perf/tokens_per_s": input_tokens / step_s,
                    **preference,
                    **moe,
                    "memory": {f"rank{r}": m for r, m in enumerate(memory)},
                },
            )
        logger.progress(1, {"loss": f"{loss:.4f}"})
        result.wall_s = time.perf_counter() - start
        hooks.after_step(step, result)
    routing.close()
    result.wall_s = time.perf_counter() - start
    result.peak_memory = gather_memory(device)
    return result


def pair_means(sums: torch.Tensor | None, split: str) -> dict[str, float]:
    """``{split}/rewards/chosen`` … over every rank's pairs, from the preference loss's sums
    (:data:`memtune.rank.preference.STATS` then the pair count); {} for SFT. A collective."""
    if sums is None:
        return {}
    from memtune.rank.preference import STATS

    total = _all_reduce_sum(sums.clone()).tolist()
    pairs = max(total[-1], 1.0)
    return {f"{split}/{name}": value / pairs for name, value in zip(STATS, total, strict=False)}


def evaluate(
    engine: Any, batches: list[dict[str, torch.Tensor]], device: torch.device
) -> tuple[float, dict[str, float]]:
    """Loss over the validation shard of every rank (a collective), token-weighted (SFT) or
    pair-weighted (a preference objective, whose rewards come back too, as ``eval/...``).

    Every rank runs the same number of forward passes (ZeRO-3 gathers parameters in each),
    which :func:`memtune.data.loaders.eval_shard` guarantees by padding shards with label-free
    samples.
    """
    was_training = engine.training
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    pair_sums: torch.Tensor | None = None
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items() if k != "real_tokens"}
            totals[0] += engine(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).double()
            totals[1] += loss_units(batch)
            stats = _pair_stats(engine)
            if stats is not None:
                pair_sums = stats if pair_sums is None else pair_sums + stats
    if was_training:
        engine.train()
    loss_sum, count = _all_reduce_sum(totals).tolist()
    return loss_sum / max(count, 1.0), pair_means(pair_sums, "eval")
