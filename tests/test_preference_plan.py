"""The plan of a preference stage: the same rows as SFT's at the same row length (the pair's two
sequences share the row; the per-token log-probs come from the same chunked head), a row for
the live reference's forward, and its compute in the step time."""

from __future__ import annotations

from memtune.config import to_run_config
from memtune.memory.counts import count_params
from memtune.memory.estimate import plan
from memtune.memory.step_time import micro_step_flops, step_time
from tests.conftest import compose_cfg

EXP = ["experiment=qwen2.5-7b-4x4090-lora", "trainer.checkpoint_layers=22"]
DPO = ["data.format=preference", "trainer.objective=dpo"]


def _rows(overrides: list[str]) -> dict[str, float]:
    cfg = to_run_config(compose_cfg([*EXP, *overrides]))
    return {r.what: r.gib for r in plan(cfg, count_params(cfg)).rows}


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
    flops = micro_step_flops(cfg, count_params(cfg))
    # One more forward of the base: ~2 FLOPs per parameter per token, plus attention.
    assert 2 * 4096 * 7.0e9 < flops.reference < 2 * 4096 * 8.0e9 * 1.3
    base = to_run_config(compose_cfg([*EXP, *DPO]))
    t_live, t_pre = step_time(cfg), step_time(base)
    assert t_live is not None and t_pre is not None
    assert t_live.step_s > 1.2 * t_pre.step_s
