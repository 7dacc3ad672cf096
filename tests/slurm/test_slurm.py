"""memtune on a real Slurm cluster (two nodes on 127.0.0.1, see cluster.py): sbatch, preemption
with requeue and resume, and a Hydra sweep through hydra-submitit-launcher.

    make test-slurm          # or: pytest -m slurm tests/slurm

Every job is the CPU demo (tiny Qwen2, 2 ranks, ZeRO-3) cut down to a few steps.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm.cluster import NODES, Cluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
TINY = ["logger=none", "trainer.warmup_steps=2"]
RANKS = 2
END_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


# ------------------------------------------------------------------------------------ helpers


def slurm(cmd: list[str], timeout: float = 30) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


@dataclass
class Record:
    job_id: str
    state: str
    exit_code: str


def sacct(job_id: str) -> list[Record]:
    """Every start of the job, oldest first (-D: a requeued job has one row per start)."""
    out = slurm(["sacct", "-j", job_id, "-D", "-X", "-n", "-P", "-o", "JobID,State,ExitCode"])
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    # "CANCELLED by 0" -> "CANCELLED"
    return [Record(r[0], r[1].split()[0], r[2]) for r in rows]


def in_queue(job_id: str) -> bool:
    return bool(slurm(["squeue", "-h", "-j", job_id, "-o", "%i"]).strip())


def wait_done(job_id: str, timeout: float, log: Path | None = None) -> list[Record]:
    """Wait until the job has left the queue and accounting has its final state."""
    deadline = time.monotonic() + timeout
    while True:
        records = sacct(job_id)
        if records and records[-1].state in END_STATES and not in_queue(job_id):
            return records
        if time.monotonic() > deadline:
            subprocess.run(["scancel", "--full", job_id], timeout=30, check=False)
            pytest.fail(
                f"job {job_id} did not finish within {timeout:.0f} s: {records}\n{tail(log)}"
            )
        time.sleep(2)


def tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- {path}\n" + "\n".join(text)


def job_env(ranks_per_node: int = RANKS) -> dict[str, str]:
    # The jobs inherit it (sbatch --export=ALL): SLURM_CONF, this session's MEMTUNE_CACHE_DIR.
    # train.py sizes a job from its allocation: nodes × $MEMTUNE_RANKS_PER_NODE on CPU nodes.
    return {
        **os.environ,
        "MEMTUNE_PYTHON": sys.executable,
        "MEMTUNE_RANKS_PER_NODE": str(ranks_per_node),
    }


def sweep_command(sweep: Path, *overrides: str) -> list[str]:
    """A Hydra sweep through hydra/launcher=slurm (one Slurm job per point) into ``sweep``."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        "hydra/launcher=slurm",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        *overrides,
    ]


def run_sweep(sweep: Path, *overrides: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        sweep_command(sweep, *overrides),
        cwd=sweep.parent,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def submit(
    out_dir: Path,
    overrides: list[str],
    sbatch_args: tuple[str, ...] | list[str] = (),
    ranks_per_node: int = RANKS,
) -> tuple[str, Path]:
    log = out_dir / "slurm-%j.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *sbatch_args, str(SBATCH), *overrides],
        cwd=ROOT,  # the script runs train.py from the submit dir
        env=job_env(ranks_per_node),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), proc.stdout
    return job_id, out_dir / f"slurm-{job_id}.out"


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "train/loss" in r]


def restarts(job_id: str) -> int | None:
    """Restarts=N of `scontrol show job` (kept MinJobAge=600 s after the end)."""
    proc = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    found = re.search(r"\bRestarts=(\d+)", proc.stdout)
    return int(found.group(1)) if found else None


def assert_adapter(run_dir: Path, r: int) -> None:
    adapter = run_dir / "adapter"
    weights = adapter / "adapter_model.safetensors"
    assert weights.is_file() and weights.stat().st_size > 0, f"no adapter weights in {adapter}"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == r


# -------------------------------------------------------------------------------------- tests


