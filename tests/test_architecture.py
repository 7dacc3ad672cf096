"""The plan is of the model that will be loaded: the checkpoint's config.json when it is on
disk (a local directory or the Hugging Face cache), a disagreement with the config group refused
before launch, and each rank checking the model it loaded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config

from memtune.config import ConfigError, cache_dir, to_run_config
from memtune.config.architecture import loaded_mismatches, resolve_architecture
from memtune.config.given import given_config
from memtune.memory.counts import _count_on_meta, count_params
from memtune.memory.estimate import plan
from memtune.memory.plan_text import format_plan
from memtune.rank.model import add_lora, load_base_model
from memtune.tools.tiny import synthesize
from tests.conftest import ROOT, compose_cfg, decided

QWEN7B = "experiment=qwen2.5-7b-4x4090-lora"

# Qwen2.5-14B's shapes: what a user's local checkpoint might hold while the experiment's
# model group describes the 7B.
QWEN14B = dict(
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def checkpoint_14b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local checkpoint folder's config.json (the planner reads nothing else)."""
    path = tmp_path_factory.mktemp("qwen14b")
    Qwen2Config(**QWEN14B).save_pretrained(path)
    return path


def test_a_local_checkpoint_that_contradicts_the_group_is_refused(checkpoint_14b: Path) -> None:
    node = compose_cfg([QWEN7B, f"model.name_or_path={checkpoint_14b}"])
    with pytest.raises(ConfigError) as err:
        given_config(node, inputs=False)
    msg = str(err.value)
    assert "num_hidden_layers 28 → 48" in msg
    assert "hidden_size 3584 → 5120" in msg
    assert "num_attention_heads 28 → 40" in msg
    assert "model.architecture_source=checkpoint" in msg
    assert "vocab_size" not in msg  # equal fields are not listed


def test_the_checkpoint_wins_when_asked(checkpoint_14b: Path) -> None:
    node = compose_cfg(
        [QWEN7B, f"model.name_or_path={checkpoint_14b}", "model.architecture_source=checkpoint"]
    )
    cfg = given_config(node, inputs=False)
    assert cfg.model.architecture["num_hidden_layers"] == 48
    counts = count_params(cfg)
    assert counts.base == 14_770_033_664  # Qwen2.5-14B's published size (14.7B)
    d = decided(cfg)
    text = format_plan(cfg, d, plan(cfg, d, counts))
    assert f"trainable {counts.lora:,} of {counts.base + counts.lora:,}" in text


def test_model_local_reads_the_architecture_from_the_checkpoint(checkpoint_14b: Path) -> None:
    node = compose_cfg([QWEN7B, "model=local", f"model.name_or_path={checkpoint_14b}"])
    cfg, notes = resolve_architecture(to_run_config(node))
    assert cfg.model.architecture["hidden_size"] == 5120
    assert notes == [f"architecture from {checkpoint_14b / 'config.json'}"]


def _fake_hub_cache(root: Path, repo: str, config: Qwen2Config) -> Path:
    """The Hugging Face cache layout (models--org--name/refs/main → snapshots/<rev>/)."""
    revision = "0" * 40
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(revision)
    snapshot = repo_dir / "snapshots" / revision
    config.save_pretrained(snapshot)
    return snapshot


def _plan_only(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "plan_only=true"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_hub_name_in_the_local_cache_is_planned_from_its_config(tmp_path: Path) -> None:
    """The experiment's own hub name, cached with other shapes (as if the group were stale):
    train.py plan_only reads the cached config.json — no download — and refuses."""
    _fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-7B-Instruct", Qwen2Config(**QWEN14B))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = _plan_only(tmp_path, env, QWEN7B)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "num_hidden_layers 28 → 48" in proc.stderr
    proc = _plan_only(
        tmp_path, env, QWEN7B, "model=local", "model.name_or_path=Qwen/Qwen2.5-7B-Instruct"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "architecture from " in proc.stdout
    assert re.search(r"trainable [\d,]+ of 14,7\d\d,\d{3},\d{3}", proc.stdout), proc.stdout


def test_a_name_not_on_disk_is_planned_from_the_group(tmp_path: Path) -> None:
    node = compose_cfg([QWEN7B])
    env_cache = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "empty")
    try:
        cfg, notes = resolve_architecture(to_run_config(node))
    finally:
        if env_cache is None:
            os.environ.pop("HF_HUB_CACHE")
        else:
            os.environ["HF_HUB_CACHE"] = env_cache
    assert cfg.model.architecture["num_hidden_layers"] == 28
    assert "not on disk" in notes[0]


def test_a_local_path_without_a_checkpoint_is_not_said_to_download(tmp_path: Path) -> None:
    """A path is never downloaded to: the note says the checkpoint must be put there (it said
    "a run downloads it where the hub is reachable" for /models/..., just before the launch
    refused that path for its missing config.json)."""
    missing = tmp_path / "Qwen2.5-7B-Instruct"
    _, notes = resolve_architecture(
        to_run_config(compose_cfg([QWEN7B, f"model.name_or_path={missing}"]))
    )
    assert notes == [
        f"planned from the config group's architecture: {missing} holds no config.json (a path "
        "on this machine: a run needs the checkpoint there)"
    ]


def test_each_rank_checks_the_model_it_loaded() -> None:
    """rank.build compares the loaded model's config with the planned architecture."""
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    base = load_base_model(cfg, decided(cfg, attention="sdpa"))
    assert loaded_mismatches(cfg, base.config) == []
    cfg.model.architecture["num_hidden_layers"] = 3
    cfg.model.architecture["intermediate_size"] = 1024
    assert loaded_mismatches(cfg, base.config) == [
        "intermediate_size: planned 1024, loaded 1408",
        "num_hidden_layers: planned 3, loaded 2",
    ]


def test_the_planned_counts_are_peft_s_counts() -> None:
    """The exact figures the plan prints are the ones peft reports for the loaded model."""
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32", "peft=lora-all-linear"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, attention="sdpa")
    model = add_lora(load_base_model(cfg, d), cfg, d)
    trainable, total = model.get_nb_trainable_parameters()
    text = format_plan(cfg, d, plan(cfg, d))
    assert f"trainable {trainable:,} of {total:,}" in text


def test_counts_are_kept_per_architecture_and_lora_shape() -> None:
    """count_params keeps its answer on disk (a train.py start skips building the meta model and
    importing peft): the kept answer equals a fresh count, and another rank or another
    architecture is counted anew, never served from the wrong file."""
    cfg = to_run_config(compose_cfg(["peft=lora-all-linear", "peft.r=12"]))
    kept = cache_dir() / "counts"
    before = set(kept.glob("*.json")) if kept.is_dir() else set()
    first = count_params(cfg)
    (made,) = set(kept.glob("*.json")) - before
    assert count_params(cfg) == first == _count_on_meta(cfg)
    other_r = to_run_config(compose_cfg(["peft=lora-all-linear", "peft.r=24"]))
    assert count_params(other_r).lora == 2 * first.lora
    wider = to_run_config(compose_cfg(["peft=lora-all-linear", "peft.r=12"]))
    wider.model.architecture["intermediate_size"] = 2 * cfg.model.architecture["intermediate_size"]
    assert count_params(wider).linear > first.linear
    assert len(set(kept.glob("*.json")) - before) == 3
    # A damaged file is counted again, not trusted.
    made.write_text("{not json")
    assert count_params(cfg) == first
