"""The LoRA variants on 2 CPU ranks under ZeRO-3: DoRA with rsLoRA scaling, LoRA+ and
per-module ranks and alphas in one run; a PiSSA start in another. Each adapter loads in plain
peft onto the base as released and gives memtune's logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtune.config import ConfigError, to_run_config, validate
from memtune.memory.counts import count_params
from tests.conftest import FAST, Run, compose_cfg, start_run

VARIANTS = [
    "peft.target=all-linear",
    "peft.dropout=0",
    "peft.dora=true",
    "peft.rslora=true",
    "peft.init=gaussian",
    "peft.loraplus_lr_ratio=16",
    "peft.rank_pattern={down_proj: 4}",
    "peft.alpha_pattern={o_proj: 8}",
]


def _plain_peft_logits(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain peft on the released base + the exported adapter, memtune's trained model) on
    the probe batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.name_or_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, run.dir / "adapter").eval()
    probe = torch.load(run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        return model(input_ids=probe["input_ids"]).logits, probe["logits"]


@pytest.fixture(scope="module")
def variants_run(runs_root: Path) -> Run:
    run = start_run(
        runs_root / "variants",
        [*FAST, "trainer.max_steps=8", "zero=zero3", "launcher.num_ranks=2", *VARIANTS],
    )
    assert run.code == 0
    return run


@pytest.mark.slow
def test_dora_rslora_loraplus_and_patterns_train_and_load_in_plain_peft(variants_run) -> None:
    run = variants_run
    losses = run.losses()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    config = json.loads((run.dir / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    assert config["init_lora_weights"] == "gaussian"
    assert config["rank_pattern"] == {"down_proj": 4} and config["alpha_pattern"] == {"o_proj": 8}
    tensors = load_file(run.dir / "adapter" / "adapter_model.safetensors")
    down = [t for k, t in tensors.items() if "down_proj.lora_A" in k]
    assert down and all(t.shape[0] == 4 for t in down)
    magnitudes = [k for k in tensors if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 2 * 7  # one per adapted module: 2 layers × 7 projections
    assert run.summary()["trainable_params"] == count_params(run.cfg).lora
    # LoRA+: B (and DoRA's magnitudes) at 16× the rate of A, through the schedule.
    for probe in run.probes():
        a, b = probe["group_lrs"]
        assert b == pytest.approx(16 * a, rel=1e-9) and a > 0
    got, want = _plain_peft_logits(run)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_dora_adapter_merges(variants_run, tmp_path: Path) -> None:
    """memtune merge folds DoRA's magnitudes and the per-module ranks into the weights."""
    from transformers import AutoModelForCausalLM

    from memtune.tools.merge import merge

    out = merge(variants_run.dir / "adapter", tmp_path / "merged", dtype="fp32")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    probe = torch.load(variants_run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = merged(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_pissa_start_trains_from_the_base_and_exports_for_the_released_base(
    zero3_run: Run, runs_root: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """peft.init=pissa_fast moves each adapted weight's top singular directions into the
    adapter: the model it starts from is the base itself (the first loss is plain LoRA's), the
    base the ranks train over is the residual, and the export is a plain LoRA adapter of twice
    the rank for the released base (peft's documented conversion)."""
    run = start_run(
        runs_root / "pissa",
        [
            *FAST,
            "trainer.max_steps=8",
            "zero=zero3",
            "launcher.num_ranks=2",
            "trainer.loss_chunk_tokens=16",
            "peft.init=pissa_fast",
        ],
    )
    assert run.code == 0
    out = capfd.readouterr().out
    assert "init pissa_fast (SVD in " in out
    assert run.losses()[0] == pytest.approx(zero3_run.losses()[0], rel=1e-5)
    assert run.losses()[-1] < run.losses()[0]
    adapted = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for probe in run.probes():  # the residual: exactly the adapted weights differ from the base
        changed = {name.split(".")[-3] for name in probe["base_changed"]}
        assert changed == adapted and len(probe["base_changed"]) == 2 * len(adapted)
    config = json.loads((run.dir / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (2 * run.cfg.peft.r, 2 * run.cfg.peft.alpha)
    assert config["init_lora_weights"] is True
    trained = run.summary()["trainable_params"]  # the closing line says what was exported
    assert (
        f"parameters) in {run.dir / 'adapter'}; exported for the original base (the start "
        f"rewrote it): r={2 * run.cfg.peft.r}, {2 * trained:,} parameters"
    ) in out
    got, want = _plain_peft_logits(run)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # And merged into the released base: the trained model, without peft.
    from transformers import AutoModelForCausalLM

    from memtune.tools.merge import merge

    merged = AutoModelForCausalLM.from_pretrained(
        merge(run.dir / "adapter", tmp_path / "m", dtype="fp32")
    )
    probe = torch.load(run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = merged.eval()(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def _cfg(*overrides: str):
    return to_run_config(compose_cfg(list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["peft.loraplus_lr_ratio=0"], "peft.loraplus_lr_ratio must be > 0"),
        (["peft.target=attention", "peft.rank_pattern={gate_proj: 4}"], "names no adapted module"),
        (["peft.rank_pattern={q_proj: 0}"], "must be a positive integer"),
        (["peft.init=pissa", "peft=qlora-nf4"], "a quantized base cannot be rewritten"),
        (["peft.init=olora", "peft.dora=true"], "DoRA's magnitudes do not convert"),
        (
            ["peft.init=pissa", "trainer.objective=dpo", "data=demo-preference", "peft.dropout=0"],
            "the reference is the base without the adapter",
        ),
        (["peft.init=gauss"], "peft.init='gauss' is not supported"),
        (["peft=qlora-nf4", "peft.dora=true", "zero=zero3"], "use zero=zero2"),
        (["peft.rank_pattern={layers.0.mlp.down_proj: 4}"], "names a layer"),
        (["peft=lora-int8", "peft.dora=true", "zero=zero2"], "leaves bitsandbytes without"),
    ],
)
def test_combinations_that_cannot_work_are_refused_by_name(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides), inputs=False)


def test_patterns_match_as_peft_matches_module_names() -> None:
    """A regex over module names, a block-qualified name: accepted as peft takes them (a YAML
    experiment can hold any key; the command line takes plain names)."""
    for key in (".*_proj", "mlp.down_proj", "(q|k)_proj"):
        cfg = _cfg()
        cfg.peft.rank_pattern = {key: 4}
        validate(cfg, inputs=False)


def test_the_counts_follow_dora_and_the_per_module_ranks() -> None:
    """From peft on the meta device: DoRA adds one magnitude per output row of each adapted
    weight; a rank_pattern entry changes that module's A and B."""
    plain = count_params(_cfg("peft.target=all-linear"))
    dora = count_params(_cfg("peft.target=all-linear", "peft.dora=true"))
    arch = _cfg().model.architecture
    h, inter, layers = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    heads, kv = arch["num_attention_heads"], arch["num_key_value_heads"]
    kv_width = h // heads * kv
    rows = h + 2 * kv_width + h + 2 * inter + h  # q, k, v, o, gate, up, down out_features
    assert dora.lora - plain.lora == layers * rows
    pattern = count_params(_cfg("peft.target=all-linear", "peft.rank_pattern={down_proj: 4}"))
    assert plain.lora - pattern.lora == layers * (16 - 4) * (inter + h)
    assert ("down_proj", inter, 4) in pattern.lora_inputs


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_the_export_of_a_rewriting_start_is_the_trained_model_on_the_original_base(
    init: str, tmp_path: Path
) -> None:
    """checkpoint.for_original_base and the doubled config, with rsLoRA and per-module ranks
    and alphas: plain peft loading the converted adapter onto the *original* weights computes
    what the residual base + the trained adapter computes (no training needed: any A, B)."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    from memtune.rank.checkpoint import _doubled_rank_config, for_original_base

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(32, 32, bias=False)
            self.down_proj = torch.nn.Linear(64, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q_proj(self.down_proj(x))

    torch.manual_seed(0)
    original = Toy()
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "down_proj"],
        use_rslora=True,
        rank_pattern={"down_proj": 4},
        alpha_pattern={"down_proj": 12},
        init_lora_weights=init,
    )
    model = get_peft_model(copy.deepcopy(original), config)
    trained = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    initial = {n: q.detach().clone() for n, q in trained}
    base_changed = not torch.equal(model.base_model.model.q_proj.base_layer.weight,
                                   original.q_proj.weight)  # fmt: skip
    assert base_changed  # the start was moved out of the base
    with torch.no_grad():  # "training": anything
        for _, q in trained:
            q.add_(0.1 * torch.randn_like(q))
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = model(x)
    state = for_original_base({n: q.detach().clone() for n, q in trained}, initial)
    model.save_pretrained(str(tmp_path), state_dict=state, safe_serialization=True)
    _doubled_rank_config(tmp_path / "adapter_config.json")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (saved["r"], saved["rank_pattern"]) == (16, {"down_proj": 8})
    loaded = PeftModel.from_pretrained(copy.deepcopy(original), str(tmp_path))
    with torch.no_grad():
        got = loaded(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_peft_s_conversion_warning_is_not_shown_where_memtune_converts_itself() -> None:
    """OLoRA / PiSSA with rsLoRA or per-module ranks: peft warned, once per rank, that its own
    post-training conversion cannot restore the base, against docs/lora.md (memtune's export
    converts such an adapter itself, tested with both)."""
    import warnings

    from memtune.config.derive import lora_config

    overrides = ["peft.init=olora", "peft.rslora=true", "peft.rank_pattern={down_proj: 8}"]
    cfg = to_run_config(compose_cfg(overrides))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = lora_config(cfg)
    assert (made.init_lora_weights, made.use_rslora, made.rank_pattern) == (
        "olora",
        True,
        {"down_proj": 8},
    )
    assert not [w for w in caught if "Rank-Stabilized" in str(w.message)]
