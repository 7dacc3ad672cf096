"""A rank that runs out of memory — a real allocation failure: the rank caps its own address
space (RLIMIT_AS, tests/oom_inject) after step 3 — stops the job with its own exit code and a
report; with plan.auto_fit the job restarts once from the last checkpoint and finishes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, TESTS

pytestmark = pytest.mark.slow

ARGS = [
    "logger=none",
    "trainer.max_steps=8",
    "trainer.save_every=2",
    "trainer.activation_checkpointing=false",
]


def _train(run_dir: Path, *extra: str, inject: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if inject:
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "oom_inject"), env["PYTHONPATH"]])
        env |= {
            # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and
            # serves the next step's tensors from memory it already holds, so the capped rank
            # could finish without one new mapping (seen once in a full suite run).
            "MALLOC_MMAP_THRESHOLD_": "131072",
            "MEMTUNE_TEST_OOM_RANK": "1",
            "MEMTUNE_TEST_OOM_STEP": "3",
            "MEMTUNE_TEST_OOM_ONCE": str(run_dir.parent / f"{run_dir.name}.capped"),
        }
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *ARGS, f"run_dir={run_dir}", *extra],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.faults
def test_an_out_of_memory_rank_stops_the_job_with_a_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(run_dir)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((run_dir / "oom-rank1.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    # The first allocation after step 3 that needs new memory fails: in step 4 or soon after
    # (a step can live on memory freed by the one before).
    step = report["step"]
    assert report["rank"] == 1 and 4 <= step <= 8
    assert report["planned_gib"] == plan["total_gib"]
    assert report["measured"]["peak_rss_gib"] > 0
    assert "can't allocate memory" in report["error"]
    assert f"rank 1 ran out of memory at step {step}: planned" in proc.stderr
    assert "lost its connection" in proc.stderr  # rank 0: one line, not a traceback
    assert "Traceback" not in proc.stderr
    assert sorted(_losses(run_dir)) == list(range(1, step))
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 4


@pytest.mark.faults
def test_auto_fit_restarts_once_from_the_checkpoint_and_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(run_dir, "plan.auto_fit=true")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    record = json.loads((run_dir / "oom_restart.json").read_text())
    assert record["changes"] == [
        "trainer.activation_checkpointing=true",
        "trainer.checkpoint_layers=all",
    ]
    (failed,) = [r["step"] for r in record["after"]]
    last_saved = (failed - 1) // 2 * 2  # save_every=2
    assert record["resumed_from"].endswith(f"step-{last_saved:07d}")
    # config.yaml keeps what was asked; decisions.json holds what the restart decided
    assert "activation_checkpointing: false" in (run_dir / "config.yaml").read_text()
    checkpointing = json.loads((run_dir / "decisions.json").read_text())["checkpointing"]
    assert checkpointing["enabled"] and set(checkpointing["layers"]) == {"full"}
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    # Recomputing the forward changes no value: the restarted run's curve is the one an
    # uninterrupted run without checkpointing draws (fp32; the data order continues).
    clean = tmp_path / "clean"
    assert _train(clean, inject=False).returncode == 0
    got, want = _losses(run_dir), _losses(clean)
    assert sorted(got) == list(range(1, 9))
    assert got == pytest.approx(want, abs=1e-5)


def test_a_later_start_keeps_the_restarts_change(tmp_path: Path, capsys) -> None:
    """A run plan.auto_fit restarted after an out-of-memory stop (oom_restart.json), started
    again in its run dir (a Slurm requeue, the same command): decided as the settings say it
    would run out of memory at the same step, its one restart spent; it keeps the change.
    A fresh start (resume=never) decides as the settings say; a damaged record is named."""
    from memtune.config import ConfigError, to_run_config
    from memtune.config.decisions import CPU_RANKS
    from memtune.launcher.oom import still_restarted
    from memtune.memory.fit import fit_to_device
    from memtune.rundir import OomRestart, RunDir
    from tests.conftest import compose_cfg

    changes = ["trainer.activation_checkpointing=true", "trainer.checkpoint_layers=all"]
    rd = RunDir(tmp_path)
    rd.write_oom_restart(OomRestart([], changes, None))

    def start(*extra: str) -> Any:
        cfg = to_run_config(compose_cfg(["trainer.activation_checkpointing=false", *extra]))
        return fit_to_device(cfg, machine=CPU_RANKS)

    asked = start()
    assert not asked.decisions.checkpointing.enabled
    again = still_restarted(asked, tmp_path)
    c = again.decisions.checkpointing
    assert c.enabled and c.recomputed == len(c.layers) > 0
    assert again.decisions == dataclasses.replace(asked.decisions, checkpointing=c)
    assert again.plan.rows != asked.plan.rows  # planned as it will run
    assert "so does this start" in capsys.readouterr().out
    fresh = start("resume=never")
    assert still_restarted(fresh, tmp_path) is fresh
    rd.oom_restart.write_text('{"after": [], "changes": "all", "resumed_from": null}')
    with pytest.raises(ConfigError, match=r"oom_restart\.json: changes is not a list"):
        still_restarted(asked, tmp_path)


def test_out_of_memory_before_the_first_step_is_reported_as_a_steps() -> None:
    """Building the model or DeepSpeed's engine, or loading a checkpoint, out of memory (a card
    another process holds): RankOutOfMemory at step 0, said as before the first step, where it
    was a traceback; any other error passes through as it was."""
    import torch

    from memtune.rank.worker import RankOutOfMemory, out_of_memory_before_the_steps
    from memtune.rundir import at_step

    cpu, said = torch.device("cpu"), "CUDA out of memory. Tried to allocate 2.00 GiB"
    with pytest.raises(RankOutOfMemory) as caught, out_of_memory_before_the_steps(3, cpu):
        raise torch.OutOfMemoryError(said)
    oom = caught.value
    assert (oom.rank, oom.step, oom.error) == (3, 0, said)
    assert oom.memory["rss_gib"] > 0
    assert at_step(oom.step) == "before its first step" and at_step(4) == "at step 4"
    with pytest.raises(ValueError, match="not memory"), out_of_memory_before_the_steps(0, cpu):
        raise ValueError("not memory")
