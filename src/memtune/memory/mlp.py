"""What a dense MLP's activation, silu(gate) · up, keeps for backward and what its backward
holds, by kernel (decisions.json ``kernels.swiglu``): transformers' own, memtune's lean one
(rank.lean_swiglu), Liger's. The planner's rows (memory.estimate) and the lean kernel's block
size read them from here."""

from __future__ import annotations

from memtune.config.decisions import Decisions

LEAN_SWIGLU_BLOCK_TOKENS = 1024
"""memtune's lean SwiGLU (rank.lean_swiglu) runs its forward and backward this many tokens at
a time: its one temporary is this many tokens × intermediate values (39 MB at Qwen2.5-7B's
18,944 in bf16)."""


def swiglu_saved_bytes(d: Decisions, tokens: int, inter: int, b: int) -> int:
    """What the activation keeps over ``tokens`` × ``inter`` (the projections' outputs are
    counted here, not with the projections: gate_proj and up_proj keep nothing of their own
    output). transformers': gate (SiLU's input), SiLU's output and up (the product's two
    inputs); the lean one and Liger's: gate and up, SiLU's output made again in backward."""
    kept = 3 if d.kernels.swiglu == "torch" else 2
    return kept * tokens * inter * b


def swiglu_backward_bytes(d: Decisions, tokens: int, inter: int, b: int) -> int:
    """What the MLP's backward holds at once around the activation, in intermediate-wide
    tensors: the incoming gradient (of down_proj's input) and the gradients of gate and up
    (autograd's product backward makes the second and third together; SiLU's then replaces
    one); the lean one the same three and one block's temporary. Liger's writes its gradients
    into gate and up in place: counted as transformers' until a GPU measures it."""
    three = 3 * tokens * inter * b
    if d.kernels.swiglu == "lean":
        return three + min(tokens, LEAN_SWIGLU_BLOCK_TOKENS) * inter * b
    return three


def swiglu_forward_bytes(d: Decisions, tokens: int, inter: int, b: int) -> int:
    """What the activation's forward reads and writes over ``tokens`` × ``inter`` (a selective
    layer's recompute runs it again: memory.step_time): SiLU (its input read, its output
    written) and the product (two read, one written), transformers' and the lean one's alike
    (a block at a time, written in place); Liger's one kernel reads gate and up and writes the
    product."""
    per_value = 3 if d.kernels.swiglu == "liger" else 5
    return per_value * tokens * inter * b
