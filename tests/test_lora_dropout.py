"""LoRA dropout regenerated in backward (rank.lora_dropout; trainer.lora_dropout_kernel):
decided, refused where it is not built, the same losses and gradients as peft's dropout — in
layers kept, recomputed in full and selectively, over a 4-bit base, under ZeRO-3 — and none
of peft's dropped copies kept, as the plan says."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from memtune.config import ConfigError, to_run_config, validate
from memtune.config.decisions import DecisionError, Decisions, Kernels
from memtune.memory.counts import count_params
from memtune.memory.estimate import DROPOUT_ROW, activation_bytes, plan
from memtune.memory.step_time import dropout_pass_bytes
from memtune.rank.lora_dropout import (
    RegeneratedDropoutLinear,
    regenerated_dropouts,
    use_lora_dropout,
)
from tests.conftest import compose_cfg, decided
from tests.test_kernels import (  # noqa: F401 (one_rank: a fixture)
    IDS,
    ZERO3_ONE_RANK,
    one_rank,
    step,
    tiny_lora,
)


def test_auto_regenerates_where_it_is_built_and_a_setting_is_taken_as_given() -> None:
    def kernel(*overrides: str) -> str:
        return decided(to_run_config(compose_cfg(list(overrides)))).kernels.lora_dropout

    assert kernel("peft.dropout=0.1") == "regenerate"
    assert kernel("peft.dropout=0") == "peft"  # nothing dropped
    assert kernel("peft.dropout=0.1", "peft.dora=true") == "peft"
    assert kernel("peft.dropout=0.1", "trainer.compile=true") == "peft"
    assert kernel("peft.dropout=0.1", "trainer.lora_dropout_kernel=peft") == "peft"
    with pytest.raises(ConfigError, match=r"trainer.lora_dropout_kernel=regenerate .*peft.dora"):
        validate(
            compose_cfg(
                ["peft.dora=true", "peft.dropout=0.1", "trainer.lora_dropout_kernel=regenerate"]
            )
        )
    with pytest.raises(ConfigError, match=r"regenerate with peft.dropout=0: nothing is dropped"):
        validate(compose_cfg(["peft.dropout=0", "trainer.lora_dropout_kernel=regenerate"]))
    # decisions.json: a file from before the field reads as peft's (what those runs ran), and
    # a value outside the choices is refused by its name.
    d = decided(to_run_config(compose_cfg(["peft.dropout=0.1"])))
    raw = d.as_dict()
    assert raw["kernels"]["lora_dropout"] == "regenerate"
    del raw["kernels"]["lora_dropout"]
    assert Decisions.from_dict(raw).kernels == Kernels(
        d.kernels.rms_norm, d.kernels.swiglu, lora_dropout="peft"
    )
    raw["kernels"]["lora_dropout"] = "keep"
    with pytest.raises(DecisionError, match=r"kernels\.lora_dropout is 'keep'"):
        Decisions.from_dict(raw)


def test_the_same_logits_and_gradients_as_peft_in_kept_full_and_selective_layers() -> None:
    """Qwen3, 3 layers (one recomputed in full, one selectively, one keeping everything),
    LoRA on every linear layer with dropout 0.1: regenerated, peft's again, and the two equal;
    the masks matter (dropout 0 gives other gradients)."""
    model = tiny_lora("tiny-qwen3", recompute=1, selective=1)
    assert regenerated_dropouts(model) == 3 * 7  # add_lora applied auto's choice
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj.lora_A["default"]) is RegeneratedDropoutLinear
    assert type(q_proj.lora_dropout["default"]) is torch.nn.Identity
    regenerated = step(model)
    assert use_lora_dropout(model, "peft") == 0
    assert type(q_proj.lora_A["default"]) is torch.nn.Linear
    assert type(q_proj.lora_dropout["default"]) is torch.nn.Dropout
    peft = step(model)
    torch.testing.assert_close(regenerated[0], peft[0], rtol=1e-6, atol=1e-6)
    assert regenerated[1].keys() == peft[1].keys() and len(peft[1]) == 3 * 14
    for name in peft[1]:
        torch.testing.assert_close(regenerated[1][name], peft[1][name], rtol=1e-5, atol=1e-7)
    names = set(model.state_dict())
    assert use_lora_dropout(model, "regenerate") == 3 * 7
    assert set(model.state_dict()) == names  # the same names: export sees peft's modules
    undropped = step(tiny_lora("tiny-qwen3", "peft.dropout=0", recompute=1, selective=1))
    assert max((undropped[1][n] - peft[1][n]).abs().max() for n in peft[1]) > 1e-3


def test_over_a_4bit_base() -> None:
    """QLoRA: bitsandbytes' 4-bit layers under the adapters, bf16, a layer recomputed."""
    from memtune.rank.model import add_lora, load_base_model
    from memtune.tools.tiny import synthesize

    cfg = to_run_config(
        compose_cfg(
            [
                "peft=qlora-nf4",
                "trainer.precision=bf16",
                "peft.target=all-linear",
                "peft.dropout=0.2",
            ]
        )
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, recompute=1, attention="sdpa")
    assert d.kernels.lora_dropout == "regenerate"
    model = add_lora(load_base_model(cfg, d), cfg, d).train()
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.normal_(0, 0.05)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == "Linear4bit"
    assert regenerated_dropouts(model) == 2 * 7
    regenerated = step(model)
    use_lora_dropout(model, "peft")
    peft = step(model)
    assert torch.equal(regenerated[0], peft[0])
    assert len(peft[1]) == 28
    for name in peft[1]:
        torch.testing.assert_close(regenerated[1][name], peft[1][name], rtol=1e-2, atol=1e-4)


