"""The plan of a preference stage: the same rows as SFT's at the same row length (the pair's two
sequences share the row; the per-token log-probs come from the same chunked head), a row for
the live reference's forward, and its compute in the step time. And what is refused before
launch, by name."""

from __future__ import annotations

import json
import re

import pytest

from memtune.config import ConfigError, lora_targets, to_run_config, validate
from memtune.memory.counts import count_params
from memtune.memory.estimate import plan
from memtune.memory.step_time import micro_step_flops, step_time
from tests.conftest import compose_cfg, decided

EXP = ["experiment=qwen2.5-7b-4x4090-lora", "trainer.checkpoint_layers=22"]
DPO = ["data.format=preference", "trainer.objective=dpo"]


def _rows(overrides: list[str]) -> dict[str, float]:
    cfg = to_run_config(compose_cfg([*EXP, *overrides]))
    return {r.what: r.gib for r in plan(cfg, decided(cfg), count_params(cfg)).rows}


def test_a_precomputed_dpo_stage_is_planned_as_sft_at_the_same_row_length() -> None:
    assert _rows(DPO) == _rows([])


def test_a_live_reference_adds_its_forward_to_memory_and_to_the_step() -> None:
    precomputed = _rows(DPO)
    live = _rows([*DPO, "preference.reference=live"])
    extra = set(live) - set(precomputed)
    assert extra == {"live reference forward"}
    # 4,096 tokens × (3 × 18,944 + 2 × 3,584) × 2 bytes (bf16)
    assert live["live reference forward"] == 4096 * (3 * 18944 + 2 * 3584) * 2 / 2**30
    cfg = to_run_config(compose_cfg([*EXP, *DPO, "preference.reference=live"]))
    flops = micro_step_flops(cfg, decided(cfg), count_params(cfg))
    # One more forward of the base: ~2 FLOPs per parameter per token, plus attention.
    assert 2 * 4096 * 7.0e9 < flops.reference < 2 * 4096 * 8.0e9 * 1.3
    base = to_run_config(compose_cfg([*EXP, *DPO]))
    t_live, t_pre = step_time(cfg, decided(cfg)), step_time(base, decided(base))
    assert t_live is not None and t_pre is not None
    assert t_live.step_s > 1.2 * t_pre.step_s


def test_a_stage_split_over_ranks_is_planned_as_split_sft() -> None:
    """trainer.sequence_parallel=2: each rank holds half of every row, the pair's sums are
    added over the two ranks (a few floats), so the rows are SFT's at sp=2, and the live
    reference's forward is that of half the row."""
    sp = ["trainer.sequence_parallel=2"]
    assert _rows([*DPO, *sp]) == _rows(sp) != _rows([])
    live = _rows([*DPO, *sp, "preference.reference=live"])
    assert live["live reference forward"] == 2048 * (3 * 18944 + 2 * 3584) * 2 / 2**30


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["preference.beta=0"], "preference.beta must be > 0"),
        (["preference.label_smoothing=0.5"], "in [0, 0.5)"),
        (
            ["trainer.objective=ipo", "preference.label_smoothing=0.1"],
            "it applies to dpo and simpo",
        ),
        (["trainer.objective=dpo", "preference.simpo_gamma=1.0"], "applies to simpo; leave"),
        (["trainer.objective=orpo", "preference.reference=live"], "it applies to dpo and ipo"),
        (
            ["trainer.objective=sft", "data=demo", "preference.beta=0.5"],
            "no effect with trainer.objective=sft",
        ),
        (["trainer.objective=simpo", "preference.simpo_gamma=-1"], "simpo_gamma must be >= 0"),
        (["peft.dropout=0.05"], "set peft.dropout=0"),
        (["data=demo"], "format"),
        (["trainer.objective=sft"], "which trainer.objective=sft does not train on"),
    ],
)
def test_bad_preference_settings_are_refused_by_name(overrides: list[str], message: str) -> None:
    cfg = to_run_config(compose_cfg(["experiment=demo-dpo-cpu", *overrides]))
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


def test_an_adapter_to_start_from_must_fit_the_run(tmp_path) -> None:
    folder = tmp_path / "adapter"
    cfg = to_run_config(compose_cfg(["experiment=demo-dpo-cpu", f"peft.init_from={folder}"]))
    with pytest.raises(ConfigError, match="no adapter there"):
        validate(cfg)
    folder.mkdir()
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(folder / "adapter_model.safetensors"))  # whole
    saved = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 32,
        "target_modules": sorted(lora_targets(cfg)),
    }
    (folder / "adapter_config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"the adapter has r=8, this run peft.r gives 16"):
        validate(cfg)
    with pytest.raises(ConfigError, match=r"the adapter has r=8"):  # a plan too (plan_only)
        validate(cfg, inputs=False)
    saved["r"] = 16
    (folder / "adapter_config.json").write_text(json.dumps(saved))
    validate(cfg)
    live = to_run_config(
        compose_cfg(
            ["experiment=demo-dpo-cpu", f"peft.init_from={folder}", "preference.reference=live"]
        )
    )
    with pytest.raises(ConfigError, match=r"use preference\.reference=precomputed"):
        validate(live)


def test_the_start_up_line_names_the_objective_and_its_settings() -> None:
    """A run said neither its objective nor the β it took (null: the objective's default)."""
    from memtune.config.derive import objective_label

    def label(*overrides: str) -> str:
        return objective_label(to_run_config(compose_cfg([*EXP, *DPO, *overrides])))

    assert objective_label(to_run_config(compose_cfg(EXP))) == ""
    assert label() == " · dpo β 0.1 (its default), reference precomputed"
    simpo = label(
        "trainer.objective=simpo", "preference.beta=2.5", "preference.label_smoothing=0.1"
    )
    assert simpo == " · simpo β 2.5, γ 0.5, label smoothing 0.1"
    assert label("trainer.objective=orpo") == " · orpo β 0.1 (its default)"