def test_sbatch_cpu_demo(slurm_cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 8
    job_id, log = submit(
        tmp_path,
        [f"run_dir={run_dir}", *TINY, f"trainer.max_steps={steps}", "trainer.save_every=4"],
    )
    records = wait_done(job_id, timeout=600, log=log)

    assert [(r.state, r.exit_code) for r in records] == [("COMPLETED", "0:0")], tail(log)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["world_size"] == RANKS
    assert summary["loss_last"] < summary["loss_first"]
    assert steps_logged(run_dir) == list(range(1, steps + 1))
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert_adapter(run_dir, r=16)  # the demo's LoRA rank
    assert (run_dir / "checkpoints" / "step-0000004").is_dir()
    assert f"memtune: job {job_id} restart 0" in log.read_text()


def preempt_after_3_steps(
    job_id: str,
    log: Path,
    run_dir: Path,
    drain: str | None = None,
    stop: tuple[str, ...] = ("scancel", "--signal=USR2", "--batch"),
) -> list[Record]:
    """Wait for 3 training steps, then do what Slurm does before a time limit
    (--signal=B:USR2@120): USR2 to the batch script, whose trap passes it to the ranks through
    srun and train.py (``stop``: another scancel). With ``drain``, that node is drained first
    (it takes no new job once this one leaves it). Returns the job's records once it has
    ended."""
    deadline = time.monotonic() + 300
    while len(steps_logged(run_dir)) < 3:
        assert in_queue(job_id), f"job {job_id} ended before training\n{tail(log)}"
        if time.monotonic() > deadline:
            subprocess.run(["scancel", "--full", job_id], timeout=30, check=False)
            pytest.fail(f"job {job_id}: no training steps after 300 s\n{tail(log)}")
        time.sleep(0.5)
    if drain:
        slurm(["scontrol", "update", f"NodeName={drain}", "State=DRAIN", "Reason=memtune-test"])
    slurm([*stop, job_id])
    return wait_done(job_id, timeout=480, log=log)


def test_preempted_job_is_requeued_and_resumes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 40
    # No periodic checkpoint before the end: the only one to resume from is the preemption's.
    job_id, log = submit(
        tmp_path,
        [f"run_dir={run_dir}", *TINY, f"trainer.max_steps={steps}", "trainer.save_every=1000"],
    )
    records = preempt_after_3_steps(job_id, log, run_dir)

    assert [r.state for r in records] == ["REQUEUED", "COMPLETED"], f"{records}\n{tail(log)}"
    assert records[-1].exit_code == "0:0"
    assert restarts(job_id) == 1
    text = log.read_text()
    assert f"memtune: job {job_id} restart 1" in text  # SLURM_RESTART_COUNT in the second start
    assert "requeueing job" in text

    resumed = json.loads((run_dir / "resume.json").read_text())["checkpoint"]
    stopped_at = int(Path(resumed).name.removeprefix("step-"))
    assert 3 <= stopped_at < steps, resumed
    assert f"resumed at step {stopped_at}" in text
    # Every step exactly once across the two starts: the second one continued where the
    # first one saved, neither repeating nor skipping a step.
    assert steps_logged(run_dir) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert_adapter(run_dir, r=16)


def test_a_cancelled_job_is_not_requeued(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """`scancel JOBID`: TERM to the script and every task; the ranks save a checkpoint, and the
    script requeued the job, which trained on (a job could not be cancelled)."""
    run_dir = tmp_path / "run"
    job_id, log = submit(
        tmp_path,
        [f"run_dir={run_dir}", *TINY, "trainer.max_steps=40", "trainer.save_every=1000"],
    )
    records = preempt_after_3_steps(job_id, log, run_dir, stop=("scancel",))
    assert [r.state for r in records] == ["CANCELLED"], f"{records}\n{tail(log)}"
    assert restarts(job_id) == 0
    assert f"Slurm ended job {job_id} (scancel, or its time limit): not requeued" in log.read_text()
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 75
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")], tail(log)


def test_a_stop_that_cannot_be_requeued_fails(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """--no-requeue, then USR2: `scontrol requeue` is refused, and the job ended COMPLETED, exit
    0, having trained 3 steps of 40. Its name, with = and a comma, is in the default run dir
    (train.py refused the run_dir=outputs/slurm/NAME-ID the script had set: "a sweep")."""
    name = "r=8,lr=1e-4"
    job_id, log = submit(
        tmp_path,
        [*TINY, "trainer.max_steps=40", "trainer.save_every=1000"],
        sbatch_args=["--no-requeue", f"--job-name={name}"],
    )
    run_dir = ROOT / "outputs" / "slurm" / f"{name}-{job_id}"
    try:
        records = preempt_after_3_steps(job_id, log, run_dir)
        assert [(r.state, r.exit_code) for r in records] == [("FAILED", "75:0")], tail(log)
        assert f"scontrol requeue {job_id} failed" in log.read_text()
        assert json.loads((run_dir / "exit.json").read_text())["code"] == 75
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # this test's, in the checkout's outputs/


def test_a_requeued_job_that_comes_back_on_fewer_nodes_resumes(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """A job submitted for 1-2 nodes starts on both (per-node form, a rank on each); while it
    is preempted, memtune-node1 is drained, so the requeued job gets one node: train.py sizes
    itself from that allocation and resumes the same run on one rank instead of waiting for a
    second node or being refused."""
    run_dir = tmp_path / "run"
    steps = 40
    job_id, log = submit(
        tmp_path,
        [f"run_dir={run_dir}", *TINY, f"trainer.max_steps={steps}", "trainer.save_every=1000"],
        sbatch_args=["--nodes=1-2"],
        ranks_per_node=1,
    )
    try:
        records = preempt_after_3_steps(job_id, log, run_dir, drain=NODES[1])
    finally:
        slurm(["scontrol", "update", f"NodeName={NODES[1]}", "State=RESUME"])
    assert [r.state for r in records] == ["REQUEUED", "COMPLETED"], f"{records}\n{tail(log)}"
    text = log.read_text()
    first, second = text.split(f"memtune: job {job_id} restart 1", 1)
    assert "on memtune-node[0-1]" in first and f"on {NODES[0]}" in second, tail(log)
    assert "launcher.nnodes=2 launcher.num_ranks=2, sized from its allocation" in first
    assert "launcher.nnodes=1 launcher.num_ranks=1, sized from its allocation" in second
    assert "resuming across a change of ranks" in second
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume["changed"]["launcher.nnodes"] == [2, 1], tail(log)
    assert resume["changed"]["launcher.num_ranks"] == [2, 1]
    # Every step exactly once across the two starts, on two nodes and then on one.
    assert steps_logged(run_dir) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 1
    assert_adapter(run_dir, r=16)


def test_submitit_sweep_one_job_per_point(slurm_cluster: Cluster, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    steps = 6
    proc = run_sweep(
        sweep,
        "peft.r=4,8",
        f"trainer.max_steps={steps}",
        f"launcher.num_ranks={RANKS}",
        "hydra.launcher.timeout_min=20",
        timeout=780,
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output

    # One Slurm job (array task) per point, each COMPLETED.
    submitit = sweep / ".submitit"
    job_ids = sorted(p.name for p in submitit.iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, (sorted(p.name for p in submitit.iterdir()), output)
    for job_id in job_ids:
        # submitit has the point's result once its function returns; the job itself ends (and
        # accounting says COMPLETED) a moment later.
        records = wait_done(job_id, timeout=120)
        assert [(r.state, r.exit_code) for r in records] == [("COMPLETED", "0:0")]

    for point, r in (("0", 4), ("1", 8)):
        run_dir = sweep / point
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
        assert_adapter(run_dir, r=r)

    with (sweep / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["point"], row["overrides"], row["status"], row["steps"]) for row in rows] == [
        ("0", "peft.r=4", "ok", str(steps)),
        ("1", "peft.r=8", "ok", str(steps)),
    ]
    # LoRA on all linear layers of the tiny model: trainable parameters scale with r.
    assert int(rows[1]["trainable_params"]) == 2 * int(rows[0]["trainable_params"])
    report = (sweep / "sweep_report.md").read_text()
    assert "peft.r=4" in report and "peft.r=8" in report
    assert (sweep / "sweep_loss.png").stat().st_size > 0


def test_a_preempted_sweep_point_is_requeued_by_submitit_and_resumes_smaller(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """hydra/launcher=slurm: a point's job preempted with USR2 saves its checkpoint, train.py
    hands the signal to submitit, which requeues the job; the restart (given one rank per node
    instead of two by a setup line, as a smaller allocation would) resumes the same run dir."""
    sweep = tmp_path / "sweep"
    steps = 40
    shrink = tmp_path / "shrink-on-restart.sh"
    shrink.write_text(
        "[[ ${SLURM_RESTART_COUNT:-0} -ge 1 ]] && export MEMTUNE_RANKS_PER_NODE=1\n"
        'echo "memtune-test: restart ${SLURM_RESTART_COUNT:-0}, '
        '${MEMTUNE_RANKS_PER_NODE} rank(s) per node"\n'
    )
    proc = subprocess.Popen(
        sweep_command(
            sweep,
            "peft.r=4",
            f"trainer.max_steps={steps}",
            "trainer.save_every=1000",
            "hydra.launcher.timeout_min=20",
            f"hydra.launcher.setup=['. {shrink}']",
        ),
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = sweep / "0"
    submitit = sweep / ".submitit"
    try:
        deadline = time.monotonic() + 300
        while len(steps_logged(run_dir)) < 3:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no training steps after 300 s"
            time.sleep(0.5)
        # One point: a plain job, not an array (submitit's folder per job: .submitit/<id>).
        job_ids = [p.name for p in submitit.iterdir() if re.fullmatch(r"\d+(_0)?", p.name)]
        assert len(job_ids) == 1, sorted(p.name for p in submitit.iterdir())
        job_id = job_ids[0]
        slurm(["scancel", "--signal=USR2", job_id])  # the job's tasks, as --signal=USR2@120 does
        output = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]

    records = wait_done(job_id, timeout=120)  # the result is in before the job has ended
    assert [r.state for r in records] == ["REQUEUED", "COMPLETED"], records
    job_log = (submitit / job_id / f"{job_id}_0_log.out").read_text()
    assert "memtune-test: restart 1, 1 rank(s) per node" in job_log, job_log[-3000:]
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume["changed"]["launcher.num_ranks"] == [RANKS, 1], job_log[-3000:]
    assert steps_logged(run_dir) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 1
    assert_adapter(run_dir, r=4)
    with (sweep / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["status"], row["steps"]) for row in rows] == [("ok", str(steps))]


def test_a_sweep_point_on_two_nodes_is_refused_by_name(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """hydra.launcher.nodes=2 would run the point's whole job once per node, and submitit could
    not requeue it onto fewer nodes: each node's task stops before anything starts and the
    sweep report names the refusal."""
    sweep = tmp_path / "sweep"
    proc = run_sweep(
        sweep, "peft.r=4", "hydra.launcher.timeout_min=5", "hydra.launcher.nodes=2", timeout=300
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    exit_record = json.loads((sweep / "0" / "exit.json").read_text())
    assert exit_record["code"] == 2, output
    assert "hydra.launcher.nodes=2: a sweep point runs on one node" in exit_record["error"]
    assert not (sweep / "0" / "config.yaml").exists()  # nothing prepared, no ranks started
    with (sweep / "sweep_report.csv").open() as f:
        [status] = [row["status"] for row in csv.DictReader(f)]
    assert status.startswith(
        "failed (exit 2): config error: hydra.launcher.nodes=2: a sweep point runs on one node"
    ), status


def test_a_failed_sweep_points_job_fails_and_the_report_is_written(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """A point that failed returned its code to Hydra inside its Slurm job, whose function then
    returned normally: Slurm recorded every job COMPLETED and the submitting command exited 0.
    Now the failed point's job ends with the point's code (FAILED, 2:0) after handing submitit
    its result, the other point's job is COMPLETED, the report has both rows and the sweep
    exits 1. preprocess_only: nothing trains, the jobs take seconds."""
    sweep = tmp_path / "sweep"
    proc = run_sweep(
        sweep, "peft.r=0,4", "preprocess_only=true", "hydra.launcher.timeout_min=5", timeout=300
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    submitit = sweep / ".submitit"
    job_ids = sorted(p.name for p in submitit.iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, (sorted(p.name for p in submitit.iterdir()), output)
    states = [[(r.state, r.exit_code) for r in wait_done(j, timeout=120)] for j in job_ids]
    assert states == [[("FAILED", "2:0")], [("COMPLETED", "0:0")]], output
    assert proc.returncode == 1, output
    with (sweep / "sweep_report.csv").open() as f:
        rows = [(row["point"], row["status"]) for row in csv.DictReader(f)]
    assert rows == [
        ("0", "failed (exit 2): config error: peft.r must be > 0 (got 0)"),
        ("1", "laid out (preprocess_only)"),
    ], output
    assert "memtune: 1 sweep point(s) failed: 0" in proc.stdout
