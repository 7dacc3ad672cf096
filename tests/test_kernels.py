"""The fused layer kernels (rank.kernels; trainer.rms_norm_kernel, swiglu_kernel, rope_kernel):
decided, refused where they cannot run, and wired so that they compose with peft's LoRA
layers, memtune's checkpointing (full and selective), ZeRO-3 and QLoRA.

liger-kernel is not in the .venv (its kernels are Triton, which has no CPU backend, and with
it installed trainer.loss=auto would pick Liger's loss), so the CPU tests wire
:data:`memtune.rank.kernels.REFERENCE` — the same math in torch — through the same function a
rank wires Liger's with (``use_kernels``), and check that the patched model gives the
unpatched one's logits and LoRA gradients and that every norm, MLP and attention was reached.
Liger's rotary kernel itself runs on CPU in Triton's interpreter (the ``kernels`` mark: `make
test-kernels` installs liger-kernel and triton apart, in .kernels-site/). The GPU test runs
Liger's real kernels against torch on a GPU, and is skipped without one (the GPU check's
``kernels`` phase measures their speed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections import Counter
from typing import Any

import pytest
import torch

from memtune.config import ConfigError, to_run_config, validate
from memtune.config.decisions import LEAN_KERNELS, DecisionError, Decisions, Kernels
from memtune.rank.kernels import (
    REFERENCE,
    WIRED,
    KernelFunctions,
    remove_kernels,
    use_fused_kernels,
    use_kernels,
)
from tests.conftest import compose_cfg, decided

LIGER = [
    "trainer.rms_norm_kernel=liger",
    "trainer.swiglu_kernel=liger",
    "trainer.rope_kernel=liger",
]


def test_auto_is_torch_and_a_kernel_asked_for_is_decided_as_asked() -> None:
    """auto: Liger's never (until measured); RMSNorm and SwiGLU the lean ones where they are
    wired (tests/test_lean_norm.py, tests/test_lean_swiglu.py)."""
    torch_layers = ["trainer.rms_norm_kernel=torch", "trainer.swiglu_kernel=torch"]
    d = decided(to_run_config(compose_cfg(torch_layers)))
    assert d.kernels == Kernels() and d.kernels.label() == "torch"
    asked = decided(to_run_config(compose_cfg(LIGER[:2])))
    assert asked.kernels == Kernels("liger", "liger", "torch")
    assert asked.kernels.label() == "Liger RMSNorm + SwiGLU"
    # decisions.json holds them; one written before the field reads as all torch
    raw = asked.as_dict()
    assert raw["kernels"] == {
        "rms_norm": "liger",
        "swiglu": "liger",
        "rope": "torch",
        "lora_dropout": asked.kernels.lora_dropout,
    }
    assert Decisions.from_dict(raw) == asked
    assert (
        Decisions.from_dict({k: v for k, v in raw.items() if k != "kernels"}).kernels == Kernels()
    )
    bad = {**raw, "kernels": {**raw["kernels"], "rope": "auto"}}
    with pytest.raises(DecisionError, match=r"kernels\.rope is 'auto', not one of torch \| liger"):
        Decisions.from_dict(bad)
    bad = {**raw, "kernels": {**raw["kernels"], "rope": "lean"}}  # lean: RMSNorm and SwiGLU
    with pytest.raises(DecisionError, match=r"kernels\.rope is 'lean', not one of torch \| li"):
        Decisions.from_dict(bad)
    with pytest.raises(DecisionError, match=r"kernels\.fast is not a decision field"):
        Decisions.from_dict({**raw, "kernels": {**raw["kernels"], "fast": "liger"}})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model=tiny-qwen3-moe", "trainer.swiglu_kernel=liger"], "a mixture of experts"),
        (["model=tiny-qwen3.5", "trainer.rope_kernel=liger"], "linear-attention layers"),
        (["trainer.rms_norm_kernel=liger", "trainer.compile=true"], "trainer.compile=true"),
    ],
)
def test_where_liger_is_not_wired_it_is_refused_by_name(overrides: list[str], named: str) -> None:
    cfg = to_run_config(compose_cfg(overrides))
    with pytest.raises(ConfigError, match=rf"trainer\.\w+_kernel=liger .*{named}"):
        validate(cfg, inputs=False)


def test_liger_on_a_machine_without_it_is_refused_before_launch_and_by_a_rank() -> None:
    """The job refuses it (validate, as it launches); a rank that finds no CUDA or no
    liger-kernel refuses what decisions.json says (ConfigError: exit 2, naming the field)."""
    from memtune.config.validate import _check_kernels_here

    cfg = to_run_config(compose_cfg(["trainer.rope_kernel=liger"]))
    validate(cfg, inputs=False)  # a plan of a GPU run on a laptop is fine
    with pytest.raises(ConfigError, match=r"trainer\.rope_kernel=liger cannot run here: this"):
        _check_kernels_here(cfg)
    # The advice says what auto picks: the lean RMSNorm / SwiGLU on the dense Qwen2 layers (it
    # said "auto (torch)" there), transformers' rotary embedding.
    with pytest.raises(ConfigError, match=r"use trainer\.rope_kernel=auto \(torch here\)$"):
        _check_kernels_here(cfg)
    for name in LEAN_KERNELS:
        lean_cfg = to_run_config(compose_cfg([f"trainer.{name}_kernel=liger"]))
        with pytest.raises(ConfigError, match=rf"use trainer\.{name}_kernel=auto \(lean here\)$"):
            _check_kernels_here(lean_cfg)
    with pytest.raises(ConfigError, match=r"kernels\.rope=liger \(decisions\.json\) needs CUDA"):
        use_fused_kernels(torch.nn.Module(), Kernels(rope="liger"), torch.device("cpu"))
    with pytest.raises(DecisionError, match=r"kernels\.swiglu is liger with experts"):
        moe = to_run_config(compose_cfg(["model=tiny-qwen3-moe"]))
        dataclasses.replace(decided(moe), kernels=Kernels(swiglu="liger"))
    from memtune.config.decisions import KERNEL_MODELS

    assert set(KERNEL_MODELS) == set(WIRED) == {"qwen2", "qwen3"}  # one list, checked


# --- the wiring, on tiny models built from the real config classes ---------------------------


def counting(functions: KernelFunctions, calls: Counter) -> KernelFunctions:
    """``functions`` that count their calls (and the sizes of the norm weights they get)."""
    rms, silu_mul_, rope_ = functions.rms_norm, functions.silu_mul, functions.rope

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls["rms_norm"] += 1
        calls[f"norm weight {weight.numel()}"] += 1
        return rms(x, weight, eps)  # type: ignore[misc]

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        calls["silu_mul"] += 1
        return silu_mul_(gate, up)  # type: ignore[misc]

    def rope(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        calls["rope"] += 1
        return rope_(q, k, cos, sin, unsqueeze_dim)  # type: ignore[misc]

    return KernelFunctions(
        rms_norm if rms else None, silu_mul if silu_mul_ else None, rope if rope_ else None
    )


def tiny_lora(model: str, *overrides: str, recompute: int = 1, selective: int = 1) -> Any:
    """A tiny model of ``model``'s architecture with 3 layers (random weights, fp32,
    transformers' config class), LoRA on every linear layer with dropout as memtune adds it,
    the first ``recompute`` layers recomputed in full, the next ``selective`` selectively, the
    rest keeping everything; the adapters' B made nonzero so every LoRA weight has a
    gradient."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtune.rank.model import add_lora

    cfg = to_run_config(
        compose_cfg(
            [
                f"model={model}",
                "trainer.precision=fp32",
                "peft.target=all-linear",
                "peft.dropout=0.1",
                "++model.architecture.num_hidden_layers=3",
                *overrides,
            ]
        )
    )
    arch = dict(cfg.model.architecture)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(arch.pop("model_type"), **arch), attn_implementation="sdpa"
    )
    d = decided(cfg, recompute=recompute, selective=selective, attention="sdpa")
    peft_model = add_lora(base, cfg, d)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model.train()


