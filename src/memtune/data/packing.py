"""How samples fill packed rows, and what one optimizer step holds: the planning side of
batching, free of torch, so the launcher can say it before any rank starts without importing
torch (:mod:`memtune.data.batching` packs the loaders' rows with the same :func:`pack_bins`)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memtune.config.decisions import BatchShape
from memtune.config.schema import ConfigError


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: sample indices grouped into bins of at most ``capacity`` tokens.

    Longest first, each into the open bin it fills most tightly (a sorted list of free space
    keeps that a binary search), so hundreds of thousands of samples pack in seconds.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (capacity - n, len(bins) - 1))
    return bins


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step holds of the data, and what ``max_steps`` amounts to, for the
    user to read (the start-up line and ``data.json``): with packing, the global batch counts
    rows. The batch arithmetic itself is config.decisions.BatchShape's."""

    packed: bool
    samples: int
    items: int  # rows when packed, else samples
    item_tokens: int  # row capacity (max_seq_len) when packed
    fill: float  # real tokens / row capacity; 1 when not packed
    global_batch: int
    max_steps: int
    unit: str = "samples"
    """What an item of the data is: samples (SFT) or pairs (preference data)."""

    @property
    def samples_per_step(self) -> float:
        return self.global_batch * self.samples / self.items

    @property
    def usable(self) -> int:
        """The items an epoch holds: whole global batches (data.batching.GlobalOrderSampler
        cuts each epoch so; the rest wait for a later epoch's shuffle)."""
        return self.items // self.global_batch * self.global_batch

    @property
    def epochs(self) -> float:
        usable = self.usable
        return self.max_steps * self.global_batch / usable if usable else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "samples_per_step": round(self.samples_per_step, 2),
            "epochs": round(self.epochs, 3),
        }

    def line(self) -> str:
        u = self.unit
        what = "rows" if self.packed else u
        usable = self.usable
        epochs = f"max_steps {self.max_steps:,} ≈ {self.epochs:.2f} epochs of "
        if usable == self.items:
            epochs += f"{self.items:,} {what}"
        else:  # the sampler's epoch is whole steps (data.batching.GlobalOrderSampler)
            left = self.items - usable
            epochs += (
                f"{usable:,} of the {self.items:,} {what} (an epoch is whole steps: each "
                f"epoch leaves out {left:,} {what}, drawn at random)"
            )
        if not self.packed:
            return f"a step = {self.global_batch} {u}; {epochs}"
        per_row = self.samples / self.items
        return (
            f"a step = {self.global_batch} packed row{'s' if self.global_batch > 1 else ''} "
            f"of ≤ {self.item_tokens:,} tokens ≈ "
            f"{self.samples_per_step:,.1f} {u} ({per_row:.2f} per row, rows "
            f"{self.fill:.1%} full); {epochs}; data.packing=false would put one {u[:-1]} in "
            "each batch item"
        )


def step_shape(
    lengths: Sequence[int],
    packed: bool,
    batch: BatchShape,
    max_steps: int,
    unit: str = "samples",
) -> StepShape:
    """The loader's own packing (:func:`pack_bins`, deterministic) over the train lengths, in
    rows of ``batch.row_tokens``.

    Raises ConfigError when the data holds fewer rows (samples, unpacked) than one step takes:
    the ranks' sampler deals whole global batches, so it would hand them nothing to train on;
    the error names a global batch that fits (a multiple of the rows one micro step takes
    over the data-parallel ranks).
    """
    max_seq_len, global_batch = batch.row_tokens, batch.global_batch
    if not packed:
        shape = StepShape(False, len(lengths), len(lengths), 0, 1.0, global_batch, max_steps, unit)
    else:
        rows = len(pack_bins(lengths, max_seq_len))
        fill = sum(lengths) / (rows * max_seq_len) if rows else 0.0
        shape = StepShape(
            True, len(lengths), rows, max_seq_len, fill, global_batch, max_steps, unit
        )
    check_one_step(shape, batch.micro_step_rows)
    return shape


def check_one_step(shape: StepShape, micro_step: int = 1) -> None:
    """A training set smaller than one global batch cannot make a single step: the sampler
    keeps whole global batches only (rank.worker would fail on every rank with "0 items per
    epoch"). The fix is the global batch, or more data: a smaller micro batch does not help
    unless the global batch shrinks with it."""
    if shape.items >= shape.global_batch:
        return
    unit = "rows" if shape.packed else "samples"
    if shape.packed:
        have = (
            f"{shape.samples:,} samples, packed into {shape.items:,} row(s) of ≤ "
            f"{shape.item_tokens:,} tokens"
        )
    else:
        have = f"{shape.samples:,} samples"
    fits = shape.items // micro_step * micro_step
    if micro_step == 1:  # the caller did not say what one micro step over the ranks takes
        fix = (
            f"lower trainer.global_batch_size to at most {shape.items} (a multiple of "
            "trainer.micro_batch_size × data-parallel ranks)"
        )
    elif fits:
        fix = (
            f"set trainer.global_batch_size={fits} (the most that fits: a multiple of "
            f"micro batch × data-parallel ranks = {micro_step})"
        )
    else:  # micro batch × data-parallel ranks must shrink too: a setting that runs, whole
        fix = (
            f"one micro step over the ranks already takes {micro_step} {unit}, so the micro "
            "batch or the ranks must shrink with the global batch (it is a multiple of micro "
            f"batch × data-parallel ranks), e.g. on one node without a sequence split: "
            f"launcher.num_ranks=1 trainer.micro_batch_size=1 "
            f"trainer.global_batch_size={shape.items}"
        )
    if shape.packed and shape.samples >= shape.global_batch:  # the one change that does
        fix = f"set data.packing=false (the global batch then counts samples), or {fix}"
    raise ConfigError(
        f"trainer.global_batch_size={shape.global_batch} takes {shape.global_batch:,} {unit} "
        f"per step, but the training data has {have}: not one step. Fix: {fix}, or give more "
        "data"
    )
