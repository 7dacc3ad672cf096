"""Mixture-of-experts Qwen (Qwen3-MoE, Qwen3.5-MoE): LoRA on the routed experts as memtune
runs it (rank.experts) is the adapter plain peft loads with target_parameters; the parameter
counts of the released shapes; what is refused by name; a tiny Qwen3-MoE trained on 2 CPU
ranks under ZeRO-3 whose exported adapter gives memtune's logits in plain peft and merges."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from memtune.config import ConfigError, to_run_config, validate
from memtune.memory.counts import count_params
from tests.conftest import FAST, Run, allocator_peak, compose_cfg, decided, start_run

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
    initializer_range=0.1,
)


def _cfg(*overrides: str):
    return to_run_config(compose_cfg(list(overrides)))


HYBRID = dict(  # Qwen3.5-MoE: a linear-attention layer, then a full-attention one
    TINY,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    shared_expert_intermediate_size=32,
)
MODELS = {"qwen3_moe": TINY, "qwen3_5_moe_text": HYBRID}
TARGETS = {  # peft's part: attention, and the shared expert where there is one
    "qwen3_moe": ["q_proj", "v_proj"],
    "qwen3_5_moe_text": ["q_proj", "v_proj", "in_proj_qkv", "gate_proj", "down_proj"],
}


def _tiny_moe(tmp: Path, model_type: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **MODELS[model_type])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "base")
    return tmp / "base"


def _adapted(base: Path, model_type: str, r: int = 4, alpha: int = 8) -> Any:
    """The base loaded back, with LoRA by peft (attention, a shared expert) and on the routed
    experts by memtune, every B random (a trained adapter, not the no-op start)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memtune.expert_stacks import train_routers
    from memtune.rank.experts import add_expert_lora

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS[model_type], lora_dropout=0.0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    added = add_expert_lora(model, r, alpha / r)
    assert added == 2 * 8 * r * ((64 + 64) + (32 + 64))  # layers × experts × r × (in + out)
    assert train_routers(model) == 2 * 8 * 64  # peft.train_router: layers × experts × hidden
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p), alpha=0.2)
    return model.eval()


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_expert_adapters_load_in_plain_peft_with_the_same_logits(
    tmp_path: Path, model_type: str
) -> None:
    """memtune's per-token x·Aᵀ·Bᵀ on each routed expert and peft's W + B·A over the stack are
    one model: the exported adapter (peft's target_parameters layout) gives memtune's logits
    in plain peft, and loads back into memtune's layout exactly (peft.init_from)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtune.rank.checkpoint import export_adapter
    from memtune.rank.model import load_adapter_weights

    base = _tiny_moe(tmp_path, model_type)
    ours = _adapted(base, model_type)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
    assert (want - plain).abs().max() > 0.1  # the experts' adapters change the model
    from memtune.rank.experts import experts_off

    # a live reference's forward: the base with its routers (here trained: the routers are
    # the base's in a run with a live reference, config.validate)
    routed = AutoModelForCausalLM.from_pretrained(base)
    trained = {n.removeprefix("base_model.model."): p for n, p in ours.named_parameters()}
    with torch.no_grad():
        for name, p in routed.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(trained[name])
        reference = routed(input_ids=ids).logits
    with torch.no_grad(), ours.disable_adapter(), experts_off(ours):
        torch.testing.assert_close(ours(input_ids=ids).logits, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and back on after it
        torch.testing.assert_close(ours(input_ids=ids).logits, want, rtol=0, atol=0)
    n = export_adapter(ours, tmp_path / "adapter", is_writer=True)
    assert n == sum(p.requires_grad for p in ours.parameters())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
    ]
    assert config["modules_to_save"] == ["mlp.gate"]  # the routers, trained in full
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    gate_up_a = tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    down_b = tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"]
    assert tuple(gate_up_a.shape) == (8 * 4, 64) and tuple(down_b.shape) == (64, 4 * 8)

    theirs = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    )
    with torch.no_grad():
        got = theirs.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    from memtune.rank.model import trainable_by_part

    parts = trainable_by_part(ours)  # the start-up line's: where the trainable weights are
    routed = 2 * 8 * 4 * (128 + 96)  # layers × experts × r × (gate_up in + out, down in + out)
    routers = 2 * 8 * 64  # peft.train_router: layers × experts × hidden
    want_parts = {
        "qwen3_moe": {
            "routed experts": routed,
            "routers": routers,
            "attention": 2 * 4 * (64 + 64 + 64 + 16),
        },
        "qwen3_5_moe_text": {  # q is twice as wide (its output gate's half), in_proj_qkv 128
            "routed experts": routed,
            "shared expert": 2 * 4 * ((64 + 32) + (32 + 64)),
            "routers": routers,
            "linear attention": 4 * (64 + 128),
            "attention": 4 * (64 + 128) + 4 * (64 + 16),
        },
    }
    assert parts == want_parts[model_type]

    again = _adapted(base, model_type)  # other B and routers: the adapter's replace them
    load_adapter_weights(again, str(tmp_path / "adapter"))
    mine = dict(ours.named_parameters())
    for name, p in again.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, mine[name]), name


@pytest.mark.parametrize(
    ("group", "total", "experts", "active"),
    [
        ("qwen3-30b-a3b", 30_532_122_624, 28_991_029_248, 3_353_032_704),
        ("qwen3.5-35b-a3b", 34_660_610_688, 32_212_254_720, 3_454_988_928),
    ],
)
def test_the_released_shapes_are_counted_from_the_real_classes(
    group: str, total: int, experts: int, active: int
) -> None:
    """Total parameters (memory), routed experts, and those one token uses (FLOPs), from the
    model built on the meta device; LoRA on all-linear reaches every expert of every layer."""
    cfg = _cfg(f"model={group}", "peft.target=all-linear", "peft.dropout=0")
    counts = count_params(cfg)
    assert (counts.base, counts.experts, counts.active) == (total, experts, active)
    a = cfg.model.architecture
    h, inter, r = a["hidden_size"], a["moe_intermediate_size"], cfg.peft.r
    per_layer = a["num_experts"] * r * ((h + 2 * inter) + (inter + h))  # gate_up, down
    assert counts.expert_lora == a["num_hidden_layers"] * per_layer
    frozen = count_params(_cfg(f"model={group}", "peft.target=all-linear-but-experts"))
    assert frozen.expert_lora == 0 and frozen.lora == counts.lora - counts.expert_lora
    routers = count_params(
        _cfg(f"model={group}", "peft.target=attention", "peft.train_router=true")
    )
    attention = count_params(_cfg(f"model={group}", "peft.target=attention"))
    assert routers.lora - attention.lora == a["num_hidden_layers"] * a["num_experts"] * h


def test_qwen3_moe_all_linear_leaves_the_mlp_names_to_the_experts() -> None:
    """No Qwen3-30B-A3B layer has a dense MLP: gate/up/down by name would match nothing, and
    peft would make its own expert adapters from them (gate_up at twice the rank)."""
    from memtune.config.derive import lora_targets

    assert "gate_proj" not in lora_targets(_cfg("model=qwen3-30b-a3b", "peft.target=all-linear"))
    shared = lora_targets(_cfg("model=qwen3.5-35b-a3b", "peft.target=all-linear"))
    assert {"gate_proj", "up_proj", "down_proj"} <= set(shared)  # its shared expert's


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["peft.target=all-linear", "peft.dropout=0.05"], r"peft.dropout=0.05 with peft.target"),
        (["peft.target=all-linear", "peft.dropout=0", "peft.dora=true"], "for linear layers only"),
        (["peft.target=all-linear", "peft.dropout=0", "peft.init=olora"], "for linear layers only"),
        (["trainer.sequence_parallel=2", "launcher.num_ranks=2"], "not built for routed experts"),
        (["trainer.tiled_mlp=on"], "not built for routed experts"),
        (
            ["peft.train_router=true", "trainer.objective=dpo", "preference.reference=live"],
            "would route with the trained routers",
        ),
        (["++model.architecture.mlp_only_layers=[0]"], r"layers \[0\] have a dense MLP"),
    ],
)
def test_what_moe_cannot_do_yet_is_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_cfg("model=qwen3-30b-a3b", *overrides), inputs=False)


def test_a_pattern_that_would_reach_the_routed_experts_is_refused() -> None:
    """peft applies rank / alpha patterns to the fused stacks by name when it loads the
    adapter, which memtune trains at peft.r: a bare down_proj would change their shape."""
    adapted = ["model=qwen3.5-35b-a3b", "peft.target=all-linear", "peft.dropout=0"]
    with pytest.raises(ConfigError, match="also names the routed experts' stacks"):
        validate(_cfg(*adapted, "peft.rank_pattern={down_proj: 4}"), inputs=False)
    validate(_cfg(*adapted, "peft.rank_pattern={mlp.shared_expert.down_proj: 4}"), inputs=False)


def test_frozen_experts_take_the_usual_dropout() -> None:
    validate(_cfg("model=qwen3-30b-a3b", "peft.target=all-linear-but-experts"), inputs=False)
    validate(_cfg("model=qwen3-30b-a3b", "peft.target=attention"), inputs=False)


def test_the_moe_block_plan_is_what_autograd_keeps(tmp_path: Path) -> None:
    """memory.estimate.moe_block_bytes against the bytes autograd saves in a real mixture block
    (router, experts run by rank.experts, adapters on them), at widths where the per-expert
    bookkeeping is as small a share as at full size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtune.memory.estimate import moe_block_bytes
    from memtune.rank.experts import add_expert_lora, use_routed_forward

    arch = dict(
        model_type="qwen3_moe",
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=192,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        num_experts=32,
        num_experts_per_tok=4,
        vocab_size=128,
    )
    for adapted in (True, False):
        cfg = _cfg(
            "model=tiny-qwen3-moe",
            f"peft.target={'all-linear' if adapted else 'attention'}",
            "peft.dropout=0",
            "trainer.precision=fp32",
        )
        cfg.model.architecture = arch
        fields = {k: v for k, v in arch.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **fields))
        block = model.model.layers[0].mlp.requires_grad_(False)
        if adapted:
            add_expert_lora(block, cfg.peft.r, 2.0)
        use_routed_forward(block)
        n = 2048
        x = torch.randn(1, n, 512, requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        own = {p.untyped_storage()._cdata for p in block.parameters()}
        got = sum(size for ptr, size in saved.items() if ptr not in own)
        want = moe_block_bytes(cfg, decided(cfg), n)
        assert want == pytest.approx(got, rel=0.03), (adapted, want, got)


@pytest.mark.parametrize(
    "dtype,quant",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float32, "nf4"),
        (torch.float32, "int8"),
    ],
)
def test_the_grouped_experts_forward_is_the_loop(
    dtype: torch.dtype, quant: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rank.experts' grouped forward (torch's grouped_mm over every expert's rows at once, a
    quantized stack dequantized a few experts at a time) computes what its loop over the
    experts does: the output and the gradients of the input and of every adapter, with an
    expert that gets no row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import memtune.expert_stacks as stacks
    from memtune.rank import experts as ex

    monkeypatch.setattr(stacks, "QUANTIZED_CHUNK_BYTES", 3 * 64 * 64 * 4)  # 3 experts a chunk
    fields = {k: v for k, v in TINY.items() if k != "num_hidden_layers"}
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=1, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    block = model.model.layers[0].mlp.requires_grad_(False)
    if quant:
        assert ex.quantize_experts(block, quant, dtype) == 2
    ex.add_expert_lora(block, 8, 2.0, dtype=dtype)
    assert ex.grouped_available(dtype, 8) and not ex.grouped_available(torch.bfloat16, 4)
    assert not ex.grouped_available(torch.float32, 8, cpu=False)  # CUDA's kernel: bf16 only
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "_lora_B" in name:
                p.normal_(std=0.2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 64, dtype=dtype, generator=g)
    # each token's 2 experts among the first 7 (expert 7 gets no row), and their weights
    index = torch.stack([torch.randperm(7, generator=g)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=g).softmax(-1).to(dtype)
    results = []
    for grouped in (False, True):
        stacks.experts_state(block.experts).grouped = grouped
        xi = x.clone().requires_grad_(True)
        out = block.experts(xi, index, weights)
        out.float().square().sum().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
        block.zero_grad(set_to_none=True)
        results.append((out.detach().float(), xi.grad.float(), grads))
    (out0, dx0, g0), (out1, dx1, g1) = results
    assert g0.keys() == g1.keys() and len(g0) == 4
    assert float(g0["experts.down_proj_lora_B"][7].abs().max()) == 0.0  # no row, no gradient
    assert float(g1["experts.down_proj_lora_B"][7].abs().max()) == 0.0
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out1, out0, **tol)
    torch.testing.assert_close(dx1, dx0, **tol)
    for name in g0:
        torch.testing.assert_close(g1[name].float(), g0[name].float(), **tol)


