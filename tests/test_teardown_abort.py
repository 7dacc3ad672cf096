"""A rank that dies by SIGABRT after the run finished — after rank 0 wrote the end's summary and
every file it lists verifies — leaves a finished run: the job says so and exits 0. A rank that
aborts during the run still fails the job (exit 134). Faults injected by
tests/abort_inject/sitecustomize.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TESTS

pytestmark = [pytest.mark.slow, pytest.mark.faults]

ARGS = ["logger=none", "trainer.max_steps=4", "trainer.save_every=2"]


def _train(run_dir: Path, **inject: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "abort_inject"), env["PYTHONPATH"]])
    env |= {"MEMTUNE_TEST_ABORT_RANK": "1", **inject}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *ARGS, f"run_dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_an_abort_after_the_run_finished_is_a_finished_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memtune: rank 1 (pid" in proc.stderr and "killed by SIGABRT" in proc.stderr
    assert (
        "a rank aborted (SIGABRT) after the run had finished: summary.json holds step 4 of 4 "
        "and its" in proc.stderr
    )
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_an_abort_during_the_run_fails_the_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train(run_dir, MEMTUNE_TEST_ABORT_STEP="2")
    assert proc.returncode == 134, proc.stderr[-3000:]
    assert "after the run had finished" not in proc.stderr
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 134
