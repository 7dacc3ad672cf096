"""The MLP's silu(gate) · up without keeping silu's output (decisions.json
``kernels.swiglu = "lean"``; trainer.swiglu_kernel).

transformers' Qwen MLP computes ``act_fn(gate_proj(x)) * up_proj(x)``. Autograd keeps, for the
product's backward, both its inputs: ``up`` and SiLU's output — a tensor as wide as the MLP's
intermediate layer (18,944 values a token in Qwen2.5-7B) that the forward made only to multiply
it. SiLU keeps ``gate`` for its own backward. So a kept layer holds three intermediate-wide
tensors a token where two determine the third: one ninth more than a token's whole LoRA layer
is worth at 4,096 tokens, which the planner buys back with recompute.

``lean`` is the same computation as one autograd Function (:class:`LeanSiluMul`) that keeps
``gate`` and ``up`` only:

* The forward runs transformers' two ops, a block of tokens at a time into one output (each
  value stands alone, so blocks give the whole's values).
* The backward makes SiLU's output again from ``gate`` (the same op on the same values: the
  same bits) and runs the two derivatives autograd runs — the product's (``grad · up``,
  ``grad · silu(gate)``) and SiLU's (``aten.silu_backward``) — block by block into the two
  gradients, with one block of temporaries alive at a time. The gradients are autograd's bit
  for bit (tests/test_lean_swiglu.py) wherever a block's values fill the vector lanes as the
  whole's do (every Qwen width; a block ending mid-vector may round an fp32 value in its last
  bit).

The cost is one more SiLU over the intermediate values in backward: memory-bound and small
beside the MLP's three matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memtune.memory.mlp import LEAN_SWIGLU_BLOCK_TOKENS as BLOCK_TOKENS


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LeanSiluMul(torch.autograd.Function):
    """silu(gate) · up keeping gate and up, not silu(gate); see the module docstring."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"lean SwiGLU: gate {tuple(gate.shape)} and up {tuple(up.shape)}")
        ctx.save_for_backward(gate, up)
        if gate.numel() <= BLOCK_TOKENS * gate.shape[-1]:
            return F.silu(gate) * up
        out = gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))
        rows, gates, ups = _rows(out), _rows(gate), _rows(up)
        for start in range(0, rows.shape[0], BLOCK_TOKENS):
            block = slice(start, start + BLOCK_TOKENS)
            torch.mul(F.silu(gates[block]), ups[block], out=rows[block])
        return out

    @staticmethod
    @once_differentiable  # its out= kernels have no derivative of their own: say so plainly
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        wants_gate, wants_up = ctx.needs_input_grad
        gates, ups, grads = _rows(gate), _rows(up), _rows(grad)
        d_gate = torch.empty_like(gates) if wants_gate else None
        d_up = torch.empty_like(ups) if wants_up else None
        for start in range(0, gates.shape[0], BLOCK_TOKENS):
            block = slice(start, start + BLOCK_TOKENS)
            if d_up is not None:  # the product's derivative by up: grad · silu(gate)
                torch.mul(grads[block], F.silu(gates[block]), out=d_up[block])
            if d_gate is not None:  # by silu(gate): grad · up; then SiLU's own
                through = grads[block] * ups[block]
                torch.ops.aten.silu_backward.grad_input(
                    through, gates[block], grad_input=d_gate[block]
                )
                del through  # not alive beside the next block's SiLU
        return (
            None if d_gate is None else d_gate.view(gate.shape),
            None if d_up is None else d_up.view(up.shape),
        )


def lean_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The function rank.kernels wires into each dense Qwen MLP in place of
    ``act_fn(gate) * up``."""
    out: torch.Tensor = LeanSiluMul.apply(gate, up)
    return out
