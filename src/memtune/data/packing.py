"""How samples fill packed rows, and what one optimizer step holds: the planning side of
batching, free of torch, so the launcher can say it before any rank starts without importing
torch (:mod:`memtune.data.batching` packs the loaders' rows with the same :func:`pack_bins`)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


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
    """What one optimizer step holds, and what ``max_steps`` amounts to, for the user to read
    (the start-up line and ``data.json``): with packing, ``global_batch_size`` counts rows."""

    packed: bool
    samples: int
    items: int  # rows when packed, else samples
    item_tokens: int  # row capacity (max_seq_len) when packed
    fill: float  # real tokens / row capacity; 1 when not packed
    global_batch: int
    max_steps: int

    @property
    def samples_per_step(self) -> float:
        return self.global_batch * self.samples / self.items

    @property
    def epochs(self) -> float:
        usable = self.items // self.global_batch * self.global_batch
        return self.max_steps * self.global_batch / usable if usable else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "samples_per_step": round(self.samples_per_step, 2),
            "epochs": round(self.epochs, 3),
        }

    def line(self) -> str:
        epochs = f"max_steps {self.max_steps:,} ≈ {self.epochs:.2f} epochs"
        if not self.packed:
            return f"a step = {self.global_batch} samples; {epochs} of {self.samples:,} samples"
        per_row = self.samples / self.items
        return (
            f"a step = {self.global_batch} packed rows of ≤ {self.item_tokens:,} tokens ≈ "
            f"{self.samples_per_step:,.1f} samples ({per_row:.2f} per row, rows "
            f"{self.fill:.1%} full); {epochs} of {self.items:,} rows "
            "(data.packing=false would put one sample in each batch item)"
        )


def step_shape(
    lengths: Sequence[int], packed: bool, max_seq_len: int, global_batch: int, max_steps: int
) -> StepShape:
    """The loader's own packing (:func:`pack_bins`, deterministic) over the train lengths."""
    if not packed:
        return StepShape(False, len(lengths), len(lengths), 0, 1.0, global_batch, max_steps)
    rows = len(pack_bins(lengths, max_seq_len))
    fill = sum(lengths) / (rows * max_seq_len) if rows else 0.0
    return StepShape(True, len(lengths), rows, max_seq_len, fill, global_batch, max_steps)
