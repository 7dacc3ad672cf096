"""memtune's lean SwiGLU (rank.lean_swiglu; trainer.swiglu_kernel=lean, auto's choice for the
dense Qwen models): transformers' values and gradients bit for bit, what it keeps for backward
and what its backward holds (the planner's figures, memory.mlp), wired into a model under every
recompute path, and refused by name where it is not built (auto's choice, the lean RMSNorm's
rule: tests/test_lean_norm.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memtune.config import ConfigError, to_run_config, validate
from memtune.config.decisions import Kernels
from memtune.memory import mlp as mlp_figures
from memtune.memory.mlp import swiglu_backward_bytes, swiglu_saved_bytes
from memtune.rank import lean_swiglu
from memtune.rank.kernels import kernels_label, reference_silu_mul, remove_kernels
from memtune.rank.kernels import use_fused_kernels as wire
from memtune.rank.lean_swiglu import lean_silu_mul
from memtune.tools.step_trace import Tracker
from tests.conftest import compose_cfg, decided
from tests.test_kernels import assert_same, step, tiny_lora

CPU = torch.device("cpu")
LEAN = Kernels(rms_norm="lean", swiglu="lean")


@pytest.fixture
def blocks_of_five(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The forward and backward five tokens a block (the rank's and the planner's constant)."""
    monkeypatch.setattr(lean_swiglu, "BLOCK_TOKENS", 5)
    monkeypatch.setattr(mlp_figures, "LEAN_SWIGLU_BLOCK_TOKENS", 5)
    yield 5


def _both(shape: tuple[int, ...], dtype: torch.dtype, needs: tuple[bool, bool]) -> list[list]:
    """[output, gate's gradient, up's gradient] of transformers' silu(gate) · up and of the
    lean one, the same inputs; ``needs``: which of gate and up require a gradient."""
    torch.manual_seed(0)
    gate0, up0 = torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)
    grad = torch.randn(shape, dtype=dtype)
    out = []
    for fn in (reference_silu_mul, lean_silu_mul):
        gate, up = (t.clone().requires_grad_(n) for t, n in zip((gate0, up0), needs, strict=True))
        y = fn(gate, up)
        y.backward(grad)
        out.append([y.detach(), gate.grad, up.grad])
    return out


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize(
    ("dtype", "needs"),
    [
        (torch.bfloat16, (True, True)),
        (torch.float32, (True, True)),  # trainer.precision=fp32
        (torch.bfloat16, (True, False)),  # up_proj without an adapter, its input frozen
    ],
)
def test_transformers_values_and_gradients_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, blocks: bool, dtype: torch.dtype, needs: tuple[bool, bool]
) -> None:
    """The same ops on the same values, one block or many (five tokens each, the last one
    short: each value stands alone): the same bits; no gradient where none is asked."""
    if blocks:
        monkeypatch.setattr(lean_swiglu, "BLOCK_TOKENS", 5)
    plain, lean = _both((3, 37, 64), dtype, needs)
    assert lean[0].dtype == dtype and torch.equal(lean[0], plain[0])
    for ours, theirs, needed in zip(lean[1:], plain[1:], needs, strict=True):
        assert (ours is not None) == needed
        if needed:
            assert torch.equal(ours, theirs) and ours.abs().sum() > 0


def _saved(fn: Any, gate: torch.Tensor, up: torch.Tensor) -> dict[int, int]:
    """The storages autograd keeps for backward (bytes)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(gate, up)
    return kept


def test_it_keeps_gate_and_up_not_silus_output() -> None:
    """bf16, 600 tokens × 96: transformers' keeps gate, up and SiLU's output; the lean one
    gate and up themselves (no new storage) — memory.mlp's figures for each."""
    tokens, inter = 600, 96
    gate, up = (torch.randn(2, 300, inter, dtype=torch.bfloat16, requires_grad=True) for _ in "gu")
    ptrs = {t.untyped_storage().data_ptr() for t in (gate, up)}
    plain = _saved(reference_silu_mul, gate, up)
    lean = _saved(lean_silu_mul, gate, up)
    assert set(lean) == ptrs and sum(lean.values()) == 2 * tokens * inter * 2
    assert ptrs < set(plain) and sum(plain.values()) == 3 * tokens * inter * 2
    d = decided(to_run_config(compose_cfg([])))
    assert d.kernels.swiglu == "lean"
    assert swiglu_saved_bytes(d, tokens, inter, 2) == sum(lean.values())
    torch_d = decided(to_run_config(compose_cfg(["trainer.swiglu_kernel=torch"])))
    assert swiglu_saved_bytes(torch_d, tokens, inter, 2) == sum(plain.values())


def test_the_backward_holds_both_gradients_and_one_block(blocks_of_five: int) -> None:
    """1,000 tokens × 96 in blocks of five: beside the incoming gradient the lean backward
    holds gate's and up's gradients and one block's temporary at its peak —
    memory.mlp.swiglu_backward_bytes, whose figure counts the incoming gradient too."""
    tokens, inter = 1000, 96
    d = decided(to_run_config(compose_cfg([])))
    planned = swiglu_backward_bytes(d, tokens, inter, 2)
    assert planned == 3 * tokens * inter * 2 + blocks_of_five * inter * 2
    gate, up = (torch.randn(tokens, inter, dtype=torch.bfloat16, requires_grad=True) for _ in "gu")
    grad = torch.randn(tokens, inter, dtype=torch.bfloat16)
    y = lean_silu_mul(gate, up)
    tracker = Tracker()
    for t in (gate, up, grad):
        tracker.track(t)
    start = tracker.total
    with tracker:
        y.backward(grad)
    assert tracker.peak - start == planned - tokens * inter * 2


def test_in_a_model_under_every_recompute_path(blocks_of_five: int) -> None:
    """Qwen2, 3 layers — recomputed in full, selectively, kept — LoRA with dropout on every
    linear layer, the lean RMSNorm and SwiGLU wired (as auto decides): every MLP reached, the
    logits and LoRA gradients of transformers' ops, five tokens a block; and taken out again
    (the MLP tiled and the inputs offloaded: tests/test_lean_norm.py, with both)."""
    model = tiny_lora("tiny-qwen2", recompute=1, selective=1)
    plain = step(model)
    wired = wire(model, LEAN, CPU)
    assert (wired.norms, wired.mlps, wired.attentions) == (3 * 2 + 1, 3, 0)
    assert kernels_label(wired, LEAN) == "lean RMSNorm + SwiGLU in 7 norms, 3 MLPs"
    mlp = model.get_base_model().model.layers[1].mlp
    assert type(mlp).__name__ == "FusedQwen2MLP"
    assert_same(step(model), plain)
    remove_kernels(model)
    assert type(mlp).__name__ == "Qwen2MLP"


def test_lean_where_it_is_not_wired_is_refused_by_name() -> None:
    cfg = to_run_config(compose_cfg(["model=tiny-qwen3-moe", "trainer.swiglu_kernel=lean"]))
    with pytest.raises(ConfigError, match=r"trainer\.swiglu_kernel=lean .*a mixture of experts"):
        validate(cfg, inputs=False)
