"""Hydra multirun sweeps: one run dir a point, the report, its rows and exit codes, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from memtune.config import to_run_config
from tests.conftest import ROOT, compose_cfg, run_train_py


@pytest.mark.slow
def test_multirun_gives_one_run_dir_per_point_and_a_report(tmp_path: Path) -> None:
    import csv

    sweep = tmp_path / "sweep"
    args = ["-m", "peft.r=4,0,8", "peft.rslora=true", "launcher.num_ranks=1", "logger=none"]
    args += ["trainer.max_steps=3"]
    # An empty matplotlib cache, as on a fresh machine: the report's plot builds its font list.
    env = os.environ | {"MPLCONFIGDIR": str(tmp_path / "matplotlib")}
    proc = run_train_py([*args, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env)
    # peft.r=0 fails validation; the other points still run, and the sweep exits non-zero.
    assert proc.returncode == 1, proc.stderr[-3000:]
    # matplotlib's "generated new fontManager" came out as a "[HYDRA] ..." line at the end.
    assert "fontManager" not in proc.stdout + proc.stderr
    dirs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [d.name for d in dirs] == ["0", "1", "2"]
    adapters = [load_file(d / "adapter" / "adapter_model.safetensors") for d in (dirs[0], dirs[2])]
    ranks = [{t.shape[0] for k, t in a.items() if "lora_A" in k} for a in adapters]
    assert ranks == [{4}, {8}]
    assert "r: 4" in (dirs[0] / "config.yaml").read_text()
    assert not (dirs[1] / "adapter").exists()

    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["overrides"], r["status"]) for r in rows] == [
        ("peft.r=4", "ok"),
        ("peft.r=0", "failed (exit 2): config error: peft.r must be > 0 (got 0)"),
        ("peft.r=8", "ok"),
    ]
    assert int(rows[2]["trainable_params"]) == 2 * int(rows[0]["trainable_params"])
    # rsLoRA: alpha / sqrt(r), with the demo's alpha 32 (plain LoRA's 32 / r would halve it).
    assert [r["adapter"] for r in rows] == ["LoRA r=4 rsLoRA", "", "LoRA r=8 rsLoRA"]
    assert [r["scaling"] for r in rows] == ["16.0", "", str(round(32 / 8**0.5, 4))]
    assert float(rows[0]["peak_memory_gib_max"]) > 0
    assert (sweep / "sweep_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "| peft.r=8 | LoRA r=8 rsLoRA | 11.3137 | LoRA, ZeRO-2 | ok | 3 |"
        in (sweep / "sweep_report.md").read_text()
    )
    assert "1 sweep point(s) failed" in proc.stdout


def _demo_copies(folder: Path, *names: str) -> list[Path]:
    """Copies of the demo's data under ``names`` (NAME.jsonl): one sweep value each, one of
    them the data file tests/raise_inject fails on."""
    demo = (ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl").read_text()
    paths = [folder / f"{name}.jsonl" for name in names]
    for path in paths:
        path.write_text(demo)
    return paths


def test_a_sweep_point_that_raises_is_a_failed_row_and_the_report_is_written(
    tmp_path: Path,
) -> None:
    """An exception memtune does not catch in one point (here injected while its data is
    tokenized, tests/raise_inject: any library's error on an input no check foresaw) was kept
    by Hydra's sweeper and raised after the last point: every point ran, then a traceback,
    exit 1, no sweep report, and the point's dir without .hydra/, so that a later `memtune
    report` left it out. Now it ends that point only: a failed row with its one-line reason,
    the report written, exit 1. preprocess_only: no rank starts."""
    import csv

    from memtune.launcher.sweep_report import LAID_OUT

    broken, good = _demo_copies(tmp_path, "broken", "good")
    sweep = tmp_path / "sweep"
    args = ["-m", f"data.path={broken},{good}", "preprocess_only=true", "logger=none"]
    inject = str(ROOT / "tests" / "raise_inject")  # tokenizing `broken` raises RuntimeError
    env = {**os.environ, "PYTHONPATH": inject, "MEMTUNE_TEST_RAISE_ON": str(broken)}
    proc = run_train_py([*args, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    why = f"error: RuntimeError: injected fault tokenizing {broken}"
    assert f"memtune: {why}\n" in proc.stderr
    assert json.loads((sweep / "0" / "exit.json").read_text()) == {"code": 1, "error": why}
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["point"], r["overrides"], r["status"]) for r in rows] == [
        ("0", f"data.path={broken}", f"failed (exit 1): {why}"),
        ("1", f"data.path={good}", LAID_OUT),
    ]
    assert "memtune: 1 sweep point(s) failed: 0\n" in proc.stdout


@pytest.mark.faults
def test_a_sweep_point_stopped_by_ctrl_c_while_tokenizing_is_its_row(tmp_path: Path) -> None:
    """Ctrl-C while a point tokenizes (KeyboardInterrupt, injected there): the sweep stops
    (exit 130) and the point's row says it was interrupted; it read "not run" (its dir held
    no record), as the points after it, which never started, still do."""
    import csv

    from memtune.cli import main as memtune

    stopped, good = _demo_copies(tmp_path, "stopped", "good")
    sweep = tmp_path / "sweep"
    args = ["-m", f"data.path={stopped},{good}", "preprocess_only=true", "logger=none"]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests" / "raise_inject"),
        "MEMTUNE_TEST_RAISE_ON": str(stopped),
        "MEMTUNE_TEST_RAISE_CTRL_C": "1",
    }
    proc = run_train_py([*args, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "memtune: interrupted before any rank started" in proc.stderr
    assert memtune(["report", str(sweep)]) == 0
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["point"], r["status"]) for r in rows] == [
        ("0", "failed (exit 130): interrupted before any rank started"),
        ("1", "not run"),
    ]


def test_a_local_sweeps_exit_code_is_its_own_points(tmp_path: Path) -> None:
    """A second sweep into the dir of one whose point failed, its own points all laid out:
    exit 0. Its report still lists the earlier failed point (a row of the dir); the exit code
    of a local sweep counts the codes of this sweep's points only (it counted every failed row
    of the dir: exit 1)."""
    sweep = tmp_path / "sweep"
    first = ["-m", "peft.r=4,0", "preprocess_only=true", "logger=none"]
    proc = run_train_py([*first, f"hydra.sweep.dir={sweep}"], cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    second = ["-m", "peft.r=4", "preprocess_only=true", "logger=none"]
    proc = run_train_py([*second, f"hydra.sweep.dir={sweep}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "memtune: 1 sweep point(s) failed: 1\n" in proc.stdout  # the first sweep's row


def test_a_sweep_whose_points_ran_in_submitit_jobs_exits_1_when_one_failed(
    tmp_path: Path,
) -> None:
    """Points run by submitit (hydra/launcher=slurm; submitit_local here, the same path on this
    machine) return their codes in their own processes: the submitting command exited 0 with
    a failed point in its report, and each point's job ended 0 (Slurm: COMPLETED; the Slurm
    tier checks the job states). The failed point's job now hands its result over and ends
    with its code; the report counts the point, and the sweep exits 1."""
    import csv

    from memtune.launcher.sweep_report import LAID_OUT

    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", "peft.r=0,4", "preprocess_only=true"]
    args += ["logger=none", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}"]
    proc = run_train_py(args, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["point"], r["status"]) for r in rows] == [
        ("0", "failed (exit 2): config error: peft.r must be > 0 (got 0)"),
        ("1", LAID_OUT),
    ]
    logs = {p.name: p.read_text() for p in (sweep / ".submitit").glob("*/*_log.err")}
    ended = [name for name, text in logs.items() if "job ends with its code, 2" in text]
    assert len(logs) == 2 and len(ended) == 1, logs


def test_the_sweep_report_says_what_each_point_ran_as(tmp_path: Path) -> None:
    """The adapter column reads config.yaml, the settings as asked: a point that plan.auto_fit
    switched to QLoRA read "LoRA r=16" like the point beside it, and neither row said that one
    rank runs ZeRO-2 where ZeRO-3 was asked. The decided column reads the run dir's
    decisions.json and DeepSpeed config. The card is one on which the demo's plan fits on one
    rank only as QLoRA, found with the planner (a narrow window, ~1.32 GiB on 2026-12-07: the
    plan counts a CUDA context on any device; a little more halves the micro batch instead);
    preprocess_only lays each point out with what it decided and starts no rank."""
    import csv
    import dataclasses

    from memtune.config import ConfigError
    from memtune.memory.fit import fit_to_device

    base = to_run_config(compose_cfg(["plan.auto_fit=true", "launcher.num_ranks=1"]))

    def switched_to_qlora(gib: float) -> bool:
        cfg = dataclasses.replace(base, plan=dataclasses.replace(base.plan, device_gib=gib))
        try:
            return "peft=qlora-nf4" in fit_to_device(cfg, True).changes  # auto_fit's overrides
        except ConfigError:  # nothing fits
            return False

    card = next(g / 1000 for g in range(1200, 1600, 2) if switched_to_qlora(g / 1000))
    sweep = tmp_path / "sweep"
    args = ["-m", f"plan.device_gib=null,{card}", "plan.auto_fit=true", "launcher.num_ranks=1"]
    args += ["preprocess_only=true", "logger=none", f"hydra.sweep.dir={sweep}"]
    proc = run_train_py(args, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["overrides"], r["adapter"], r["decided"]) for r in rows] == [
        ("plan.device_gib=null", "LoRA r=16", "LoRA, ZeRO-2"),
        (f"plan.device_gib={card}", "LoRA r=16", "QLoRA, ZeRO-2"),
    ]
    asked = (sweep / "1" / "config.yaml").read_text()  # the settings as given
    assert "method: lora\n" in asked and "stage: 3\n" in asked


def test_a_sweep_whose_points_are_nested_has_its_report(tmp_path: Path) -> None:
    """hydra.sweep.subdir=r${peft.r}/${hydra.job.num} (a subdir with a /) puts each point two
    levels down: the report looked at the sweep dir's direct subdirectories only, found no
    point, and the sweep ended without a report and without a word. A sweep dir's points are
    found where they are (never below a point's own dir)."""
    import csv

    from memtune.launcher.sweep_report import LAID_OUT

    sweep = tmp_path / "sweep"
    args = ["-m", "peft.r=0,4", "hydra.sweep.subdir=r${peft.r}/${hydra.job.num}"]
    args += ["preprocess_only=true", "logger=none", f"hydra.sweep.dir={sweep}"]
    proc = run_train_py(args, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["point"], r["overrides"], r["status"]) for r in rows] == [
        ("r0/0", "peft.r=0", "failed (exit 2): config error: peft.r must be > 0 (got 0)"),
        ("r4/1", "peft.r=4", LAID_OUT),
    ]
    assert "memtune: 1 sweep point(s) failed: r0/0\n" in proc.stdout


def test_a_sweep_without_a_report_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep whose points left no run dir where the report looks ended without a report and
    without a word; only a plan_only=true sweep (its points make none) ends so quietly."""
    from omegaconf import OmegaConf

    from memtune.launcher.sweep_report import SweepReport

    (tmp_path / "multirun.yaml").write_text("{}\n")
    (tmp_path / "elsewhere").mkdir()
    config = {"hydra": {"sweep": {"dir": str(tmp_path)}}, "plan_only": False}
    SweepReport().on_multirun_end(OmegaConf.create(config))
    assert capsys.readouterr().err == (
        "memtune: no sweep report: no point of the sweep left a run dir (a folder with .hydra/) "
        f"under {tmp_path}\n"
    )
    SweepReport().on_multirun_end(OmegaConf.create(config | {"plan_only": True}))
    assert capsys.readouterr() == ("", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "multirun.yaml"]


def test_a_points_record_that_cannot_be_read_is_its_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A summary.json or exit.json memtune's reader rejects (cut short by a full disk, written
    by hand) raised RecordError, a ValueError: `memtune report` was a traceback (the verb
    catches config errors only), and at a sweep's end Hydra turned it into a warning and no
    report was written. That point's row now says which record cannot be read, and why; the
    other points are reported as ever."""
    import csv

    import yaml
    from omegaconf import OmegaConf

    from memtune.cli import main as memtune
    from memtune.launcher.sweep_report import SweepReport

    for point, r in (("0", 4), ("1", 8), ("2", 16), ("3", 32), ("4", 64)):
        (tmp_path / point / ".hydra").mkdir(parents=True)
        (tmp_path / point / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"peft.r={r}"]))
    (tmp_path / "0" / "summary.json").write_text('{"steps": 3')  # cut short
    (tmp_path / "1" / "exit.json").write_text('{"error": "no code"}\n')
    (tmp_path / "2" / "exit.json").write_text('{"code": 2, "error": "config error: y"}\n')
    (tmp_path / "3" / "exit.json").write_text('{"code": "2"}\n')
    names = ["run_dir", "steps", "label_tokens", "input_tokens", "loss_first", "loss_last"]
    names += ["skipped_steps", "wall_s", "tokens_per_s", "world_size", "zero_stage", "attention"]
    names += ["trainable_params", "total_params", "adapter_tensors", "eval_loss", "data", "memory"]
    summary = dict.fromkeys(names, 1) | {"peak_memory_gib": [1.0], "loss_last": "low"}
    (tmp_path / "4" / "summary.json").write_text(json.dumps(summary))
    assert memtune(["report", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "sweep_report.csv").open()))
    assert [(r["point"], r["overrides"], r["status"]) for r in rows] == [
        (
            "0",
            "peft.r=4",
            "record unreadable: summary.json: cannot read it (Expecting ',' delimiter: line 1 "
            "column 12 (char 11))",
        ),
        ("1", "peft.r=8", "record unreadable: exit.json: missing code (not a ExitRecord record)"),
        ("2", "peft.r=16", "failed (exit 2): config error: y"),
        ("3", "peft.r=32", "record unreadable: exit.json: code '2', error None"),
        (
            "4",
            "peft.r=64",
            "record unreadable: summary.json: TypeError: type str doesn't define __round__ method",
        ),
    ]
    capsys.readouterr()
    SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    out, err = capsys.readouterr()
    assert "memtune: 5 sweep point(s) failed: 0, 1, 2, 3, 4\n" in out and err == ""


@pytest.mark.faults  # a real job stopped mid-step: the fault tier's (make test-faults)
def test_the_points_a_stopped_sweep_never_started_are_not_run_rows(tmp_path: Path) -> None:
    """A sweep stopped (SIGTERM here, as Ctrl-C) in its first point ends there, and
    `memtune report` listed that point alone: the points that never started had no row.
    multirun.yaml says what the sweep's points are (Hydra's basic sweeper's expansion of its
    overrides): each without a run dir or a refusal's record is a "not run" row."""
    import csv

    from memtune.cli import main as memtune
    from tests.conftest import wait_for_step

    sweep = tmp_path / "sweep"
    args = ["-m", "peft.r=4,8,16", "launcher.num_ranks=1", "logger=none"]
    args += ["trainer.max_steps=500", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_step(sweep / "0", 1, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-3000:]
    assert "the sweep stops here" in out and not (sweep / "1").exists()
    assert memtune(["report", str(sweep)]) == 0
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    assert [(r["point"], r["overrides"], r["status"]) for r in rows] == [
        ("0", "peft.r=4", "failed (exit 75)"),
        ("1", "peft.r=8", "not run"),
        ("2", "peft.r=16", "not run"),
    ]


def test_a_plan_only_sweep_plans_every_point(tmp_path: Path) -> None:
    """plan_only=true in a sweep planned its first point and exited 0: the others were never
    planned, without a word. A point refused still lets the rest plan; no report (no point
    made a run dir)."""
    sweep = tmp_path / "sweep"
    args = ["-m", "peft.r=4,0,8", "plan_only=true", f"hydra.sweep.dir={sweep}"]
    proc = run_train_py(args, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    planned = [line for line in proc.stdout.splitlines() if line.startswith("memtune plan:")]
    assert [" lora r=4 " in planned[0], " lora r=8 " in planned[1], len(planned)] == [1, 1, 2]
    assert "memtune: config error: peft.r must be > 0 (got 0)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (sweep / "sweep_report.md").exists()


def test_sweep_points_that_would_share_a_run_dir_are_refused(tmp_path: Path) -> None:
    """hydra.sweep.subdir=same: point 1 ran in point 0's finished run dir, was refused as a
    resume of it ('peft.r: checkpoint 4, now 8') and rewrote its .hydra/ and exit.json, so the
    report showed point 0's results under point 1's overrides. A literal subdir is refused
    before the sweep; one that only resolves alike refuses the later point, writing nothing."""
    from omegaconf import OmegaConf

    from memtune.config.command_line import composition_problem
    from memtune.launcher.job import _another_points_dir, _refused_point
    from memtune.launcher.sweep_report import collect, write_report

    assert composition_problem(["-m", "peft.r=4,8", "hydra.sweep.subdir=same"]) == (
        "hydra.sweep.subdir=same gives every point of the sweep the same run dir; keep "
        "${hydra.job.num} in it (the default: 0, 1, ...), e.g. "
        "hydra.sweep.subdir=r-${hydra.job.num}"
    )
    assert composition_problem(["-m", "peft.r=4,8", "hydra.sweep.subdir=r${hydra.job.num}"]) is None
    assert composition_problem(["-m", "peft.r=4", "hydra.sweep.subdir=same"]) is None  # 1 point

    def point(num: int, task: list[str]) -> object:  # a sweep point's hydra config, as read
        return OmegaConf.create({"job": {"num": num}, "overrides": {"task": task}})

    run = tmp_path / "same"
    assert _another_points_dir(run, point(1, ["peft.r=8"])) is None  # nothing there yet
    (run / ".hydra").mkdir(parents=True)
    record = {"hydra": {"mode": "MULTIRUN", "job": {"num": 0}}}
    (run / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml(record))
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(["peft.r=4"]))
    assert _another_points_dir(run, point(1, ["peft.r=8"])) == 0
    assert _another_points_dir(run, point(0, ["peft.r=4"])) is None  # a requeue, a rerun
    # the same point under another number (a later sweep with a subdir of
    # ${hydra.job.override_dirname}, where peft.r=4 came second) is that point again
    assert _another_points_dir(run, point(1, ["peft.r=4"])) is None
    # The refused point is a row of the report, with why (it had none: the sweep's report
    # listed point 0 alone); once it runs in a dir of its own, that dir's row is its row.
    sweep = OmegaConf.merge(point(1, ["peft.r=8"]), {"sweep": {"dir": str(tmp_path)}})
    _refused_point(sweep, "its run dir same holds point 0's run")
    rows = [(r["point"], r["overrides"], r["status"]) for r in collect(tmp_path)]
    assert rows == [
        ("same", "peft.r=4", "failed"),
        ("1", "peft.r=8", "refused: its run dir same holds point 0's run"),
    ]
    assert "| 1 | peft.r=8 |  |  |  | refused: its run dir same holds point 0's run |" in (
        write_report(tmp_path)["md"].read_text()
    )
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    (tmp_path / "1" / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(["peft.r=8"]))
    assert [r["point"] for r in collect(tmp_path)] == ["1", "same"]
    record["hydra"]["mode"] = "RUN"
    (run / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml(record))
    assert _another_points_dir(run, point(1, ["peft.r=8"])) is None  # a single run's dir


def test_a_point_refused_another_sweeps_dir_is_told_so_not_to_change_the_subdir(
    tmp_path: Path,
) -> None:
    """Two sweeps into one hydra.sweep.dir (peft.r=4,8 and peft.r=16,32 started together):
    the second's point 0 found the first's point 0 in dir 0 and was told
    'hydra.sweep.subdir=0 gives several points one dir; keep ${hydra.job.num} in it', a
    setting neither sweep had changed. A point of its own number with other overrides is
    another sweep's."""
    from omegaconf import OmegaConf

    from memtune.launcher.job import _another_points_dir, _shared_dir_refusal

    run = tmp_path / "0"
    (run / ".hydra").mkdir(parents=True)
    record = {"hydra": {"mode": "MULTIRUN", "job": {"num": 0}}}
    (run / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml(record))
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(["peft.r=4"]))
    sweep = {"dir": str(tmp_path), "subdir": "0"}  # ${hydra.job.num}, as Hydra resolves it
    task = {"task": ["peft.r=16"]}
    point = OmegaConf.create({"job": {"num": 0}, "overrides": task, "sweep": sweep})
    other = _another_points_dir(run, point)
    assert other == 0
    assert _shared_dir_refusal(run, other, point) == (
        f"run dir {run} holds point 0 of another sweep (other overrides than this point 0's): "
        f"hydra.sweep.dir={tmp_path} is another sweep's; give this sweep a dir of its own",
        "its run dir 0 holds point 0 of another sweep",
    )
    point.job.num = 1  # a subdir that gives points 0 and 1 one dir: as before
    assert _shared_dir_refusal(run, other, point)[1] == "its run dir 0 holds point 0's run"


def test_a_refused_points_row_and_a_runs_row_leave_out_the_same_shared_overrides(
    tmp_path: Path,
) -> None:
    """One run dir and one refused point: the run's row listed every override
    (experiment=demo-cpu peft.r=4) beside the refused row's peft.r=8, the shared one left out
    of one row only."""
    import yaml

    from memtune.launcher.sweep_report import collect, record_refused

    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    overrides = yaml.safe_dump(["experiment=demo-cpu", "peft.r=4"])
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(overrides)
    record_refused(tmp_path, 1, ["experiment=demo-cpu", "peft.r=8"], "busy")
    rows = [(r["point"], r["overrides"], r["status"]) for r in collect(tmp_path)]
    assert rows == [("0", "peft.r=4", "failed"), ("1", "peft.r=8", "refused: busy")]


def test_the_sweep_report_replaces_its_files_and_names_one_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report's files were written in place: a symlink at sweep_report.csv had the user's
    file it led to overwritten, and a folder at sweep_report.md (a read-only or full sweep
    dir alike) was an IsADirectoryError traceback, at the end of a sweep after every point
    ran, and from `memtune report`."""
    import yaml
    from omegaconf import OmegaConf

    from memtune.config import ConfigError
    from memtune.launcher.sweep_report import SweepReport, main

    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["peft.r=4"]))
    mine = tmp_path.parent / f"{tmp_path.name}-mine.csv"
    mine.write_text("my results\n")
    (tmp_path / "sweep_report.csv").symlink_to(mine)
    main([str(tmp_path)])
    assert mine.read_text() == "my results\n"  # the link was replaced, not written through
    assert (tmp_path / "sweep_report.csv").read_text().startswith("point,overrides,")
    (tmp_path / "sweep_report.md").unlink()
    (tmp_path / "sweep_report.md").mkdir()
    (tmp_path / "sweep_report.md" / "notes.txt").write_text("mine\n")
    said = f"cannot use {tmp_path / 'sweep_report.md'} (IsADirectoryError: Is a directory)"
    with pytest.raises(ConfigError) as refused:
        main([str(tmp_path)])
    assert str(refused.value) == said
    capsys.readouterr()
    SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    err = capsys.readouterr().err
    assert err == (
        f"memtune: sweep report not written: {said}; `memtune report {tmp_path}` writes it "
        "once that is fixed\n"
    )
    assert [p.name for p in (tmp_path / "sweep_report.md").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_sweep_dir_on_a_full_disk_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hydra's sweeper writes SWEEP_DIR/multirun.yaml before any point runs, outside
    memtune's code: on a full disk (ulimit -f here: EFBIG, as ENOSPC) its OSError, which names
    no file, was a traceback and exit 1 (train.py -m ... with ulimit -f 1). memtune's callback,
    as Hydra calls it just before (its exceptions Hydra turns into warnings), writes the file
    first: one line and exit 2, nothing left in the sweep dir; with room, the text Hydra
    writes after it."""
    import resource

    import yaml
    from hydra._internal.callbacks import Callbacks
    from omegaconf import OmegaConf

    callbacks = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["hydra"]["callbacks"]
    sweep = tmp_path / "sweep"
    cfg = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep)}, "callbacks": callbacks}, "pad": "x" * 4096}
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(SystemExit) as stopped:
            Callbacks(cfg).on_multirun_start(config=cfg, config_name="config")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"memtune: error: cannot use {sweep / 'multirun.yaml'} (OSError: File too large)\n"
    )
    assert list(sweep.iterdir()) == []
    Callbacks(cfg).on_multirun_start(config=cfg, config_name="config")
    OmegaConf.save(cfg, tmp_path / "hydra.yaml")  # what Hydra's sweeper writes next
    assert (sweep / "multirun.yaml").read_text() == (tmp_path / "hydra.yaml").read_text()


def test_a_slurm_sweep_without_slurm_is_one_line(tmp_path: Path) -> None:
    """submitit raised 'Could not detect "srun"' from inside Hydra's sweep: a traceback."""
    import subprocess

    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no sbatch, no srun
    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm", "peft.r=4,8", sweep],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("memtune: config error: hydra/launcher=slurm")
    assert "sbatch and srun are not on PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_preprocess_only_sweeps_points_are_laid_out_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``preprocess_only=true`` sweep's points tokenize and lay their run dirs out, and start
    no rank: the report called each "failed" and counted them, for a sweep that did what it
    was asked (exit 0). Its config.yaml as a run dir's layout writes it."""
    import yaml
    from omegaconf import OmegaConf

    from memtune.launcher.sweep_report import LAID_OUT, SweepReport, collect

    for point, r in (("0", 4), ("1", 8)):
        (tmp_path / point / ".hydra").mkdir(parents=True)
        overrides = [f"peft.r={r}", "preprocess_only=true"]
        (tmp_path / point / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        cfg = to_run_config(compose_cfg(overrides))
        (tmp_path / point / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (tmp_path / "1" / "exit.json").write_text('{"code": 2, "error": "config error: x"}\n')
    assert [row["status"] for row in collect(tmp_path)] == [
        LAID_OUT,
        "failed (exit 2): config error: x",
    ]
    SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert "memtune: 1 sweep point(s) failed: 1\n" in capsys.readouterr().out


def test_a_sweep_point_whose_job_still_runs_is_running_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`memtune report` during a sweep (or a second sweep into the same dir) called a point
    still training "failed" and counted it among the failed points: its run dir has no
    summary.json or exit.json yet; nor a point resumed after a stop, whose exit.json (exit 75)
    stays until the job ends: it was "failed (exit 75)". The job's lock on its run dir
    (memtune.run_lock, held here by a real second process) says it has not ended."""
    import yaml
    from omegaconf import OmegaConf

    from memtune.launcher.sweep_report import RUNNING, SweepReport, collect

    for point, r in (("0", 4), ("1", 8)):
        (tmp_path / point / ".hydra").mkdir(parents=True)
        (tmp_path / point / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"peft.r={r}"]))
    hold = "import sys, time\nfrom pathlib import Path\nfrom memtune.run_lock import hold\n"
    hold += "with hold(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n"
    job = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / "0")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline() == "held\n"
        (tmp_path / "1" / "job.lock").write_text("{}\n")  # a point whose job was killed
        assert [row["status"] for row in collect(tmp_path)] == [RUNNING, "failed"]
        stopped = '{"code": 75, "error": "stopped by a signal after step 4"}\n'
        (tmp_path / "0" / "exit.json").write_text(stopped)  # its earlier stop, resumed now
        assert [row["status"] for row in collect(tmp_path)] == [RUNNING, "failed"]
        SweepReport().on_multirun_end(
            OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
        )
        assert "memtune: 1 sweep point(s) failed: 1\n" in capsys.readouterr().out
    finally:
        job.kill()
        job.wait()
    assert [row["status"] for row in collect(tmp_path)] == [
        "failed (exit 75): stopped by a signal after step 4",
        "failed",
    ]


def test_the_sweep_report_reads_a_loss_curve_whose_last_row_is_being_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A point's metrics.jsonl read while its rank appends a row (`memtune report` during a
    sweep; on NFS a reader can see half of the row) or whose last row a kill or a full disk
    cut short: the report was a JSONDecodeError traceback, and no report was written."""
    import yaml

    from memtune.launcher.sweep_report import _losses, main

    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["peft.r=4"]))
    rows = [{"step": 1, "train/loss": 2.5}, {"step": 2, "train/loss": 2.25}]
    cut = '{"step": 3, "train/lo'
    (tmp_path / "0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + cut)
    main([str(tmp_path)])
    assert _losses(tmp_path / "0") == [(1, 2.5), (2, 2.25)]
    assert "| 0 | peft.r=4 |" in (tmp_path / "sweep_report.md").read_text()
    assert (tmp_path / "sweep_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
