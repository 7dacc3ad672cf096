"""Which matmul outputs a selective layer keeps: one rule for the rank's checkpoint policy
(rank.layers, called for every operator a selective layer runs, so it imports nothing heavy)
and the planner's count of what such a layer keeps (memory.estimate.selective_kept)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtune.memory.counts import ParamCounts

RECOMPUTED_OUT_PER_INNER = 8
"""A selective layer recomputes a matmul whose output has this many values or more for each
step of its inner dimension (:func:`keeps_matmul_output`)."""


def keeps_matmul_output(inner: int, out: int) -> bool:
    """Whether a selective layer keeps a matmul's output (rank.layers), by its inner dimension
    and output width: a value of the output costs 2 × ``inner`` FLOPs to make again, so an
    output ``RECOMPUTED_OUT_PER_INNER`` times wider than the inner dimension is cheap to
    recompute for the memory it holds — LoRA's B (r deep: r = 16 against 18,944 values a token
    for gate_proj's), made again from the kept A output. The base projections (in ≥ out / 8 in
    every Qwen layer) and LoRA's A (r wide) are kept."""
    return out < RECOMPUTED_OUT_PER_INNER * inner


def adapter_outputs(counts: ParamCounts) -> list[tuple[str, int, int, bool]]:
    """(name, r, output width, whether a selective layer keeps B's output) of each adapter of a
    decoder layer (counts.lora_inputs, by module name)."""
    widths = {name.split(".")[-1]: out for name, _, out in counts.linear_shapes}
    return [
        (name, r, widths[name], keeps_matmul_output(r, widths[name]))
        for name, _, r in counts.lora_inputs
    ]
