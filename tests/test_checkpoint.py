"""Nothing lost: exact resume, interrupted saves skipped, SIGTERM and kill -9, config checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from memtune.checkpoints import step_dir_name
from memtune.config import load_run_config
from memtune.launcher.prepare import already_finished
from memtune.launcher.spawn import rank_processes
from tests.conftest import FAST, ROOT, run_train_py, wait_for_step

pytestmark = pytest.mark.slow

# LoRA dropout on (the shipped experiments use 0.05): the resume must continue its masks too.
BASE = [
    *FAST,
    "launcher.num_ranks=2",
    "trainer.max_steps=12",
    "trainer.save_every=4",
    "peft.dropout=0.1",
]


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["train/loss"] for r in rows]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 12-step run with checkpoints at 4, 8 and 12 (keep_last 2)."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    proc = run_train_py([*BASE, f"run_dir={run_dir}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir.parent / "train_py.out").write_text(proc.stdout + proc.stderr)
    return run_dir


# Third-party lines memtune filters at their source (memtune.quiet, model synthesis).
NOISE = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes, in the job and every rank
    "[HYDRA]",  # any library message routed through Hydra's log format
    "Unable to find hostfile",  # DeepSpeed's runner (a one-node job does not start it)
    "built successfully",  # deepspeed.comm's shm op, once per rank
    "unable to detect it",  # DeepSpeed guessing the accelerator
    "Writing model shards",  # save_pretrained's progress bar (the tiny model's build)
)


def test_a_run_prints_memtunes_own_lines_first_and_no_known_noise(finished: Path) -> None:
    out = (finished.parent / "train_py.out").read_text()
    assert [n for n in NOISE if n in out] == []
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0].startswith("memtune: "), lines[:3]
    assert "memtune: done in" in out
    # Output that is no terminal (a Slurm .out file, a pipe) gets progress as whole lines, not
    # tqdm's bar redrawn with carriage returns into one line (75 KB for 1,000 steps): here the
    # first step and the last (12 steps take less than the minute between lines).
    assert "\r" not in out
    progress = [line for line in lines if line.startswith("train: step ")]
    assert [line.split(" (")[0] for line in progress] == ["train: step 1/12", "train: step 12/12"]
    assert "left · loss=" in progress[0] and progress[1].split(" · ")[-1].startswith("loss=")


def test_checkpoints_are_complete_and_pruned(finished: Path) -> None:
    root = finished / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-0000008", "step-0000012"]
    assert (root / "latest").read_text().strip() == "step-0000012"
    ckpt = root / "step-0000012"
    for name in (
        "complete.json",
        "trainer_state.json",
        "config.yaml",
        "rng_rank0.pt",
        "rng_rank1.pt",
        "adapter/adapter_model.safetensors",
    ):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["world_size"] == 2 and len(state["losses"]) == 12
    # Frozen base weights are not in the engine state: it holds only the LoRA-sized tensors
    # (fp32 master weights and two Adam moments, 12 bytes a LoRA weight, plus file overhead).
    engine_bytes = sum(f.stat().st_size for f in (ckpt / "engine").rglob("*") if f.is_file())
    lora = json.loads((finished / "summary.json").read_text())["trainable_params"]
    assert 12 * lora < engine_bytes < 14 * lora
    final = load_file(finished / "adapter" / "adapter_model.safetensors")
    in_ckpt = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(final[k], in_ckpt[k]) for k in final)


@pytest.mark.faults
def test_resume_after_a_crash_is_exact(finished: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    reference = _losses(finished)
    root = run_dir / "checkpoints"
    # The crash: step 12 never finished saving, and a half-written step 10 is what `latest`
    # names. Resume must skip it with a warning and continue from step 8.
    shutil.rmtree(root / "step-0000012")
    half = root / "step-0000010"
    shutil.copytree(root / "step-0000008", half)
    (half / "complete.json").unlink()
    (root / "latest").write_text("step-0000010\n")
    config = (run_dir / "config.yaml").read_text().replace(str(finished), str(run_dir))
    (run_dir / "config.yaml").write_text(config)

    proc = run_train_py([*BASE, f"run_dir={run_dir}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping {half}: incomplete" in proc.stdout
    assert "resuming from" in proc.stdout and "(step 8)" in proc.stdout
    # fp32 on CPU: the continued run repeats the uninterrupted one bit for bit.
    assert _losses(run_dir) == reference
    a = load_file(finished / "adapter" / "adapter_model.safetensors")
    b = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_starting_a_finished_run_again_launches_nothing(finished: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    records = ["metrics.jsonl", "config.yaml", "decisions.json", "resume.json", "plan.txt"]
    records += [".hydra/config.yaml", ".hydra/overrides.yaml", "exit.json"]
    before = {name: (run_dir / name).read_bytes() for name in records}
    # Another learning rate (a resume may change it): no step follows, so nothing is recorded
    # (config.yaml took lr 0.5 and resume.json "lr changed from step 13 on" before).
    proc = run_train_py([*BASE, f"run_dir={run_dir}", "trainer.lr=0.5"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished: step-0000012 is step 12 of trainer.max_steps=12" in proc.stdout
    assert "memtune: done in" not in proc.stdout  # no ranks, no repeated summary
    assert "resuming from" not in proc.stdout and "schedule" not in proc.stdout
    # Said before the data (it was read or tokenized again for nothing) and, on a GPU, before
    # the preflight that rewrote preflight.json.
    assert "memtune: data " not in proc.stdout and "memtune: train: " not in proc.stdout
    assert {name: (run_dir / name).read_bytes() for name in records} == before
    # More steps asked for (or no adapter exported yet): the ranks start and train on.
    cfg = load_run_config(run_dir / "config.yaml")
    last = run_dir / "checkpoints" / "step-0000012"  # what resume=auto continues from
    assert already_finished(cfg, run_dir, last) is not None
    cfg.trainer.max_steps = 13
    assert already_finished(cfg, run_dir, last) is None
    cfg.trainer.max_steps = 12
    # A summary of an earlier end (its files still verify) is not this step's end.
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "steps": 8}))
    assert already_finished(cfg, run_dir, last) is None
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert already_finished(cfg, run_dir, last) is not None
    (run_dir / "adapter" / "adapter_model.safetensors").unlink()
    assert already_finished(cfg, run_dir, last) is None


def test_resume_with_a_contradicting_config_is_refused(finished: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    records = [run_dir / "exit.json", run_dir / ".hydra" / "config.yaml"]
    before = [p.read_bytes() for p in records]
    proc = run_train_py([*BASE, f"run_dir={run_dir}", "peft.r=4", "launcher.num_ranks=1"], cwd=ROOT)
    assert proc.returncode == 2
    assert "cannot resume from" in proc.stderr
    # The finished run keeps its records: exit.json code 2 would make it unfinished, and the
    # next right start would train and export it again (found by the day's review)
    assert [p.read_bytes() for p in records] == before
    assert "peft.r: checkpoint 16, now 4 (the LoRA rank)" in proc.stderr
    # Another number of ranks alone would be allowed (tests/test_resume_world.py).
    assert "launcher.num_ranks" not in proc.stderr
    assert "resume=never" in proc.stderr
    # resume=never lifts the refusal (preprocess_only: lay out the run dir, start no ranks),
    # and moves the earlier run aside whole, so nothing of it is read as the new run's.
    old = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    (run_dir / "my-notes.txt").write_text("the user's own file\n")
    fresh = run_train_py(
        [*BASE, f"run_dir={run_dir}", "peft.r=4", "resume=never", "preprocess_only=true"], cwd=ROOT
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (previous,) = (run_dir / "previous").iterdir()
    assert f"resume=never: the earlier run in this dir moved to {previous}" in fresh.stdout
    moved = {
        str(p.relative_to(previous)): p.read_bytes() for p in previous.rglob("*") if p.is_file()
    }
    kept = {k: v for k, v in old.items() if not k.startswith(".hydra/") and k != "job.lock"}
    assert {k: v for k, v in moved.items() if k in kept} == kept  # byte for byte
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "adapter").exists()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "summary.json").exists()
    assert (run_dir / "my-notes.txt").read_text() == "the user's own file\n"  # not a run's
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume == {"checkpoint": None, "changed": {}}
    assert "r: 4" in (run_dir / "config.yaml").read_text()
    # The next resume=auto start continues the new run (none yet), not the old one.
    again = run_train_py([*BASE, f"run_dir={run_dir}", "peft.r=4", "preprocess_only=true"], ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "resume.json").read_text())["checkpoint"] is None
    # A record that cannot be written (a folder where plan.txt goes; a read-only or full disk
    # alike) is one line naming it, exit 2, not a traceback; the folder is left as it was.
    (run_dir / "plan.txt").unlink()
    (run_dir / "plan.txt").mkdir()
    (run_dir / "plan.txt" / "mine.txt").write_text("the user's\n")
    stuck = run_train_py([*BASE, f"run_dir={run_dir}", "peft.r=4", "preprocess_only=true"], ROOT)
    said = f"error: cannot use {run_dir / 'plan.txt'} (IsADirectoryError: Is a directory)"
    assert stuck.returncode == 2 and "Traceback" not in stuck.stderr, stuck.stderr[-3000:]
    assert [line for line in stuck.stderr.splitlines() if line.strip()] == [f"memtune: {said}"]
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 2, "error": said}
    assert [p.name for p in (run_dir / "plan.txt").iterdir()] == ["mine.txt"]


@pytest.mark.faults
def test_sigterm_saves_and_the_same_command_continues(finished: Path, tmp_path: Path) -> None:
    """Stopped by SIGTERM at any step, then by the end of train.py (kill -9), the same command
    continues the run exactly each time: the losses of every step and the exported adapter are
    the uninterrupted run's (``finished``, the same config), bit for bit as after a crash (fp32
    on CPU, LoRA dropout's masks too)."""
    run_dir = tmp_path / "run"
    args = [*BASE, f"run_dir={run_dir}"]
    proc = _start(args, ROOT)
    wait_for_step(run_dir, 1, proc)
    # The same command again while the job trains: refused at once (one job per run dir),
    # naming the running job, and nothing of it in the run dir.
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file()}
    second = run_train_py(args, cwd=ROOT, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"in use by another memtune job (host {socket.gethostname()}, pid {proc.pid}" in (
        second.stderr
    )
    after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file()}
    assert {k: v for k, v in after.items() if k in before and k != "metrics.jsonl"} == {
        k: v for k, v in before.items() if k != "metrics.jsonl"
    }
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-3000:]  # memtune.exit_codes.EXIT_REQUEUE
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = run_dir / "checkpoints" / latest / "trainer_state.json"
    stopped_at = json.loads(state.read_text())["step"]
    assert 1 <= stopped_at < 12, stopped_at
    assert "stopped by a signal" in out

    # train.py itself killed (kill -9, the OOM killer): its ranks trained on to the end unseen,
    # holding the run dir, with no exit.json. Now they stop at the next step boundary with a
    # checkpoint, and rank 0 writes exit.json saying why.
    proc = _start(args, ROOT)
    # one step past the resume, not more: the run is 12 steps, and on a fast machine the first
    # stop (after the refused start's seconds) may come as late as step 7 or 8
    wait_for_step(run_dir, stopped_at + 1, proc)
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    out, _ = proc.communicate(timeout=120)  # its stdout's end: the ranks' too
    assert not [r for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = run_dir / "checkpoints" / latest / "trainer_state.json"
    orphaned_at = json.loads(state.read_text())["step"]
    assert stopped_at + 1 <= orphaned_at < 12, (stopped_at, orphaned_at)
    said = (
        f"stopped by the end of its launcher (train.py, pid {proc.pid}) after step "
        f"{orphaned_at}; checkpoint saved. Run the same command again to continue (exit code 75)."
    )
    assert f"memtune: {said}" in out
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 75, "error": said}

    again = run_train_py(args, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {orphaned_at})" in again.stdout
    assert _losses(run_dir) == _losses(finished)
    a = load_file(finished / "adapter" / "adapter_model.safetensors")
    b = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.faults