@pytest.fixture(scope="module")
def moe_run(runs_root: Path) -> Run:
    run = start_run(
        runs_root / "moe",
        [
            *FAST,
            "trainer.max_steps=8",
            "model=tiny-qwen3-moe",
            "zero=zero3",
            "launcher.num_ranks=2",
            "peft=qlora-nf4",
            "peft.target=all-linear",
            "peft.dropout=0",
            "peft.train_router=true",  # the routers trained, exported as modules_to_save
            "trainer.router_aux_loss_coef=0.01",  # and their balance loss in the objective
        ],
    )
    assert run.code == 0
    return run


@pytest.mark.slow
def test_a_tiny_qwen3_moe_trains_its_4bit_experts_on_two_zero3_ranks(
    moe_run: Run, tmp_path: Path
) -> None:
    """QLoRA on a mixture: the attention in bitsandbytes' 4-bit layers, the routed experts in
    memtune's 4-bit stacks, LoRA on both, ZeRO-3 over 2 ranks. The adapter, in plain peft over
    the base quantized and dequantized as in training, gives memtune's logits; so does
    memtune merge's model; the routing is logged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtune.rank.experts import round_trip_experts
    from memtune.rank.model import quantization_config
    from memtune.tools.merge import merge

    run = moe_run
    losses = run.losses()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    counts = count_params(run.cfg)
    assert run.summary()["trainable_params"] == counts.lora
    assert counts.expert_lora == 2 * 16 * 16 * ((256 + 192) + (96 + 256))
    config = json.loads((run.dir / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["mlp.gate"]
    logged = [m for m in run.metrics() if "train/loss" in m]
    assert all(len(m["moe/expert_load"]) == 2 for m in logged)  # both ranks' routing, summed
    assert all(1.0 <= m["moe/load_max_over_mean"] <= 8.0 for m in logged)
    assert all(m["moe/aux_loss"] >= 2.0 - 1e-6 for m in logged)  # top-2: 2 when even
    for probe_row in run.probes():  # every frozen weight as a fresh 4-bit load makes it
        assert probe_row["base_changed"] == [] and probe_row["base_tensors_checked"] > 0
    tensors = load_file(run.dir / "adapter" / "adapter_model.safetensors")
    assert len([k for k in tensors if ".mlp.experts." in k]) == 2 * 4
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # all trained

    probe = torch.load(run.dir / "probe_logits.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(
        run.cfg.model.name_or_path,
        dtype=torch.float32,
        quantization_config=quantization_config(run.cfg, run.decisions.peft_method),
    ).dequantize()
    assert round_trip_experts(base, "nf4", torch.float32) == 4
    model = PeftModel.from_pretrained(base, run.dir / "adapter")
    with torch.no_grad():
        got = model.eval()(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(got, probe["logits"], rtol=1e-4, atol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(run.cfg.model.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        unquantized = plain.eval()(input_ids=probe["input_ids"]).logits
    assert (unquantized - probe["logits"]).abs().max() > 1e-2  # the 4-bit base is another
    merged = AutoModelForCausalLM.from_pretrained(
        merge(run.dir / "adapter", tmp_path / "merged", dtype="fp32")
    )
    with torch.no_grad():
        logits = merged.eval()(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)


def test_the_routing_metrics_are_the_models_own_balance_loss(tmp_path: Path) -> None:
    """RouterStats, from hooks on the routers, gives the load-balancing loss transformers
    computes from the router logits (output_router_logits), and each layer's expert shares."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from memtune.rank.experts import RouterStats

    model = AutoModelForCausalLM.from_pretrained(_tiny_moe(tmp_path, "qwen3_moe")).train()
    stats = RouterStats(model)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, output_router_logits=True)
    metrics = stats.metrics()
    # the model adds router_aux_loss_coef × its balance loss to the loss it returns
    assert metrics["moe/aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    shares = torch.tensor(metrics["moe/expert_load"])
    assert shares.shape == (2, 8)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2), rtol=0, atol=1e-4)
    chosen = out.router_logits[1].topk(2, dim=-1).indices.flatten()
    want = torch.bincount(chosen, minlength=8) / chosen.numel()
    torch.testing.assert_close(shares[1], want.float(), rtol=0, atol=1e-4)
    busiest = metrics["moe/layers"]["layer1"]["load_max_over_mean"]
    assert busiest == pytest.approx(float(want.max()) * 8, rel=1e-4)
    assert stats.metrics() == {}  # a new window: nothing routed since
    stats.close()

    # trainer.router_aux_loss_coef: the same loss, differentiable, from the captured logits
    capturing = RouterStats(model, capture=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, output_router_logits=True)
    # what the plan counts for it (memory.router.balance_loss_bytes): the captured logits,
    # every routed layer's tokens × experts, in the compute dtype, and two fp32 copies
    import dataclasses

    from memtune.config import compute_bytes
    from memtune.config.architecture import canonical_fields
    from memtune.memory.router import balance_loss_bytes

    held = sum(x.numel() for x, _ in capturing.captured)
    cfg = to_run_config(compose_cfg(["model=tiny-qwen3-moe", "trainer.router_aux_loss_coef=0.01"]))
    arch = canonical_fields(model.config.to_dict())  # num_local_experts: num_experts
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, architecture=arch))
    assert held == 2 * 20 * 3 * 8  # 2 routed layers × 60 tokens × 8 experts
    assert balance_loss_bytes(cfg, ids.numel()) == held * (compute_bytes(cfg) + 8)
    ours = capturing.take_aux_loss()
    assert float(ours.detach()) == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    (want,) = torch.autograd.grad(out.aux_loss, embeds, retain_graph=True)
    (got,) = torch.autograd.grad(ours, embeds)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert capturing.captured == []  # taken

    # a padded batch: its padding left out, as the model leaves it out given the mask
    mask = torch.ones_like(ids)
    mask[0, 12:] = mask[2, 5:] = 0
    capturing.mask = mask.flatten().bool()
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    unmasked = float(load_balancing_loss_func(out.router_logits, 8, 2))
    ours = float(capturing.take_aux_loss().detach())
    assert ours == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert abs(ours - unmasked) > 1e-3  # the padding would have changed it
    stats = RouterStats(model)
    stats.mask = capturing.mask
    model(input_ids=ids, attention_mask=mask)
    assert stats.metrics()["moe/aux_loss"] == pytest.approx(ours, rel=1e-5)


