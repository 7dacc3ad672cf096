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