ZERO3_ONE_RANK = [
    "zero.stage=3",
    "zero.one_rank_stage2=false",
    "zero.param_persistence_threshold=0",
    "launcher.num_ranks=1",
    "trainer.global_batch_size=2",
    "trainer.micro_batch_size=2",
]
"""ZeRO-3 on one in-process rank, every weight partitioned (the one_rank fixture's world)."""

IDS = torch.tensor(
    [[5, 17, 42, 99, 3, 8, 250, 11, 64, 7, 300, 2], [9, 1, 4, 77, 120, 6, 8, 15, 3, 3, 5, 900]]
)


def step(model: Any, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and LoRA gradients of one forward and backward (the same dropout masks)."""
    model.zero_grad()
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    assert all("lora_" in n for n in a[1])
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_patched_layers_give_the_same_logits_and_lora_gradients() -> None:
    """Qwen3 (per-head q / k norms), layers recomputed in full, selectively and not at all:
    every norm, MLP and attention reached, once per module in a forward and again in the
    recompute; the same logits and LoRA gradients as transformers' own code, and the same
    again once taken out."""
    peft_model = tiny_lora("tiny-qwen3", recompute=1, selective=1)
    base = peft_model.get_base_model()
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, True, False]
    plain = step(peft_model)
    calls: Counter = Counter()
    wired = use_kernels(peft_model, counting(REFERENCE, calls))
    layers, per_layer_norms = 3, 4  # input, post-attention, q_norm, k_norm
    assert (wired.norms, wired.mlps, wired.attentions) == (layers * per_layer_norms + 1, 3, 3)
    # gate / up / down are still peft's LoRA layers, called by the fused MLP
    mlp = base.model.layers[0].mlp
    assert type(mlp).__name__ == "FusedQwen3MLP" and hasattr(mlp.gate_proj, "lora_A")
    with torch.no_grad():
        peft_model(input_ids=IDS)
    assert (calls["rms_norm"], calls["silu_mul"], calls["rope"]) == (wired.norms, layers, layers)
    assert calls["norm weight 128"] == 2 * layers  # q_norm and k_norm: head_dim
    calls.clear()
    assert_same(step(peft_model), plain)
    recomputed = 2  # the full and the selective layer run them again in backward
    assert (calls["rms_norm"], calls["silu_mul"], calls["rope"]) == (
        wired.norms + recomputed * per_layer_norms,
        layers + recomputed,
        layers + recomputed,
    )
    remove_kernels(peft_model)
    assert type(mlp).__name__ == "Qwen3MLP"
    calls.clear()
    assert_same(step(peft_model), plain)
    assert not calls  # transformers' own code again, rotary included


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A world of one CPU rank in this process (as bench/gpu_check's phases start theirs),
    taken down after the test, F.linear put back."""
    import torch.distributed as dist

    from memtune.launcher.spawn import free_port, node_env
    from memtune.rank.worker import init_distributed

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", **node_env(1, free_port())}.items():
        if key != "CUDA_VISIBLE_DEVICES":
            monkeypatch.setenv(key, value)
    linear = torch.nn.functional.linear
    init_distributed()
    yield
    dist.destroy_process_group()
    # A ZeRO-3 engine puts DeepSpeed's zero3_linear_wrap in its place, process-wide, and never
    # puts it back: every later test in this process would save its tensors instead of
    # F.linear's (test_plan counts what autograd saves).
    torch.nn.functional.linear = linear


def test_under_zero3_with_partitioned_norm_weights(one_rank: None) -> None:
    """Qwen2 under ZeRO-3 (build_rank's engine, every weight partitioned, the norms' too):
    each kernel call gets the norm's whole weight, gathered for that call, and the loss and
    LoRA gradients equal the engine's as built — with auto's lean RMSNorm and SwiGLU
    (rank.lean_norm, rank.lean_swiglu), so this is also the lean kernels under ZeRO-3 against
    transformers' math."""
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
                "++model.architecture.num_hidden_layers=3",
                *ZERO3_ONE_RANK,
            ]
        )
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, recompute=1, selective=1, attention="sdpa")
    engine = build_rank(cfg, d, build_ds_config(cfg, d), torch.device("cpu")).engine
    engine.train()
    model = engine.module.model
    norm = model.get_base_model().model.norm
    assert d.zero_stage == 3 and norm.weight.numel() == 0  # partitioned between calls
    assert d.kernels.rms_norm == "lean" and type(norm).__name__ == "FusedQwen2RMSNorm"
    mlp = model.get_base_model().model.layers[0].mlp
    assert d.kernels.swiglu == "lean" and type(mlp).__name__ == "FusedQwen2MLP"

    def go() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(1)
        loss = engine(input_ids=IDS, labels=IDS, attention_mask=torch.ones_like(IDS))
        engine.backward(loss)
        grads = {
            n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad
        }
        engine.optimizer.zero_grad()
        return loss.detach(), grads

    plain = go()
    calls: Counter = Counter()
    wired = use_kernels(model, counting(REFERENCE, calls))
    assert (wired.norms, wired.mlps, wired.attentions) == (7, 3, 3)
    fused = go()
    remove_kernels(model)
    # forward: 7 norms; the recompute of the full and the selective layer: 2 × 2 more
    assert calls["rms_norm"] == calls["norm weight 256"] == 11
    assert calls["silu_mul"] == calls["rope"] == 5
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-5)
    assert len(plain[1]) == 3 * 14 and any(g.abs().sum() > 0 for g in plain[1].values())
    for name in plain[1]:
        torch.testing.assert_close(fused[1][name], plain[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_tiled_mlp_runs_the_fused_forward() -> None:
    """trainer.tiled_mlp runs ``type(mlp).forward`` tile by tile: the fused one."""
    from memtune.rank.long_context import tile_mlps, untile_mlps

    peft_model = tiny_lora("tiny-qwen2", recompute=3, selective=0)
    # tiles of hidden_size (256) tokens: planned for 768, 3 tiles of this batch's 24 tokens
    assert tile_mlps(peft_model.get_base_model(), tokens=768) == 3
    plain = step(peft_model)  # (tiled: dropout draws its masks tile by tile)
    calls: Counter = Counter()
    use_kernels(peft_model, counting(dataclasses.replace(REFERENCE, rms_norm=None), calls))
    assert_same(step(peft_model), plain)
    layers = 3
    # forward: 3 tiles a layer; the layer's recompute: 3 more; the tiles' own backward: 3 more
    assert calls["silu_mul"] == 3 * 3 * layers and calls["rms_norm"] == 0
    untile_mlps(peft_model.get_base_model())
    remove_kernels(peft_model)


def test_in_place_rotary_needs_lora_on_q_and_k() -> None:
    """Liger's rotary writes q and k in place: on a bare q_proj's output, a matmul's output
    that selective recompute keeps, the recompute would rotate it twice. Refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(to_run_config(compose_cfg([])).model.architecture)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch))
    in_place = dataclasses.replace(REFERENCE, rope_in_place=True)
    with pytest.raises(ConfigError, match=r"kernels\.rope=liger rotates q and k in place"):
        use_kernels(base, in_place)
    remove_kernels(base)
    assert use_kernels(base, dataclasses.replace(in_place, rope=None)).norms == 5
    remove_kernels(base)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("liger_kernel")),
    reason="Liger's kernels are Triton: they need CUDA and liger-kernel",
)
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-qwen3"])
def test_liger_kernels_match_torch_on_a_gpu(model: str) -> None:
    """Liger's real kernels (liger_functions), bf16 on CUDA, against transformers' own code:
    the logits and LoRA gradients within bf16's rounding."""
    from memtune.rank.kernels import liger_functions

    peft_model = tiny_lora(model, "trainer.precision=bf16").to("cuda", torch.bfloat16)
    plain = step(peft_model, IDS.cuda())
    wired = use_kernels(peft_model, liger_functions())
    assert wired.mlps == wired.attentions == 3
    try:
        fused = step(peft_model, IDS.cuda())
    finally:
        remove_kernels(peft_model)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert rel(fused[0], plain[0]) < 1e-2  # bf16 rounding, not another computation
    assert fused[1].keys() == plain[1].keys()
    worst = max(rel(fused[1][n], plain[1][n]) for n in plain[1])
    assert worst < 5e-2, worst


@pytest.mark.kernels
def test_liger_rotary_in_tritons_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's rotary kernel itself, run on CPU by Triton's interpreter (TRITON_INTERPRET=1;
    Liger's RMSNorm and SwiGLU kernels do not run there): the same logits and LoRA gradients
    through the wiring, with layers recomputed in full and selectively; and the hazard the
    guard refuses shown: q_proj and k_proj without LoRA, every layer selective, gives wrong
    LoRA gradients (the kept matmul output rotated twice). `make test-kernels` runs it, with
    liger-kernel and triton installed apart (the .venv has neither): it fails, never skips,
    where they are missing (on a CPU machine; a GPU's runs the real kernels instead)."""
    if torch.cuda.is_available():  # Triton compiles for the GPU there: the real kernels' test
        pytest.skip("on a GPU, test_liger_kernels_match_torch_on_a_gpu runs Liger's kernels")
    assert "liger_kernel" not in sys.modules, "imported before TRITON_INTERPRET was set"
    from peft import LoraConfig, get_peft_model

    from memtune.rank.kernels import liger_functions

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when liger's kernels are defined
    liger = liger_functions()
    rope_only = KernelFunctions(rope=liger.rope, rope_in_place=True)
    for model in ("tiny-qwen2", "tiny-qwen3"):
        peft_model = tiny_lora(model, recompute=1, selective=1)
        plain = step(peft_model)
        use_kernels(peft_model, rope_only)
        fused = step(peft_model)
        remove_kernels(peft_model)
        assert_same(fused, plain)
    # LoRA on v_proj and o_proj only, every layer selective
    cfg = to_run_config(compose_cfg(["++model.architecture.num_hidden_layers=3"]))
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtune.rank.layers import set_checkpointed_layers

    arch = dict(cfg.model.architecture)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(arch.pop("model_type"), **arch), attn_implementation="sdpa"
    )
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    set_checkpointed_layers(base, decided(cfg, recompute=0, selective=3).checkpointing)
    qk_bare = get_peft_model(base, LoraConfig(r=8, target_modules=["v_proj", "o_proj"])).train()
    with torch.no_grad():
        for name, param in qk_bare.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    plain = step(qk_bare)
    with pytest.raises(ConfigError, match="rotates q and k in place"):
        use_kernels(qk_bare, rope_only)
    use_kernels(qk_bare, dataclasses.replace(rope_only, rope_in_place=False))  # the guard off
    wrong = step(qk_bare)
    remove_kernels(qk_bare)
    torch.testing.assert_close(wrong[0], plain[0])  # the forward is right ...
    assert max((wrong[1][n] - plain[1][n]).abs().max() for n in plain[1]) > 1e-2  # not so LoRA's


def test_over_a_4bit_base() -> None:
    """QLoRA: bitsandbytes' 4-bit layers under the LoRA layers the fused MLP calls, bf16."""
    from memtune.rank.model import add_lora, load_base_model
    from memtune.tools.tiny import synthesize

    cfg = to_run_config(
        compose_cfg(["peft=qlora-nf4", "trainer.precision=bf16", "peft.target=all-linear"])
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, recompute=1, selective=1, attention="sdpa")
    peft_model = add_lora(load_base_model(cfg, d), cfg, d).train()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    mlp = peft_model.get_base_model().model.layers[0].mlp
    assert type(mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    plain = step(peft_model)
    calls: Counter = Counter()
    wired = use_kernels(peft_model, counting(REFERENCE, calls))
    assert (wired.norms, wired.mlps, wired.attentions) == (5, 2, 2)
    fused = step(peft_model)
    remove_kernels(peft_model)
    assert calls["silu_mul"] == 4 and calls["rope"] == 4  # forward, and again in the recompute
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=0)
    assert fused[1].keys() == plain[1].keys() and len(plain[1]) == 28
    assert all(torch.equal(fused[1][n], plain[1][n]) for n in plain[1])


def test_the_gpu_checks_kernels_phase_compares_each_variant_with_all_torch() -> None:
    """bench/gpu_check/kernels.py: speed against the first row, and equal loss (every step's
    loss within EQUAL_LOSS nats and gradient norm within EQUAL_GRAD_NORM); the phase itself
    runs in .ci/run's dry run."""
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT))
    from bench.gpu_check.kernels import VARIANTS, compare_to_first, kernels_markdown

    assert VARIANTS[0] == ("torch", {}) and len(VARIANTS) == 10
    tol = {"loss_nats": 0.01, "grad_norm_rel": 0.05}
    out = {
        "seq_len": 2048,
        "steps": 3,
        "tolerance": tol,
        "variants": [
            {
                "variant": "torch",
                "tokens_per_s": 100.0,
                "losses": [12.0, 11.9],
                "grad_norms": [1.0, 2.0],
            },
            {
                "variant": "all three",
                "tokens_per_s": 125.0,
                "losses": [12.0, 11.905],
                "grad_norms": [1.01, 2.02],
            },
            {
                "variant": "off",
                "tokens_per_s": 150.0,
                "losses": [12.0, 11.8],
                "grad_norms": [1.0, 2.0],
            },
            {
                "variant": "grads",
                "tokens_per_s": 90.0,
                "losses": [12.0, 11.9],
                "grad_norms": [1.0, 2.5],
            },
        ],
    }
    compare_to_first(out)
    v = {r["variant"]: r for r in out["variants"]}
    assert v["all three"]["speedup"] == 1.25 and v["all three"]["equal"] is True
    assert v["off"]["equal"] is False and abs(v["off"]["max_loss_diff"] - 0.1) < 1e-9
    assert v["grads"]["equal"] is False and v["grads"]["max_grad_norm_rel_diff"] == 0.25
    text = "\n".join(kernels_markdown(out))
    assert "| all three |" in text and "| **NO** |" in text


def test_a_decided_kernel_that_reached_no_module_is_named() -> None:
    """What the GPU check's kernels phase refuses to time (its dry-run stand-in once ran
    transformers' SwiGLU as "SwiGLU lean": 0 MLPs reached)."""
    from memtune.rank.kernels import Wired

    lean = Kernels("lean", "lean", "torch", "regenerate")
    assert Wired(norms=5, mlps=2).missing(lean) == []
    assert Wired(norms=5, attentions=2).missing(lean) == ["swiglu=lean decided but no mlps reached"]
    liger_rope = Kernels("torch", "torch", "liger")
    assert Wired(norms=5, mlps=2).missing(liger_rope) == [
        "rope=liger decided but no attentions reached"
    ]
    assert Wired().missing(Kernels()) == []
