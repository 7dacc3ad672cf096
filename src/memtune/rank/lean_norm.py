"""RMSNorm without its fp32 copies (decisions.json ``kernels.rms_norm = "lean"``;
trainer.rms_norm_kernel).

transformers' Qwen RMSNorm upcasts its input to fp32 and normalises it there. Autograd then
keeps that fp32 copy for backward (4 bytes a value where the input had 2), and the backward —
a chain of fp32 elementwise ops over the whole sequence — holds about five such tensors at once.
In a recomputed layer at long context this is the step's peak: at 49,152 tokens on one GPU the
two norms' fp32 copies held 1.31 GiB and the backward's own temporaries 3.61 GiB, of 9.22 GiB
(bench/results/2026-12-04-h200-long.md).

``lean`` is the same computation as one autograd Function (:class:`LeanRMSNorm`):

* The forward runs transformers' ops in transformers' order, a block of tokens at a time (each
  token is normalised on its own, so a block gives the same values as the whole), and keeps the
  input as it came (bf16) and each token's inverse RMS (one fp32 value a token).
* The backward makes the fp32 copy again from the kept input (an exact cast) and runs, block by
  block, the ops autograd runs for transformers' forward, in its order — the gradient is the
  same bit for bit on the same machine (tests/test_lean_norm.py) — with at most
  :data:`~memtune.memory.norms.LEAN_NORM_BLOCK_TOKENS` tokens' temporaries alive at once
  (rows narrower than :data:`~memtune.memory.norms.LEAN_NORM_NARROW_WIDTH`, proportionally
  more rows: :func:`block_rows`).

The cost is one more cast of the input in backward (memory-bound, small beside a layer's
matmuls). A trainable norm weight (a plain full fine-tune of the norms) takes transformers' own
path: only the input's gradient is written here.
"""

from __future__ import annotations

from typing import Any

import torch

from memtune.memory.norms import LEAN_NORM_BLOCK_TOKENS as BLOCK_TOKENS
from memtune.memory.norms import LEAN_NORM_NARROW_WIDTH as NARROW_WIDTH
from memtune.memory.norms import lean_norm_block_rows


def block_rows(width: int) -> int:
    """Rows a block of the lean RMSNorm runs at once, at this width (this module's constants,
    which the tests shrink)."""
    return lean_norm_block_rows(width, BLOCK_TOKENS, NARROW_WIDTH)


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen2RMSNorm.forward on ``x``, op for op, and the inverse RMS it used."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


class LeanRMSNorm(torch.autograd.Function):
    """weight · x / rms(x) keeping x and the inverse RMS, not x in fp32; see the module
    docstring. Only ``x`` gets a gradient (the weight is frozen: :func:`lean_rms_norm`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The output is a tensor of its own, never a view (of a block buffer, of a reshape):
        # autograd forbids an in-place op on a custom Function's view output, or on any view
        # of it (``q_norm(...).transpose(1, 2)`` then ``mul_``), where transformers' allows it.
        width = x.shape[-1]
        step = block_rows(width)
        if x.numel() <= step * width:
            out, rstd = _normed(x, weight, eps)  # every op is over the last dim: any shape
            rstd = rstd.reshape(-1, 1)
        else:
            rows = x.reshape(-1, width)
            dtype = torch.promote_types(weight.dtype, x.dtype)  # weight · x promotes
            out = x.new_empty(x.shape, dtype=dtype)
            flat = out.view(-1, width)
            rstd = rows.new_empty((rows.shape[0], 1), dtype=torch.float32)
            for start in range(0, rows.shape[0], step):
                block = slice(start, start + step)
                flat[block], rstd[block] = _normed(rows[block], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        rows, grads = x.reshape(-1, width), grad.reshape(-1, width)
        dx = torch.empty_like(rows)
        step = block_rows(width)
        for start in range(0, rows.shape[0], step):
            block = slice(start, start + step)
            dx[block] = _input_grad(rows[block], grads[block], weight, rstd[block])
        return dx.view(x.shape), None, None


def _input_grad(
    x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """What autograd computes for x's gradient through _normed's ops, in the order and the
    formulas of torch's derivatives (tools/autograd/derivatives.yaml): mul, the cast back, the
    normalising mul, rsqrt, the mean, pow; the two paths into the fp32 input summed, then cast
    to x's dtype."""
    g = (grad * weight).to(x.dtype).to(torch.float32)  # weight · h.to(dtype), then the cast
    h = x.to(torch.float32)
    g_rstd = (g * h).sum(-1, keepdim=True)  # rstd broadcast over the width: summed back
    through_product = g * rstd
    del g
    g_variance = (-0.5 * g_rstd) * rstd.pow(3)  # rsqrt's derivative (eps's add passes it on)
    g_square = g_variance.expand_as(h) / h.shape[-1]  # the mean's
    # pow(2)'s: grad · (2 · h.pow(1)); in place where torch makes a fresh tensor (the same
    # products), so at most four fp32 blocks live at once (LEAN_NORM_BACKWARD_FP32)
    two_h = h.pow(1.0).mul_(2.0)
    del h
    through_square = g_square.mul_(two_h)
    del two_h
    return through_product.add_(through_square).to(x.dtype)


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel rank.kernels wires into each RMSNorm module; a weight that trains (its
    gradient is not written here) takes transformers' own ops."""
    if weight.requires_grad:
        return _normed(x, weight, eps)[0]
    out: torch.Tensor = LeanRMSNorm.apply(x, weight, eps)
    return out