def test_under_zero3(one_rank: None) -> None:  # noqa: F811 (the fixture)
    """build_rank's ZeRO-3 engine, every weight partitioned (the adapters' A too): the loss and
    every LoRA gradient equal peft's dropout's."""
    from deepspeed.utils import safe_get_full_grad

    from memtune.config.deepspeed import build_ds_config
    from memtune.rank.build import build_rank
    from memtune.tools.tiny import synthesize

    cfg = to_run_config(
        compose_cfg(
            [
                "trainer.precision=fp32",
                "peft.target=all-linear",
                "peft.dropout=0.1",
                "++model.architecture.num_hidden_layers=2",
                *ZERO3_ONE_RANK,
            ]
        )
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, recompute=1, attention="sdpa")
    parts = build_rank(cfg, d, build_ds_config(cfg, d), torch.device("cpu"))
    assert parts.regenerated_dropouts == 2 * 7
    engine, model = parts.engine, parts.engine.module.model
    engine.train()
    a_of_q = model.get_base_model().model.layers[1].self_attn.q_proj.lora_A["default"]
    assert a_of_q.weight.numel() == 0  # partitioned between calls

    def go(update: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(1)
        loss = engine(input_ids=IDS, labels=IDS, attention_mask=torch.ones_like(IDS))
        engine.backward(loss)
        grads = {
            n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad
        }
        if update:
            engine.step()
        engine.optimizer.zero_grad()
        return loss.detach(), grads

    go(update=True)  # B starts at zero, and with it A's gradient: one step moves it
    regenerated = go()
    use_lora_dropout(model, "peft")
    peft = go()
    torch.testing.assert_close(regenerated[0], peft[0], rtol=1e-6, atol=1e-6)
    assert len(peft[1]) == 2 * 14 and all(g.abs().sum() > 0 for g in peft[1].values())
    for name in peft[1]:
        torch.testing.assert_close(regenerated[1][name], peft[1][name], rtol=1e-5, atol=1e-7)


def _saved(model: Any, vocab: int) -> int:
    """Bytes autograd keeps for one forward of 2 × 64 tokens, parameters excluded."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_none_of_the_copies_are_kept_and_the_plan_says_so() -> None:
    """Every layer keeping its activations, bf16: regenerated, autograd keeps what it keeps at
    dropout 0; peft's keeps more, by what the plan's "LoRA dropout copies" row counts (CPU
    masks: the compute dtype). The plan has no such row when regenerated, and prices one more
    dropout pass per layer."""
    from memtune.rank.model import add_lora, load_base_model
    from memtune.tools.tiny import synthesize

    def built(*overrides: str) -> tuple[Any, Any, Any]:
        cfg = to_run_config(
            compose_cfg(
                [
                    "peft=lora-all-linear",
                    "trainer.precision=bf16",
                    "trainer.activation_checkpointing=false",
                    *overrides,
                ]
            )
        )
        synthesize(cfg.model.name_or_path, cfg.model.architecture)
        d = dataclasses.replace(decided(cfg), attention="sdpa")
        return cfg, d, add_lora(load_base_model(cfg, d), cfg, d).train()

    cfg, d, regen = built("peft.dropout=0.1")
    vocab = int(cfg.model.architecture["vocab_size"])
    assert d.kernels.lora_dropout == "regenerate"
    _, d_peft, peft = built("peft.dropout=0.1", "trainer.lora_dropout_kernel=peft")
    _, _, none = built("peft.dropout=0")
    kept, kept_peft, kept_none = _saved(regen, vocab), _saved(peft, vocab), _saved(none, vocab)
    assert kept == kept_none
    counts = count_params(cfg)
    copies = activation_bytes(cfg, d_peft, 128, counts, cuda=False) - activation_bytes(
        cfg, d, 128, counts, cuda=False
    )
    assert copies > 0.1 * kept_none  # all-linear: five inputs a layer dropped apart
    assert kept_peft - kept == pytest.approx(copies, rel=0.05), (kept_peft - kept, copies)
    rows = {r.what for r in plan(cfg, d, counts).rows}
    assert DROPOUT_ROW in {r.what for r in plan(cfg, d_peft, counts).rows}
    assert DROPOUT_ROW not in rows
    # every layer kept: forward and backward, and with the masks regenerated one more pass;
    # the first layer's input needs no gradient, so its q, k and v dropouts run no backward
    each = d.batch.rank_tokens * (2 * 2 + 1)  # a value read, its copy and mask written
    layers = cfg.model.architecture["num_hidden_layers"]
    one_pass = each * layers * sum(i for _, i, _ in counts.lora_inputs)
    qkv = ("q_proj", "k_proj", "v_proj")
    first_qkv = each * sum(i for name, i, _ in counts.lora_inputs if name in qkv)
    assert first_qkv > 0 and len(counts.lora_inputs) == 7
    assert d.checkpointing.embedding_output_grad_free
    assert dropout_pass_bytes(cfg, d_peft, counts) == 2 * one_pass - first_qkv
    assert dropout_pass_bytes(cfg, d, counts) == 3 * one_pass - first_qkv


def test_auto_is_decided_with_the_layers_by_step_time_within_the_memory() -> None:
    """The shipped 4 × 4090 experiments, as a launch decides them (memory.fit): LoRA with the
    lean kernels (auto) regenerates — 18 layers recomputed in full and 9 selectively is
    faster by the estimate than peft's 19 and 6; with transformers' RMSNorm and SwiGLU peft's
    copies are kept (selective layers absorb them, so regenerating would only add its pass),
    and it says why. QLoRA regenerates: 21 selective layers instead of peft's 25, whose
    recomputes (norms, rotary, SiLU, LoRA's adds) cost more than the masks' extra pass.
    Unpriced (no plan.device_tflops), regenerating is kept only where it recomputes fewer
    layers."""
    from memtune.config.decisions import RankMachine
    from memtune.memory.fit import fit_to_device

    gpu = RankMachine(cuda=True)

    def fitted(*overrides: str) -> Any:
        return fit_to_device(to_run_config(compose_cfg(list(overrides))), machine=gpu)

    lean = fitted("experiment=qwen2.5-7b-4x4090-lora")
    assert lean.decisions.kernels == Kernels("lean", "lean", lora_dropout="regenerate")
    assert (lean.decisions.checkpointing.recomputed, lean.decisions.checkpointing.selective) == (
        18,
        9,
    )
    transformers_ops = ["trainer.rms_norm_kernel=torch", "trainer.swiglu_kernel=torch"]
    lora = fitted("experiment=qwen2.5-7b-4x4090-lora", *transformers_ops)
    assert lora.decisions.kernels.lora_dropout == "peft"
    assert any(
        "lora_dropout_kernel=auto: peft's (22.80 s a step against 22.87 s" in n for n in lora.notes
    )
    qlora = fitted("experiment=qwen2.5-7b-4x4090-qlora").decisions
    assert qlora.kernels.lora_dropout == "regenerate"
    assert (qlora.checkpointing.recomputed, qlora.checkpointing.selective) == (0, 21)
    copies = fitted("experiment=qwen2.5-7b-4x4090-qlora", "trainer.lora_dropout_kernel=peft")
    assert (
        copies.decisions.checkpointing.recomputed,
        copies.decisions.checkpointing.selective,
    ) == (
        0,
        25,
    )
    # unpriced and nothing to recompute (a card with room): regenerating would buy nothing
    roomy = fitted(
        "experiment=qwen2.5-7b-4x4090-lora", "plan.device_tflops=null", "plan.device_gib=80"
    )
    assert roomy.decisions.checkpointing.recomputed == 0
    assert roomy.decisions.kernels.lora_dropout == "peft"
    tight = fitted("experiment=qwen2.5-7b-4x4090-lora", "plan.device_tflops=null")
    assert tight.decisions.kernels.lora_dropout == "regenerate"


@pytest.mark.parametrize("native", [False, True])
def test_backward_holds_one_copy_and_the_mask_at_a_time(native: bool) -> None:
    """The backward of one regenerated adapter over an input x of n × in (bf16) holds the
    redrawn mask and one input-sized tensor at a time: the dropped copy for lora_A's weight
    gradient, freed before the input's gradient is made (memory.estimate.backward_bytes prices
    it at the down_proj adapter's backward, beside the base's gradient). The mask: CPU's noise
    in x's dtype, or CUDA's bool (``native``, as tools.step_trace stands for a GPU rank)."""
    from memtune.tools.step_trace import Tracker

    n, width, r = 4096, 512, 8
    a = torch.nn.Linear(width, r, bias=False).to(torch.bfloat16)
    a.__class__ = RegeneratedDropoutLinear
    vars(a)["memtune_dropout_p"] = 0.1
    vars(a)["memtune_native_dropout"] = native
    x = torch.randn(n, width, dtype=torch.bfloat16, requires_grad=True)
    out = a(x)
    grad = torch.ones_like(out)
    tracker = Tracker()
    with tracker:
        (grad_x,) = torch.autograd.grad(out, x, grad)
    one = n * width * 2
    assert grad_x.shape == x.shape
    mask = one // 2 if native else one
    assert one + mask <= tracker.peak <= one + mask + one // 16, tracker.peak / one


def test_the_generator_is_left_where_peft_leaves_it() -> None:
    """After a step the random generator is where peft's dropout leaves it (backward puts it
    back after each replay), so the next step's masks are peft's too — layers kept, recomputed
    in full and selectively."""
    model = tiny_lora("tiny-qwen3", recompute=1, selective=1)
    step(model)
    regenerated = torch.get_rng_state()
    use_lora_dropout(model, "peft")
    step(model)
    assert torch.equal(regenerated, torch.get_rng_state())


@pytest.mark.parametrize("path", ["reentrant", "tiled", "offloaded"])
def test_the_same_gradients_through_memtunes_own_recomputes(path: str) -> None:
    """Reentrant checkpointing (its forward under no_grad), rank.long_context's tiled MLP (3
    tiles, each recomputed and backpropagated in turn) and its offloaded LayerCheckpoint: each
    restores the generator for its recompute, and the regenerated masks equal peft's."""
    from memtune.rank.layers import decoder_layers
    from memtune.rank.long_context import _tile, offload_checkpoints

    overrides = ["trainer.checkpointing_reentrant=true"] if path == "reentrant" else []
    model = tiny_lora("tiny-qwen3", *overrides, recompute=3 if path != "tiled" else 1, selective=0)
    base = model.get_base_model()
    if path == "tiled":
        for layer in decoder_layers(base):
            _tile(layer.mlp, 3)
    if path == "offloaded":
        assert offload_checkpoints(base, torch.device("cpu")) == 3
    assert regenerated_dropouts(model) == 3 * 7
    regenerated = step(model)
    use_lora_dropout(model, "peft")
    peft = step(model)
    torch.testing.assert_close(regenerated[0], peft[0], rtol=1e-6, atol=1e-6)
    assert regenerated[1].keys() == peft[1].keys() and len(peft[1]) == 3 * 14
    for name in peft[1]:
        torch.testing.assert_close(regenerated[1][name], peft[1][name], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_the_replay_draws_f_dropouts_mask_on_a_gpu() -> None:
    """On CUDA the backward's replay is torch's fused native_dropout: from the same generator
    state it gives F.dropout's output, bit for bit (the CPU tests check the CPU replay)."""
    from memtune.rank.lora_dropout import replayed_dropout

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1024, 768, device="cuda", dtype=dtype)
        state = torch.cuda.get_rng_state()
        expected = torch.nn.functional.dropout(x, 0.1, True)
        torch.cuda.set_rng_state(state)
        dropped, mask = replayed_dropout(x, 0.1)
        assert mask.dtype == torch.bool and torch.equal(dropped, expected)