def test_ctrl_c_stops_with_a_checkpoint_and_a_second_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C reaches the job alone (the ranks are a process group of their own): the first is a
    graceful stop like SIGTERM's, the second ends the ranks at once; neither prints a
    traceback (the job used to print 236 lines with 6 tracebacks and save nothing)."""
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "launcher.num_ranks=2",
        "trainer.max_steps=40",
        "trainer.save_every=0",
        f"run_dir={run_dir}",
    ]
    proc = _start(args, ROOT)
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-3000:]
    assert "memtune: Ctrl-C: stopping at the next step boundary with a checkpoint" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert stopped_at["step"] >= 3

    proc = _start(args, ROOT)  # continues from that checkpoint
    wait_for_step(run_dir, stopped_at["step"] + 2, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]  # memtune.exit_codes.EXIT_INTERRUPTED
    assert time.monotonic() - start < 15
    assert "memtune: stopped at once by a second Ctrl-C (exit code 130)" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 130}


@pytest.mark.faults
def test_kill_9_of_one_rank_ends_the_job_and_resume_works(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "launcher.num_ranks=2",
        "trainer.max_steps=14",
        "trainer.save_every=4",
        f"run_dir={run_dir}",
    ]
    proc = _start(args, ROOT)
    wait_for_step(run_dir, 6, proc)
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 2
    start = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    logged = _losses(run_dir)  # steps 1..k, k >= 6: the last ones after the last checkpoint
    again = run_train_py(args, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_at = int(re.search(r"resuming from .*\(step (\d+)\)", again.stdout)[1])
    assert 4 <= resumed_at <= len(logged) and resumed_at % 4 == 0
    losses = _losses(run_dir)
    assert len(losses) == 14
    # The steps the killed start logged after its last checkpoint (step 4: 5, 6, ...) were
    # trained again from it: fp32 on CPU, the same losses bit for bit. Step 5's shows the
    # weights and the data order restored, step 6's also Adam's moments (zeroed on load, the
    # old check of the step count alone still passed).
    assert losses[: len(logged)] == logged


@pytest.mark.faults
def test_a_rank_killed_while_loading_ends_the_job_at_once_naming_it(tmp_path: Path) -> None:
    """Killed before any collective, a rank's peers wait in the rendezvous or load on: the job
    ends within seconds (it took 32 s: DeepSpeed's launcher gave the survivors a 30 s SIGTERM
    grace, which a loading rank only notes), with one code, naming the rank and the signal."""
    run_dir = tmp_path / "run"
    proc = _start([*FAST, "launcher.num_ranks=2", f"run_dir={run_dir}"], ROOT)
    deadline = time.monotonic() + 120
    while len(ranks := rank_processes(proc.pid)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    victim = next(r for r in ranks if r.environ().get("RANK") == "1")
    victim.kill()
    start = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - start < 10, out[-3000:]
    assert proc.returncode == 137, out[-3000:]  # 128 + SIGKILL, whatever the other rank did
    assert f"memtune: rank 1 (pid {victim.pid}) was killed by SIGKILL (signal 9)" in out
    assert "Traceback" not in out
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 137}


class _NotData:
    """A class a checkpoint has no business holding."""


def test_checkpoint_files_are_verified_before_loading(finished: Path, tmp_path: Path) -> None:
    from memtune.rank.checkpoint import UnsafeCheckpoint, verify_checkpoint_files

    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished / "checkpoints" / "step-0000012", ckpt)
    assert verify_checkpoint_files(ckpt) == 4  # model + optimizer states of 2 ranks
    victim = next((ckpt / "engine").glob("*optim_states.pt"))
    torch.save({"payload": _NotData()}, victim)
    with pytest.raises(UnsafeCheckpoint, match=r"optim_states\.pt: refusing to load"):
        verify_checkpoint_files(ckpt)


class _ByName:
    """Pickles as ``getattr(owner, name)``: how Debian's Python 3.11.2 pickles an Enum member
    (DeepSpeed's ZeroStageEnum in every optimizer file), not 3.11.7."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def test_an_enum_member_pickled_by_name_loads_and_no_other_getattr(tmp_path: Path) -> None:
    """Every resume was refused on such a Python ("Unsupported global: GLOBAL getattr")."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from memtune.rank.checkpoint import UnsafeCheckpoint, verify_checkpoint_files

    engine = tmp_path / "ckpt" / "engine"
    engine.mkdir(parents=True)
    state = {"zero_stage": _ByName(ZeroStageEnum, "optimizer_states"), "step": torch.ones(1)}
    torch.save(state, engine / "optim_states.pt")
    assert verify_checkpoint_files(tmp_path / "ckpt") == 1
    # getattr reaching past the members of an allowed class: refused
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    for owner, name in ((ZeroStageEnum, "__class__"), (LossScaler, "update_scale")):
        torch.save({"payload": _ByName(owner, name)}, engine / "optim_states.pt")
        with pytest.raises(UnsafeCheckpoint, match="is not an Enum member") as refused:
            verify_checkpoint_files(tmp_path / "ckpt")
        assert "weights_only" not in str(refused.value)


# ZeRO-2 writes one model-states file (rank 0) and one optimizer file per rank; ZeRO-3 two
# files per rank.
@pytest.mark.parametrize(("run_name", "files"), [("zero2_run", 3), ("bf16_run", 4)])
def test_other_engines_pass_the_same_check(run_name: str, files: int, request) -> None:
    from memtune.rank.checkpoint import verify_checkpoint_files

    run = request.getfixturevalue(run_name)
    last = run.dir / "checkpoints" / step_dir_name(run.cfg.trainer.max_steps)
    assert verify_checkpoint_files(last) == files


@pytest.mark.faults  # a whole resumed job; make test keeps the other resume checks
def test_resume_from_an_explicit_checkpoint_into_a_new_run_dir(finished: Path, tmp_path: Path):
    ckpt = finished / "checkpoints" / "step-0000008"
    run_dir = tmp_path / "branch"
    proc = run_train_py([*BASE, f"run_dir={run_dir}", f"resume={ckpt}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {ckpt} (step 8)" in proc.stdout
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["train/loss"] for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows if "train/loss" in r] == [9, 10, 11, 12]
    assert resumed == _losses(finished)[8:]


@pytest.mark.faults
def test_a_stop_while_the_ranks_load_exits_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*FAST, "launcher.num_ranks=2", f"run_dir={run_dir}"]
    proc = _start(args, ROOT)
    deadline = time.monotonic() + 120
    while len(ranks := rank_processes(proc.pid)) < 2:  # both started, still importing / loading
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    # As Slurm does (scancel, the time limit, a preemption): TERM to the ranks too. A rank
    # still importing died of it: exit 143, "rank 0 was killed by SIGTERM".
    for rank in ranks:
        rank.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-3000:]  # stopped at the first step boundary, not killed
    assert not (run_dir / "metrics.jsonl").exists() or _losses(run_dir) == []


def _copy_run(finished: Path, run_dir: Path) -> None:
    shutil.copytree(finished, run_dir, ignore=shutil.ignore_patterns("job.lock"))


def test_every_checkpoint_and_the_final_export_list_their_files(finished: Path) -> None:
    from memtune.integrity import check_files, verify_manifest

    ckpt = finished / "checkpoints" / "step-0000012"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"config.yaml", "base.json", "trainer_state.json"} <= manifest.keys()
    assert any(name.startswith("engine/") for name in manifest)
    assert verify_manifest(ckpt) is None
    outputs = json.loads((finished / "summary.json").read_text())["outputs"]
    assert {"adapter/adapter_model.safetensors", "adapter/tokenizer.json"} <= outputs.keys()
    assert check_files(finished, outputs) is None
    assert not list(finished.glob(".tmp-*")) and not list(finished.glob(".old-*"))


@pytest.mark.faults  # a whole job stopped and started again: the fault tier's
def test_a_cut_short_end_is_not_finished_and_is_exported_again(
    finished: Path, tmp_path: Path
) -> None:
    """The disk filled while the tokenizer was written: the next start must not call the run
    finished (generate would fail on the cut file); it exports again from the last step."""
    run_dir = tmp_path / "run"
    _copy_run(finished, run_dir)
    config = (run_dir / "config.yaml").read_text().replace(str(finished), str(run_dir))
    (run_dir / "config.yaml").write_text(config)
    tokenizer = run_dir / "adapter" / "tokenizer.json"
    whole = tokenizer.read_bytes()
    tokenizer.write_bytes(whole[: len(whole) // 3])
    proc = run_train_py([*BASE, f"run_dir={run_dir}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished" not in proc.stdout
    assert f"the run's end did not complete ({tokenizer} has {len(whole) // 3:,} bytes" in (
        proc.stdout
    )
    assert tokenizer.read_bytes() == whole
    a = load_file(finished / "adapter" / "adapter_model.safetensors")
    b = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(run_dir) == _losses(finished)  # no step trained twice
    # Now whole again: the same command calls it finished.
    again = run_train_py([*BASE, f"run_dir={run_dir}"], cwd=ROOT)
    assert "already finished: step-0000012" in again.stdout


def test_a_damaged_newest_checkpoint_is_skipped_before_launch(
    finished: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    _copy_run(finished, run_dir)
    newest = run_dir / "checkpoints" / "step-0000012"
    victim = next((newest / "engine").glob("*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, other bytes
    victim.write_bytes(bytes(data))
    more = [*BASE, f"run_dir={run_dir}", "trainer.max_steps=16", "preprocess_only=true"]
    kept = run_dir / "checkpoints" / "step-0000008" / victim.relative_to(newest)
    proc, reads = _train_py_counting_reads(more, [victim, kept])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: skipping {newest}: damaged ({victim} does not hold the bytes" in proc.stdout
    assert json.loads((run_dir / "resume.json").read_text())["checkpoint"] == str(
        run_dir / "checkpoints" / "step-0000008"
    )
    # A finished run continued with more steps hashes each checkpoint once (its manifest was
    # verified twice: by the finished-run check before the data, and again after it).
    assert reads == [1, 1]

    # Named explicitly, the damaged one is refused before launch, naming the file.
    explicit = run_train_py([*more, f"resume={newest}"], cwd=ROOT)
    assert explicit.returncode == 2
    assert f"resume={newest}: the checkpoint is damaged: {victim}" in explicit.stderr
    assert "Traceback" not in explicit.stderr and "weights_only" not in explicit.stderr


def _train_py_counting_reads(
    args: list[str], paths: list[Path]
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """train.py, and how often its job process opened each of ``paths`` (an audit hook; the
    ranks are processes of their own)."""
    script = (
        "import atexit, runpy, sys\n"
        f"paths = {[str(p) for p in paths]!r}\n"
        "reads = [0] * len(paths)\n"
        "def count(event, args):\n"
        "    if event == 'open' and str(args[0]) in paths:\n"
        "        reads[paths.index(str(args[0]))] += 1\n"
        "sys.addaudithook(count)\n"
        "atexit.register(lambda: print('memtune-test reads:', *reads, file=sys.stderr))\n"
        f"sys.argv = [{str(ROOT / 'train.py')!r}, *sys.argv[1:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("memtune-test reads:")]
    return proc, [int(n) for n in said[-1].split()[2:]] if said else []


@pytest.mark.faults  # a whole job stopped and started again: the fault tier's
def test_resume_knows_the_base_by_content_not_by_path(finished: Path, tmp_path: Path) -> None:
    """The same base moved to a new path resumes; other weights at that path are refused, and
    so are another optimizer or quantization."""
    from safetensors.torch import save_file

    run_dir = tmp_path / "run"
    _copy_run(finished, run_dir)
    base = Path(load_run_config(finished / "config.yaml").model.name_or_path)
    moved = tmp_path / "my-copy-of-the-base"
    shutil.copytree(base, moved)
    local = [*BASE, f"run_dir={run_dir}", "model=local", f"model.name_or_path={moved}"]
    more = [*local, "trainer.max_steps=16", "preprocess_only=true"]
    proc = run_train_py(more, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the base model moved ({base} → {moved})" in proc.stdout
    assert json.loads((run_dir / "resume.json").read_text())["checkpoint"].endswith("step-0000012")

    weights = load_file(moved / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3  # a fine-tune of the base, same names and sizes
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    proc = run_train_py(more, cwd=ROOT)
    assert proc.returncode == 2
    assert f"model: the base at {moved} is not the checkpoint's base ({base}, another path)" in (
        proc.stderr
    )
    proc = run_train_py(
        [*BASE, f"run_dir={run_dir}", "trainer.optimizer=adamw_8bit", "preprocess_only=true"],
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "trainer.optimizer: checkpoint 'adamw', now 'adamw_8bit'" in proc.stderr


@pytest.mark.faults
def test_a_longer_max_steps_on_resume_follows_the_new_schedule_from_the_next_step(
    finished: Path, tmp_path: Path
) -> None:
    """Resumed with trainer.max_steps 12 → 16, every step after the resume runs at the new
    schedule's rate (step 13 ran at the old schedule's floor, step 14 jumped to the new one);
    a weight decay changed with it is said and recorded (rank.checkpoint.follow_schedule)."""
    from memtune.config import to_run_config
    from memtune.rank.loop import lr_factor
    from tests.conftest import compose_cfg

    run_dir = tmp_path / "run"
    _copy_run(finished, run_dir)
    config = (run_dir / "config.yaml").read_text().replace(str(finished), str(run_dir))
    (run_dir / "config.yaml").write_text(config)
    longer = [*BASE, f"run_dir={run_dir}", "trainer.max_steps=16", "trainer.weight_decay=0.05"]
    proc = run_train_py(longer, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.max_steps 12 → 16: the learning-rate schedule is this run's from step 13" in (
        proc.stdout
    )
    assert "trainer.weight_decay 0.0 → 0.05: the optimizer steps with this run's from step 13" in (
        proc.stdout
    )
    assert json.loads((run_dir / "resume.json").read_text())["changed"] == {
        "trainer.max_steps": [12, 16],
        "trainer.weight_decay": [0.0, 0.05],
    }
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    cfg = to_run_config(compose_cfg(longer))
    factor = lr_factor(cfg)
    assert [lrs[s] for s in range(13, 17)] == pytest.approx(
        [cfg.trainer.lr * factor(s - 1) for s in range(13, 17)], rel=1e-6
    )
    before = {
        r["step"]: r["train/lr"]
        for r in (json.loads(x) for x in (finished / "metrics.jsonl").read_text().splitlines())
        if "train/lr" in r
    }
    assert [lrs[s] for s in range(1, 13)] == [before[s] for s in range(1, 13)]


@pytest.mark.faults
def test_a_closed_terminal_stops_the_demo_with_a_checkpoint(tmp_path: Path) -> None:
    """The real thing test_launch's SIGHUP tests stand in for: train.py in a terminal of its
    own (a pty, train.py its session's leader, its ranks writing to it), the terminal closed
    mid-run as an ssh connection drops. The kernel's SIGHUP stops the job with a checkpoint
    (exit 75); the ranks' lines to the closed terminal (EIO) no longer end them first."""
    import pty
    import select

    run_dir = tmp_path / "run"
    args = [*FAST, "launcher.num_ranks=2", "trainer.max_steps=40", "trainer.save_every=0"]
    argv = [sys.executable, str(ROOT / "train.py"), *args, f"run_dir={run_dir}"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, it leads the session
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not nohup's, whatever runs the tests
        os.chdir(ROOT)
        os.execv(sys.executable, argv)
    seen = b""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
            if select.select([fd], [], [], 0.2)[0]:  # as a terminal reads, never blocking here
                with contextlib.suppress(OSError):
                    seen += os.read(fd, 65536)
        os.close(fd)  # the terminal is gone: SIGHUP to its session's leader
        deadline = time.monotonic() + 180
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "train.py did not end after its terminal closed"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(done[1]) == 75, seen.decode(errors="replace")[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert 2 <= stopped_at["step"] < 40
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 75}
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"]
        and str(run_dir) in p.info["cmdline"]
        and "memtune.worker" in p.info["cmdline"]
    ]