def test_a_padded_batch_through_a_recomputed_layer_gives_the_gradients_of_no_recompute(
    tmp_path: Path,
) -> None:
    """RouterStats' hook, padding masked out, inside a layer checkpointed as memtune's ranks
    checkpoint (non-reentrant): the recompute skips the hook, so the forward must not save
    anything for the mask there; it did (the logits indexed with grad), and the backward
    failed with torch's "a different number of tensors was saved". With and without the
    balance loss: the gradients of the layer's weights are those without recompute."""
    from transformers import AutoModelForCausalLM

    from memtune.rank.experts import RouterStats

    model = AutoModelForCausalLM.from_pretrained(_tiny_moe(tmp_path, "qwen3_moe")).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    grads = {}
    for capture in (False, True):
        for recompute in (False, True):
            if recompute:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            stats = RouterStats(model, capture=capture)
            stats.mask = mask.flatten().bool()
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            if capture:
                loss = loss + 0.1 * stats.take_aux_loss()
            loss.backward()
            grads[capture, recompute] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
            model.zero_grad(set_to_none=True)
            stats.close()
            model.gradient_checkpointing_disable()
    for capture in (False, True):
        plain, recomputed = grads[capture, False], grads[capture, True]
        assert sorted(plain) == sorted(recomputed) and any("gate" in n for n in plain)
        for name, grad in plain.items():
            torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7)
    router = next(n for n in grads[True, False] if n.endswith("mlp.gate.weight"))
    assert not torch.equal(grads[True, False][router], grads[False, False][router])


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("nf4", torch.float32),
        ("nf4", torch.bfloat16),
        ("int8", torch.float32),
        ("int8", torch.bfloat16),
    ],
)
def test_quantized_expert_stacks_compute_their_dequantized_weights(
    tmp_path: Path, kind: str, dtype: torch.dtype
) -> None:
    """quantize_experts keeps each stack as 4-bit blocks (or int8 rows) and fp32 scales in one
    parameter of the training dtype; the experts then compute as a float model holding the
    dequantized weights does, forward and backward (the adapters' and the input's gradients),
    and nothing large is left unquantized."""
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM

    from memtune.rank.experts import add_expert_lora, full_precision_weights, quantize_experts

    base = _tiny_moe(tmp_path, "qwen3_moe")
    quantized = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).requires_grad_(False)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).requires_grad_(False)
    stacks = {n: p for n, p in reference.named_parameters() if ".mlp.experts." in n}
    smallest = 2 * 64 * 64  # above the float attention weights here (bitsandbytes' in a run)
    assert sorted(full_precision_weights(quantized, smallest)) == sorted(stacks)
    assert quantize_experts(quantized, kind, dtype) == 4
    assert full_precision_weights(quantized, smallest) == []
    for name, param in stacks.items():  # the reference: the round trip, as float weights
        e, out, inp = param.shape
        rows = param.data.reshape(-1, inp)
        if kind == "int8":  # bitsandbytes' own: a byte a weight, an fp32 absmax a row,
            # from float16 (what its CUDA kernel takes; memtune quantizes so on every device)
            values, scales, _ = bnbf.int8_vectorwise_quant(rows.half())
            back, nbytes = bnbf.int8_vectorwise_dequant(values, scales), e * out * (inp + 4)
        else:  # 4 bits a weight, an fp32 scale a block of 64 (over the flattened stack)
            packed, state = bnbf.quantize_4bit(rows.flatten(), blocksize=64, quant_type="nf4")
            back, nbytes = (
                bnbf.dequantize_4bit(packed, state),
                e * out * inp // 2 + e * out * inp // 64 * 4,
            )
        param.data = back.reshape(e, out, inp).to(dtype)
        held = dict(quantized.named_parameters())[name]
        assert held.dtype == dtype and held.numel() * held.element_size() == nbytes
    for model in (quantized, reference):
        torch.manual_seed(5)
        add_expert_lora(model, 4, 2.0, dtype=dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_lora_B" in name:
                    p.normal_(std=0.2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    outputs, grads = [], []
    for model in (quantized, reference):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        logits.float().square().mean().backward()
        outputs.append(logits.float())
        grads.append(
            [embeds.grad.float()]
            + [p.grad.float() for n, p in sorted(model.named_parameters()) if "_lora_" in n]
        )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[0], outputs[1], rtol=tol, atol=tol)
    assert len(grads[0]) == 1 + 2 * 4
    for got, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, want, rtol=tol * 10, atol=tol)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits, as integers of its width (torch.equal on floats calls -0 and 0
    equal)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_dequantization_is_bitsandbytes_bit_for_bit(dtype: torch.dtype) -> None:
    """expert_stacks.int8_dequantized against bitsandbytes' int8_vectorwise_dequant and a cast:
    the same bits, over every int8 value and row scales from subnormal to 1e30; and so through
    the rank's paths, the grouped forward's chunk (rank.experts._dequantized_range, any range of
    experts) and memtune merge's round trip (rank.experts.round_trip_experts)."""
    import bitsandbytes.functional as bnbf

    from memtune.expert_stacks import int8_dequantized
    from memtune.rank.experts import (
        _dequantized_range,
        _quantized,
        quantized_parameter,
        round_trip_experts,
    )

    g = torch.Generator().manual_seed(0)
    values = torch.randint(-128, 128, (600, 257), dtype=torch.int8, generator=g)
    exponents = torch.empty(600).uniform_(-45, 30, generator=g)
    scales = (torch.rand(600, generator=g) + 0.5) * torch.pow(10.0, exponents)
    scales[:4] = torch.tensor([0.0, 1e-45, 1.0, 3.4e38])  # zero, the smallest, one, near max
    want = bnbf.int8_vectorwise_dequant(values, scales).to(dtype)
    assert torch.equal(_bits(int8_dequantized(values, scales, dtype)), _bits(want))

    stack = (torch.randn(8, 48, 64, generator=g) * 0.05).to(dtype)
    param = quantized_parameter(stack, "int8", dtype)
    q, s, _ = _quantized(stack, "int8")
    reference = bnbf.int8_vectorwise_dequant(q, s).view(8, 48, 64)
    for first, end in ((0, 8), (2, 5), (7, 8)):
        got = _dequantized_range(param, first, end, dtype)
        assert torch.equal(_bits(got), _bits(reference[first:end].to(dtype))), (first, end)

    model = torch.nn.Module()  # an experts module: its two stacks, as the merge finds them
    model.num_experts = 8
    model.gate_up_proj = torch.nn.Parameter(torch.randn(8, 48, 64, generator=g) * 0.05)
    model.down_proj = torch.nn.Parameter(torch.randn(8, 64, 24, generator=g) * 0.05)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert round_trip_experts(model, "int8", dtype) == 2
    for name, weight in before.items():
        q, s, _ = _quantized(weight.to(dtype), "int8")
        back = bnbf.int8_vectorwise_dequant(q, s).reshape(weight.shape).to(torch.float32)
        assert torch.equal(_bits(getattr(model, name).data), _bits(back)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantizing_an_int8_chunk_holds_what_the_plan_counts_a_weight(
    dtype: torch.dtype,
) -> None:
    """One chunk of an int8 stack dequantized as the grouped forward and its backward do
    (rank.experts._dequantized_range): the allocator's peak is the planned bytes a weight
    (expert_stacks.dequantized_bytes_per_weight: 6 in bf16, an fp32 copy and the result; 4 in
    fp32) times the chunk's weights, and the result alone is left. bitsandbytes' own op held
    8 in bf16 (two fp32 products alive at once), over the 2 the plan counted."""
    from memtune.expert_stacks import dequantized_bytes_per_weight
    from memtune.rank.experts import _dequantized_range, quantized_parameter

    experts, out, inp = 16, 128, 256
    g = torch.Generator().manual_seed(0)
    stack = (torch.randn(experts, out, inp, generator=g) * 0.05).to(dtype)
    param = quantized_parameter(stack, "int8", dtype)
    _dequantized_range(param, 0, 1, dtype)  # first-call set-up outside the measure
    peak, left, weight = allocator_peak(lambda: _dequantized_range(param, 0, experts, dtype))
    weights = experts * out * inp
    planned = dequantized_bytes_per_weight("int8", dtype.itemsize)
    assert planned == {torch.bfloat16: 6, torch.float32: 4}[dtype]
    assert planned * weights <= peak <= planned * weights + 1024, (peak / weights, planned)
    assert left == weight.numel() * weight.element_size() == weights * dtype.itemsize


def test_the_plan_counts_a_dequantized_chunk_at_what_dequantizing_holds() -> None:
    """Qwen3-30B-A3B, 4,096 tokens, bf16: a mixture layer's backward holds the hidden gradients
    and, over quantized stacks, one gate_up chunk being dequantized — 21 experts (128 MiB of
    bf16 weights), at 2 bytes a weight for NF4 (bitsandbytes writes bf16 straight) and 6 for
    int8 (an fp32 copy and the result; 2 before: 0.25 GiB a rank unplanned)."""
    from memtune.memory.estimate import backward_bytes

    tokens, got = 4096, {}
    for peft in ("lora", "qlora-nf4", "lora-int8"):
        cfg = _cfg("experiment=qwen3-30b-a3b-4x4090-lora", f"peft={peft}")
        got[peft] = backward_bytes(cfg, decided(cfg), tokens, count_params(cfg))
    hidden = 2 * tokens * 2048 * 2  # the incoming and residual hidden gradients, bf16
    chunk = 21 * (2 * 768) * 2048  # weights: 21 gate_up experts fill 128 MiB in bf16
    assert got == {"lora": hidden, "qlora-nf4": hidden + 2 * chunk, "lora-int8": hidden + 6 * chunk}


def test_a_rewriting_start_exports_trained_routers_as_they_are() -> None:
    """peft.init=pissa with peft.train_router: the export for the original base doubles the
    adapters' rank and leaves the routers (trained in full, never rewritten) as trained."""
    from memtune.rank.checkpoint import for_original_base

    a, a0, router = torch.randn(4, 8), torch.randn(4, 8), torch.randn(16, 8)
    state = {"m.q_proj.lora_A.default.weight": a, "m.mlp.gate.weight": router}
    out = for_original_base(state, {"m.q_proj.lora_A.default.weight": a0})
    assert torch.equal(out["m.q_proj.lora_A.default.weight"], torch.cat([a, a0]))
    assert out["m.mlp.gate.weight"] is router


@pytest.mark.parametrize("peft", ["qlora-nf4", "lora-int8"])
def test_the_planned_base_weights_are_what_a_quantized_mixture_holds(peft: str) -> None:
    """The plan's base-weights row against the bytes of the base's parameters after memtune's
    loading code quantized it (bitsandbytes' linear layers, memtune's expert stacks): one
    rank, in the training dtype. Within 5%: bitsandbytes keeps the linear layers' scales
    outside the parameters (the plan counts them)."""
    from memtune.expert_stacks import quantized_stack
    from memtune.memory.estimate import GIB, plan
    from memtune.rank.model import check_all_quantized, load_base_model
    from memtune.tools.tiny import synthesize

    cfg = _cfg(
        "model=tiny-qwen3-moe",
        f"peft={peft}",
        "peft.target=all-linear",
        "peft.dropout=0",
        "zero=zero2",
        "launcher.num_ranks=1",
        "trainer.precision=bf16",
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, attention="sdpa")
    model = load_base_model(cfg, d)
    check_all_quantized(model, cfg, d)
    stacks = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
    assert stacks and all(
        quantized_stack(p).kind == ("int8" if peft == "lora-int8" else "nf4") for p in stacks
    )
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = plan(cfg, d).gib()["base weights"] * GIB
    assert held == pytest.approx(planned, rel=0.05)
