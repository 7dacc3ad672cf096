"""What an RMSNorm keeps for backward and what its backward holds, by kernel (decisions.json
``kernels.rms_norm``): transformers' own, memtune's lean one (rank.lean_norm), Liger's. The
planner's rows (memory.estimate) and the lean kernel's block size read them from here."""

from __future__ import annotations

from memtune.config.decisions import Decisions

NORM_BACKWARD_FP32 = 5
"""transformers' RMSNorm's backward (it upcasts to fp32) holds this many tokens × hidden fp32
temporaries at once (tools.step_trace; the allocator's census on an H200 for a recomputed
layer's norm)."""
LEAN_NORM_BLOCK_TOKENS = 4096
"""memtune's lean RMSNorm (rank.lean_norm) runs its forward and backward this many tokens at a
time: what bounds its fp32 temporaries."""
LEAN_NORM_NARROW_WIDTH = 1024
"""Rows narrower than this (Qwen3's per-head q / k norms: 128 wide, a token's heads each a row)
go that many times more to a lean norm's block, so that a block holds about as many values as a
hidden norm's: 4,096 rows of 128 would be a Python loop of ~40 kernel launches a block over
tokens × heads rows (320 blocks a layer at 32k tokens), launch-bound on a GPU for no memory
the planner counts."""
LEAN_NORM_BACKWARD_FP32 = 4
"""... of which its backward holds this many block-sized fp32 tensors at once (the recomputed
fp32 input, the two partial gradients, pow's; tools.step_trace)."""


def norm_saved_bytes(d: Decisions, rows: int, width: int, b: int) -> int:
    """What one RMSNorm over ``rows`` × ``width`` keeps for backward: transformers' its input
    upcast to fp32; memtune's lean one (rank.lean_norm) and Liger's the input as it came and
    one fp32 inverse RMS a row."""
    if d.kernels.rms_norm == "torch":
        return rows * width * 4
    return rows * width * b + rows * 4


def norm_backward_bytes(d: Decisions, tokens: int, width: int, b: int) -> int:
    """What an RMSNorm's backward allocates at once over ``tokens`` × ``width``: transformers'
    runs in fp32 over the whole sequence; the lean one a block of tokens at a time into the
    input's gradient (its own dtype); Liger's writes that gradient alone."""
    if d.kernels.rms_norm == "torch":
        return NORM_BACKWARD_FP32 * tokens * width * 4
    grad = tokens * width * b
    if d.kernels.rms_norm == "liger":
        return grad
    block = min(tokens, LEAN_NORM_BLOCK_TOKENS) * width
    return grad + LEAN_NORM_BACKWARD_FP32 * block * 4


def lean_norm_block_rows(
    width: int, tokens: int = LEAN_NORM_BLOCK_TOKENS, narrow: int = LEAN_NORM_NARROW_WIDTH
) -> int:
    """Rows the lean RMSNorm runs at once at this width: ``tokens`` of them, and for rows
    narrower than ``narrow`` proportionally more (rank.lean_norm passes its own constants)."""
    return tokens * max(1, narrow // max(width, 1))


def norm_forward_bytes(d: Decisions, rows: int, width: int, b: int) -> int:
    """What one RMSNorm's forward reads and writes over ``rows`` × ``width`` (a selective
    layer's recompute runs it again: memory.step_time). transformers' ops, which the lean
    norm runs too: the cast to fp32 (none in fp32), the square, the mean, the product with the
    inverse RMS, the cast back, the weight — 20 + 2·b bytes a value and the casts' 2·(b + 4);
    the lean norm over more rows than a block writes each block into the whole (2·b more);
    Liger's one kernel reads the input and writes the output."""
    if d.kernels.rms_norm == "liger":
        return rows * width * 2 * b
    casts = 0 if b == 4 else 2 * (b + 4)
    blocks = d.kernels.rms_norm == "lean" and rows > lean_norm_block_rows(width)
    return rows * width * (20 + 2 * b + casts + (2 * b if blocks else 0))
