"""memtune's lean RMSNorm (rank.lean_norm; trainer.rms_norm_kernel=lean, auto's choice for the
dense Qwen models): transformers' values and gradients, what it keeps for backward and what its
backward holds (the planner's figures), wired into a model under every recompute path, and
decided where it is built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memtune.config import ConfigError, to_run_config, validate
from memtune.config.decisions import Decisions, Kernels
from memtune.memory import norms
from memtune.memory.norms import norm_backward_bytes, norm_saved_bytes
from memtune.rank import lean_norm
from memtune.rank.kernels import kernels_label, reference_rms_norm, remove_kernels
from memtune.rank.kernels import use_fused_kernels as wire
from memtune.rank.lean_norm import lean_rms_norm
from memtune.tools.step_trace import Tracker
from tests.conftest import compose_cfg, decided
from tests.test_kernels import assert_same, step, tiny_lora

CPU = torch.device("cpu")
LEAN = Kernels(rms_norm="lean")


@pytest.fixture
def blocks_of_five(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The forward and backward five tokens a block (the rank's and the planner's constant)."""
    monkeypatch.setattr(lean_norm, "BLOCK_TOKENS", 5)
    monkeypatch.setattr(lean_norm, "NARROW_WIDTH", 1)  # every width a hidden norm's
    monkeypatch.setattr(norms, "LEAN_NORM_BLOCK_TOKENS", 5)
    yield 5


def _both(
    shape: tuple[int, ...], dtype: torch.dtype, weight_dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(output, input gradient) of transformers' RMSNorm and of the lean one, same inputs."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 3
    weight = (torch.randn(shape[-1]) * 0.5 + 1).to(weight_dtype)
    grad = torch.randn(shape, dtype=torch.promote_types(dtype, weight_dtype))
    out = []
    for fn in (reference_rms_norm, lean_rms_norm):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, weight, 1e-6)
        y.backward(grad)
        out.append([y.detach(), leaf.grad])
    return out[0], out[1]


CASES = [
    ((2, 37, 64), torch.bfloat16, torch.bfloat16),  # a layer's norm, bf16
    ((2, 37, 64), torch.bfloat16, torch.float32),  # an fp32 weight (the output promotes)
    ((3, 7, 4, 16), torch.bfloat16, torch.bfloat16),  # Qwen3's per-head q / k norm
    ((2, 37, 64), torch.float32, torch.float32),  # trainer.precision=fp32
]


@pytest.mark.parametrize(("shape", "dtype", "weight_dtype"), CASES)
def test_transformers_values_and_gradients_bit_for_bit(shape, dtype, weight_dtype) -> None:
    """One block: the same ops on the same tensors, so the same bits."""
    plain, lean = _both(shape, dtype, weight_dtype)
    assert lean[0].dtype == plain[0].dtype and lean[1].dtype == dtype
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    assert lean[1].abs().sum() > 0


