"""Stale torch-extension build locks: a killed builder must not hang every later job."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from memtune.extensions import build_cpu_ops, clear_stale_locks, extensions_root, stale_locks
from tests.conftest import FAST, start_run

HOLD_LOCK = (
    "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
    "print('held', flush=True); time.sleep(600)"
)


def _holder(lock: Path) -> subprocess.Popen:
    """Another process that holds a build lock the way torch's FileBaton does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_only_locks_nobody_holds_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "torch_extensions"
    for name in ("py311_cpu/left_by_kill", "py311_cpu/building", "flat_layout"):
        (root / name).mkdir(parents=True)
    (root / "py311_cpu/left_by_kill/lock").touch()
    (root / "flat_layout/lock").touch()
    holder = _holder(root / "py311_cpu/building/lock")
    try:
        assert stale_locks(root, recheck_s=0.1) == [
            root / "flat_layout/lock",
            root / "py311_cpu/left_by_kill/lock",
        ]
        removed = clear_stale_locks(root, log=lambda _: None, recheck_s=0.1)
        assert len(removed) == 2 and (root / "py311_cpu/building/lock").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The holder was killed while holding it: now it is stale too.
    assert clear_stale_locks(root, log=lambda _: None, recheck_s=0.1) == [
        root / "py311_cpu/building/lock"
    ]
    assert not (root / "py311_cpu/building/lock").exists()


def test_a_job_starts_despite_a_lock_left_by_a_killed_rank(tmp_path: Path, monkeypatch) -> None:
    # A private copy of the built DeepSpeed op with the lock a kill -9 during loading leaves.
    built = [p for p in extensions_root().glob("*/deepspeed_shm_comm") if p.is_dir()]
    if not built:
        build_cpu_ops()
        built = [p for p in extensions_root().glob("*/deepspeed_shm_comm") if p.is_dir()]
    private = tmp_path / "ext"
    shutil.copytree(built[0], private / "deepspeed_shm_comm")
    lock = private / "deepspeed_shm_comm" / "lock"
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(private))
    run = start_run(tmp_path / "run", [*FAST, "trainer.max_steps=2", "launcher.num_ranks=2"])
    assert run.code == 0 and not lock.exists()
    assert [p["rank"] for p in run.probes()] == [0, 1]
