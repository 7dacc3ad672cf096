"""Per-rank memory reaches wandb (offline) and memory.json; no secret is written anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FAST, start_run
from tests.wandb_log import history, summary

pytestmark = pytest.mark.slow

SECRETS = {"WANDB_API_KEY": "wandb-secret-0123456789abcdef", "HF_TOKEN": "hf_secretTOKEN42"}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    for name, value in SECRETS.items():
        mp.setenv(name, value)
    overrides = [*FAST, "logger=wandb", "launcher.num_ranks=2", "trainer.max_steps=4"]
    overrides.remove("logger=none")
    try:
        run = start_run(tmp_path_factory.mktemp("wandb") / "run", overrides, probe=False)
    finally:
        mp.undo()
    assert run.code == 0
    return run


def test_every_rank_memory_series_is_in_the_offline_wandb_run(wandb_run) -> None:
    (log,) = (wandb_run.dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in history(log) if "train/loss" in r]
    assert len(rows) == 4
    for rank in (0, 1):
        for key in ("rss_gib", "peak_rss_gib"):
            series = [r[f"memory/rank{rank}/{key}"] for r in rows]
            assert all(v > 0.05 for v in series), (rank, key, series)
    assert [r["train/loss"] for r in rows] == wandb_run.losses()
    memory = json.loads((wandb_run.dir / "memory.json").read_text())
    assert [r["rank"] for r in memory["ranks"]] == [0, 1]
    assert all(r["peak_rss_gib"] >= r["rss_gib"] * 0.5 for r in memory["ranks"])


def test_planned_next_to_measured_in_summary_memory_json_and_wandb(wandb_run) -> None:
    """Every rank's measured peak next to the plan it was admitted with (CPU: the RSS growth
    from just before the model was built, reported but not judged)."""
    plan = json.loads((wandb_run.dir / "plan.json").read_text())
    planned = sum(r["gib"] for r in plan["rows"] if r["live"])  # what an RSS can hold
    vs_plan = json.loads((wandb_run.dir / "summary.json").read_text())["memory_vs_plan"]
    assert [c["rank"] for c in vs_plan] == [0, 1]
    for c in vs_plan:
        assert c["measure"] == "RSS growth"
        assert c["planned_gib"] == pytest.approx(planned, abs=1e-4)
        assert c["measured_gib"] > 0.0
        assert c["measured_over_planned"] == pytest.approx(
            c["measured_gib"] / c["planned_gib"], rel=1e-3
        )
    assert json.loads((wandb_run.dir / "memory.json").read_text())["vs_plan"] == vs_plan
    (log,) = (wandb_run.dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = summary(log)
    for c in vs_plan:
        key = f"memory/rank{c['rank']}/vs_plan/RSS_growth"
        assert logged[f"{key}/planned_gib"] == c["planned_gib"]
        assert logged[f"{key}/measured_gib"] == c["measured_gib"]


def test_no_secret_is_written_into_the_run_dir(wandb_run) -> None:
    files = [p for p in Path(wandb_run.dir).rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name} found in {path}"


_PEAK_ACROSS_A_WINDOW = """
import json, torch
from memtune.rank.telemetry import memory_snapshot, reset_window_peak, window_peak_gib
cpu = torch.device("cpu")
big = torch.ones(150 * 2**20)  # 600 MiB, every page touched
del big
before = memory_snapshot(cpu)["peak_rss_gib"]
windowed = reset_window_peak(cpu)
small = torch.ones(12 * 2**20)  # 48 MiB: the evaluation's window
del small
print(json.dumps({"before": before, "after": memory_snapshot(cpu)["peak_rss_gib"],
                  "windowed": windowed, "window": window_peak_gib(cpu)}))
"""


def test_an_evaluation_window_does_not_lower_the_runs_peak() -> None:
    """An evaluation resets the peak counters for its own window (eval/memory); the run's peak
    (summary.json, memory.json, the plan comparison) read after it was the evaluation's alone
    whenever the last step was followed by an evaluation."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_ACROSS_A_WINDOW], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["before"] > 0.55  # the 600 MiB tensor was resident
    assert seen["after"] >= seen["before"]
    if seen["windowed"]:  # the kernel let the window reset: it holds the small tensor's peak
        assert seen["window"] < seen["before"] - 0.4


def test_a_start_logs_after_the_rows_of_the_steps_it_continues(tmp_path: Path) -> None:
    """metrics.jsonl holds each step once: a start keeps the rows up to the step it continues
    from and logs the rest again. A start killed before its first checkpoint left steps 1-6,
    and the next start (from step 1, no checkpoint to resume) appended 1, 2, ... after them."""
    from memtune.config import LoggerConfig
    from memtune.rank.telemetry import RunLogger
    from memtune.rundir import RunDir

    rd = RunDir(tmp_path)
    killed = "".join(json.dumps({"step": s, "train/loss": 9.0}) + "\n" for s in range(1, 7))

    def steps_after_a_start_at(done: int) -> list[tuple[int, float]]:
        rd.metrics.write_text(killed)
        logger = RunLogger(rd, 12, LoggerConfig(backend="none"), {}, done)
        logger.log(done + 1, {"train/loss": 1.0})
        logger.close()
        rows = [json.loads(r) for r in rd.metrics.read_text().splitlines()]
        return [(r["step"], r["train/loss"]) for r in rows]

    assert steps_after_a_start_at(0) == [(1, 1.0)]  # no checkpoint: the start from step 1
    assert steps_after_a_start_at(4) == [(1, 9.0), (2, 9.0), (3, 9.0), (4, 9.0), (5, 1.0)]
    # the last row cut short by a kill mid-write: no step's, dropped (it stopped every start)
    killed += '{"step": 7, "train/lo'
    assert steps_after_a_start_at(4) == [(1, 9.0), (2, 9.0), (3, 9.0), (4, 9.0), (5, 1.0)]


def test_progress_in_a_log_file_is_whole_lines_at_most_one_a_minute(capsys, monkeypatch) -> None:
    """Where the output is no terminal, the bar's content comes as lines: the first step of
    this start (a resumed one counts from where it resumed), one a minute at most, the last."""
    import memtune.rank.telemetry as telemetry

    clock = iter([0.0, 5.0, 30.0, 66.0, 70.0, 80.0])
    monkeypatch.setattr(telemetry.time, "monotonic", lambda: next(clock))
    bar = telemetry.LineProgress(total=10, done=5)  # started at 0 s, resumed after step 5
    for step in range(6, 11):
        bar.set_postfix({"loss": f"{1 / step:.4f}"})
        bar.update(1)  # at 5, 30, 66 (61 s after the last line), 70 and 80 s
    assert capsys.readouterr().err.splitlines() == [
        "train: step 6/10 (60%) · 00:05 elapsed, ~00:20 left · loss=0.1667",
        "train: step 8/10 (80%) · 01:06 elapsed, ~00:44 left · loss=0.1250",
        "train: step 10/10 (100%) · 01:20 elapsed · loss=0.1000",
    ]