@pytest.mark.parametrize(("shape", "dtype", "weight_dtype"), CASES[:3])
def test_block_by_block_gives_the_same(blocks_of_five: int, shape, dtype, weight_dtype) -> None:
    """Many blocks (five tokens each, the last one short): each token is normalised alone, so
    the blocks give the whole's values (bit for bit here; within an fp32 rounding wherever a
    machine reduces a short block differently)."""
    plain, lean = _both(shape, dtype, weight_dtype)
    rows = torch.Size(shape[:-1]).numel()
    assert rows > 3 * blocks_of_five and rows % blocks_of_five
    torch.testing.assert_close(lean[0], plain[0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(lean[1], plain[1])


def test_a_trainable_weight_takes_transformers_ops() -> None:
    """The lean function writes only the input's gradient: a norm weight that trains (not
    memtune's LoRA, whose base is frozen) gets transformers' own graph, and its gradient."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, 32, dtype=torch.bfloat16)
    grads = []
    for fn in (reference_rms_norm, lean_rms_norm):
        weight = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)
        fn(x, weight, 1e-6).sum().backward()
        grads.append(weight.grad)
    assert grads[1] is not None and torch.equal(grads[0], grads[1])


def _saved(fn: Any, x: torch.Tensor, weight: torch.Tensor) -> dict[int, int]:
    """The storages autograd keeps for backward (bytes), the weight's left out."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, weight, 1e-6)
    kept.pop(weight.untyped_storage().data_ptr(), None)
    return kept


def test_it_keeps_the_input_and_an_inverse_rms_a_token_not_an_fp32_copy() -> None:
    """bf16, 2 × 300 tokens × 64: transformers' keeps the input in fp32 (4 bytes a value), the
    lean one the input itself (no new storage) and 4 bytes a token; the planner's figures."""
    x = torch.randn(2, 300, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(64, dtype=torch.bfloat16)
    tokens, d = 600, decided(to_run_config(compose_cfg([])))
    plain = _saved(reference_rms_norm, x, weight)
    assert sum(plain.values()) == tokens * 64 * 4 + tokens * 4  # the fp32 input and its rsqrt
    lean = _saved(lean_rms_norm, x, weight)
    assert lean.pop(x.untyped_storage().data_ptr()) == tokens * 64 * 2  # x itself
    assert sum(lean.values()) == tokens * 4
    assert d.kernels.rms_norm == "lean"
    assert norm_saved_bytes(d, tokens, 64, 2) == tokens * 64 * 2 + tokens * 4
    torch_d = decided(to_run_config(compose_cfg(["trainer.rms_norm_kernel=torch"])))
    assert norm_saved_bytes(torch_d, tokens, 64, 2) == tokens * 64 * 4


def test_the_backward_holds_a_few_blocks_and_the_gradient(blocks_of_five: int) -> None:
    """1,000 tokens × 64 in blocks of five: the lean backward holds the input's gradient (bf16)
    and four fp32 blocks at its peak — memory.norms.norm_backward_bytes — where
    transformers' holds fp32 tensors of the whole sequence."""
    del blocks_of_five
    tokens, width = 1000, 64
    d = decided(to_run_config(compose_cfg([])))
    planned = norm_backward_bytes(d, tokens, width, 2)
    assert planned == tokens * width * 2 + 4 * 5 * width * 4
    peak = _lean_backward_peak(tokens, width)
    assert planned <= peak <= planned * 1.03, (peak, planned)  # + the per-token sums
    torch_d = decided(to_run_config(compose_cfg(["trainer.rms_norm_kernel=torch"])))
    assert norm_backward_bytes(torch_d, tokens, width, 2) > 10 * planned / 2


def _lean_backward_peak(tokens: int, width: int) -> int:
    """The lean backward's allocations at their peak, above its input, its saved inverse RMS
    and the incoming gradient (all alive before it starts)."""
    x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(width, dtype=torch.bfloat16)
    grad = torch.randn(tokens, width, dtype=torch.bfloat16)
    y = lean_rms_norm(x, weight, 1e-6)
    tracker = Tracker()
    for t in (x, grad, *_saved_tensors(y)):
        tracker.track(t)
    start = tracker.total
    with tracker:
        y.backward(grad)
    return tracker.peak - start


def _saved_tensors(y: torch.Tensor) -> list[torch.Tensor]:
    node: Any = y.grad_fn
    return list(node.saved_tensors)


def test_in_a_model_under_every_recompute_path(blocks_of_five: int) -> None:
    """Qwen3 (per-head q / k norms), 3 layers — recomputed in full, selectively, kept — LoRA
    with dropout on every linear layer: every norm reached, the same logits and LoRA gradients
    as transformers' norms, five tokens a block (the logits bit for bit; the gradients to
    fp32's rounding: in an
    fp32 model transformers' upcast is the input itself, so the residual's gradient and the
    norm's two are summed in another order); then the MLP tiled and the layers' inputs offloaded
    (rank.long_context's own checkpoint); and taken out again."""
    from memtune.rank.long_context import offload_checkpoints, tile_mlps, untile_mlps

    model = tiny_lora("tiny-qwen3", recompute=1, selective=1)
    plain = step(model)
    wired = wire(model, LEAN, CPU)
    assert wired.norms == 3 * 4 + 1 and (wired.mlps, wired.attentions) == (0, 0)
    assert kernels_label(wired, LEAN) == "lean RMSNorm in 13 norms"
    norm = model.get_base_model().model.layers[0].self_attn.q_norm
    assert type(norm).__name__ == "FusedQwen3RMSNorm"
    assert_same(step(model), plain)
    remove_kernels(model)
    assert type(norm).__name__ == "Qwen3RMSNorm"

    long = tiny_lora("tiny-qwen2", recompute=3, selective=0)
    base = long.get_base_model()
    tile_mlps(base, tokens=768)
    offload_checkpoints(base, CPU)
    plain = step(long)
    wire(long, Kernels(rms_norm="lean", swiglu="lean"), CPU)  # the tiles run the lean SwiGLU
    assert_same(step(long), plain)
    untile_mlps(base)
    remove_kernels(long)


@pytest.mark.parametrize(
    ("overrides", "kernel"),
    [
        ([], "lean"),  # the CPU demo: a tiny Qwen2
        (["model=tiny-qwen3"], "lean"),
        (["model=tiny-qwen3-moe"], "torch"),
        (["model=tiny-qwen3.5"], "torch"),
        (["model=tiny-qwen2.5-vl"], "torch"),  # the vision-language models: their own norms
        (["trainer.compile=true"], "torch"),
        (["trainer.rms_norm_kernel=torch", "trainer.swiglu_kernel=torch"], "torch"),
    ],
)
def test_auto_is_lean_where_it_is_wired(overrides: list[str], kernel: str) -> None:
    """RMSNorm's and SwiGLU's (rank.lean_swiglu) auto alike: one rule, config.decisions."""
    d = decided(to_run_config(compose_cfg(overrides)))
    assert d.kernels.rms_norm == d.kernels.swiglu == kernel
    assert d.kernels.label() == ("lean RMSNorm + SwiGLU" if kernel == "lean" else "torch")
    raw = d.as_dict()
    assert raw["kernels"]["rms_norm"] == raw["kernels"]["swiglu"] == kernel
    assert Decisions.from_dict(raw) == d


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model=tiny-qwen3-moe"], "a mixture of experts"),
        (["model=tiny-qwen3.5"], "linear-attention layers"),
        (["trainer.compile=true"], "trainer.compile=true"),
    ],
)
def test_lean_where_it_is_not_wired_is_refused_by_name(overrides: list[str], named: str) -> None:
    cfg = to_run_config(compose_cfg([*overrides, "trainer.rms_norm_kernel=lean"]))
    with pytest.raises(ConfigError, match=rf"trainer\.rms_norm_kernel=lean .*{named}"):
        validate(cfg, inputs=False)


@pytest.mark.parametrize("blocks", [False, True])
def test_its_output_takes_an_in_place_op_as_transformers_does(
    monkeypatch: pytest.MonkeyPatch, blocks: bool
) -> None:
    """The output is a tensor of its own, not a view made inside the Function: autograd
    refuses an in-place op on such a view, or on a view of it (Qwen3's q_norm output is
    transposed, then rotated: in place by Liger's rotary, or by any consumer), where
    transformers' output takes it. One block and many, the same values and gradients."""
    if blocks:
        monkeypatch.setattr(lean_norm, "BLOCK_TOKENS", 5)
        monkeypatch.setattr(lean_norm, "NARROW_WIDTH", 1)
    torch.manual_seed(0)
    x0 = torch.randn(3, 7, 4, 16, dtype=torch.bfloat16)
    weight = (torch.randn(16) * 0.5 + 1).to(torch.bfloat16)
    got = []
    for fn in (reference_rms_norm, lean_rms_norm):
        x = x0.clone().requires_grad_()
        q = fn(x, weight, 1e-6).transpose(1, 2)
        q.mul_(2.0)
        (q * torch.linspace(-1, 1, q.numel()).view(q.shape)).sum().backward()
        got.append((q.detach(), x.grad))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=0, atol=0)
    torch.testing.assert_close(got[1][1], got[0][1])


def test_narrow_rows_go_more_to_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's per-head q / k norms (128 wide, every head of every token a row) run blocks of
    about a hidden norm's values, not of its rows: a tenth of the Python loop's launches at
    Qwen3-8B's shapes; a hidden norm's blocks stay the planner's tokens."""
    monkeypatch.setattr(lean_norm, "NARROW_WIDTH", 1024)
    calls: list[int] = []
    normed = lean_norm._normed

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        calls.append(x.shape[0])
        return normed(x, weight, eps)

    monkeypatch.setattr(lean_norm, "_normed", counted)
    assert lean_norm.block_rows(3584) == lean_norm.block_rows(1024) == lean_norm.BLOCK_TOKENS
    assert lean_norm.block_rows(128) == 8 * lean_norm.BLOCK_TOKENS
    x = torch.randn(1, 4096, 32 + 8, 128, dtype=torch.bfloat16)  # 4,096 tokens' q and k heads
    lean_rms_norm(x, torch.ones(128, dtype=torch.bfloat16), 1e-6)
    assert len(calls) == 5 and calls[0] == 8 * lean_norm.BLOCK_TOKENS  # not 40 of 4,096 rows
