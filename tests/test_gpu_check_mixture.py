"""The GPU check's whole-mixture phases (bench/gpu_check/mixture.py, mixture_load.py) on the
tiny Qwen3-MoE, in this process, as the dry run runs them (.ci/run runs them as phases): the
planner's candidates and its pick recorded, the base built a layer at a time with every expert
stack quantized by memtune, memtune's rank trained on rows of real tokens (their attention mask
set, a layer recomputed: the routing statistics' path a padded batch takes), the checkpoint
written in the released layout and read back through load_base_model, and what the outputs
hold."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def gpu_check() -> Any:
    sys.path.insert(0, str(ROOT))
    import bench.gpu_check  # noqa: F401  (its src/ and bench/ on the path)
    from bench.gpu_check import mixture, mixture_load, modes, recorder, report

    return mixture, mixture_load, modes, recorder, report


def test_the_mixture_phases_plan_pick_build_train_and_load(
    gpu_check: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixture, mixture_load, modes, recorder, report = gpu_check
    from memtune.launcher.spawn import free_port, node_env

    # the world of one rank a phase starts (recorder.init_one_rank), undone after the test
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", **node_env(1, free_port())}.items():
        if key != "CUDA_VISIBLE_DEVICES":
            monkeypatch.setenv(key, value)
    monkeypatch.setenv(mixture_load.SCRATCH_ENV, str(tmp_path))
    # the dry run's mode, cut to one short row of one step (the suite's budget)
    mode = dataclasses.replace(modes.DRY, mixture_lengths=(32,), warmup=0, timed=1)
    work, out = tmp_path / "parts", tmp_path / "out"
    work.mkdir()
    deadline = time.time() + 300

    def phase(name: str, side: str) -> Any:
        return recorder.Phase(mode, name, "mixture", side, work / f"{name}.json", out)

    whole = phase("mixture-qlora", "whole")
    mixture.run_mixture(whole, deadline)
    load = phase("mixture-load", "load")
    mixture_load.run_mixture_load(load, deadline)
    assert whole.data["errors"] == [] and load.data["errors"] == []

    run = whole.data["mixture"]
    candidates = {c["label"]: c for c in run["candidates"]}
    assert list(candidates) == [c.label for c in mixture.CANDIDATES]
    for c in candidates.values():
        assert c["total_gib"] > 0 and c["rows"]["base weights"] > 0 and c["seq_len"] == 32
        assert c["experts_storage"] == "nf4" and c["checkpointed_layers"] == 1
    every, frozen = candidates["every expert"], candidates["experts frozen"]
    assert every["experts_adapted"] and not frozen["experts_adapted"]
    assert every["trainable"] > frozen["trainable"] > 0
    assert candidates["every expert, Adam on the host"]["optimizer"] == "cpu_adam"
    assert candidates["every expert, Adam on the host"]["rows"]["optimizer state"] == 0
    # the tiny model fits anything: auto_fit's rule takes the first, and says why
    assert run["pick"] == run["measured"] == "every expert"
    assert run["why"].startswith("the first that fits 23.99 GiB with 2 GiB to spare")

    build = run["build"]
    assert build["stacks_quantized"] == 2 * 2  # 2 layers × (gate_up, down), by memtune
    assert build["trainable"] == every["trainable"] == sum(build["trainable_by_part"].values())
    assert build["trainable_by_part"]["routed experts"] > 0 and build["rank_s"] > 0
    (row,) = run["rows"]
    assert row["seq_len"] == 32 and row["tokens_per_s"] > 0 and row["step_s_median"] > 0
    assert len(row["losses"]) == 1 and all(math.isfinite(x) for x in row["losses"])
    # random tokens on a random base: near chance, ln 1024 = 6.93 (the tiny model's logits spread)
    assert math.log(1024) - 1 < row["losses"][0] < math.log(1024) + 2
    assert row["plan"]["live_gib"] > 0 and row["plan"]["total_gib"] > 0
    assert row["checkpointed_layers"] == 1 and row["flops_per_step"] > 0

    info = load.data["mixture_load"]
    written = info["write"]
    cfg_bytes = info["checkpoint_gb"] * 1e9
    assert written["bytes"] == round(cfg_bytes) and written["shards"] == 2 + 1
    assert info["check"] == {"router_equal": True, "gate_up_equal": True, "stacks_quantized": 4}
    assert info["plan"]["host_gib"] > 0 and info["plan"]["device_gib"] > 0
    assert info["load"]["load_s"] > 0 and info["load"]["host_samples"] > 0
    assert not list(tmp_path.glob("gpu_check_mixture_*"))  # the checkpoint, removed

    result = report.collect(mode, work)
    saved = json.loads((out / "gpu_check.json").read_text())
    assert saved["mixture"]["runs"][0]["pick"] == "every expert"
    assert saved["mixture"]["load"]["check"]["gate_up_equal"] is True
    text = (out / "gpu_check.md").read_text()
    assert "#### A whole mixture on one card (mixture-qlora)" in text
    assert "| every expert ← |" in text and "#### The streaming loader's peak" in text
    report.format_check(mode, work)  # the GPU-only branches, with made-up readings
    assert result["mixture"]["runs"][0]["rows"][0]["tokens_per_s"] > 0


def test_the_checkpoint_is_written_as_save_pretrained_names_it(
    gpu_check: Any, tmp_path: Path
) -> None:
    """The writer's tensor names and shapes are those transformers' save_pretrained gives the
    same model (each expert apart: the released Qwen3-MoE layout)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    mixture, mixture_load, modes, _, _ = gpu_check
    from bench.gpu_check.configs import compose_cfg

    cfg = compose_cfg(
        modes.DRY,
        "mixture",
        32,
        (*mixture.MIXTURE_OVERRIDES, "plan.device_gib=null"),
        model=modes.DRY.mixture_model,
    )
    mixture_load.write_checkpoint(cfg, tmp_path / "ours", torch.device("cpu"))
    arch = dict(cfg.model.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "theirs"
    )

    def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
        out = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
        return out

    ours = shapes(tmp_path / "ours")
    assert ours == shapes(tmp_path / "theirs")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    assert ".mlp.experts.15.up_proj.weight" in " ".join(ours)


def test_the_mixture_group_runs_only_when_named_and_in_the_dry_run(gpu_check: Any) -> None:
    from bench.gpu_check import phases

    group = ["mixture-qlora", "mixture-load", "mixture-qlora-offload"]  # in priority order
    assert [p.name for p in phases.select("mixture")] == group
    assert not {p.name for p in phases.select(None)} & set(group)  # a plain device run
    assert [p.name for p in phases.select(None, ("unsloth", "mixture"))][-3:] == group
    assert all(phases.spec(n).need_s < phases.spec(n).cap_s for n in group)
