"""The CPU demo's first 20 losses, against a recorded file: a dependency bump or a code change
that moves the numbers fails here instead of drifting silently.

    MEMTUNE_WRITE_GOLDEN=1 make test PYTEST_ARGS=tests/test_golden.py   # re-record, then commit

Tolerance: 1e-3 absolute per step. Runs on one machine are bitwise repeatable; a different
thread count per rank (launcher.omp_threads 1 vs 2, another reduction order in every matmul)
moved them by at most 6e-7 here, so 1e-3 leaves room for other CPUs' kernels, while what a
real change does to 20 steps at lr 5e-3 (an initialisation, a template, the schedule, the loss
weighting) is orders of magnitude larger.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memtune.machine import cpu_model, versions
from tests.conftest import start_run

GOLDEN = Path(__file__).parent / "golden" / "demo-cpu-fp32-20-steps.json"
# The shipped demo (experiment=demo-cpu: 2 ranks, ZeRO-3, fp32), cut to 20 steps, no logger.
OVERRIDES = ["logger=none", "trainer.max_steps=20"]
TOLERANCE = 1e-3

pytestmark = pytest.mark.slow


def test_the_demos_first_20_losses_are_the_recorded_ones(tmp_path: Path) -> None:
    run = start_run(tmp_path / "run", OVERRIDES, probe=False)
    assert run.code == 0
    losses = run.losses()
    assert len(losses) == 20
    if os.environ.get("MEMTUNE_WRITE_GOLDEN"):
        record = {
            "overrides": OVERRIDES,
            "tolerance_abs": TOLERANCE,
            "recorded_on": {"cpu": cpu_model(), "versions": versions()},
            "losses": losses,
        }
        GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES
    off = [(i + 1, a, b) for i, (a, b) in enumerate(zip(losses, golden["losses"], strict=True))]
    off = [(step, a, b) for step, a, b in off if abs(a - b) > TOLERANCE]
    assert off == [], (
        f"(step, now, recorded) beyond {TOLERANCE}; recorded with {golden['recorded_on']}"
    )
