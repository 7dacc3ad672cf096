"""Leftovers of killed or finished ranks: build locks must not hang later jobs, shared
memory must not pile up until the machine runs out of RAM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memtune.launcher.extensions import build_cpu_ops, extensions_root
from memtune.launcher.hygiene import clear_shm_buffers, clear_stale_locks, shm_buffers, stale_locks
from tests.conftest import FAST, Run, start_run

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


@pytest.mark.faults
def test_a_job_starts_despite_a_lock_left_by_a_killed_rank(tmp_path: Path, monkeypatch) -> None:
    # A private copy of the built DeepSpeed op with the lock a kill -9 during loading leaves.
    # memtune's own dir holds the ops by name (TORCH_EXTENSIONS_DIR's layout); a root the
    # user set without it, torch's py311_cpu/ layout.
    root = extensions_root()

    def built() -> list[Path]:
        found = (root / "deepspeed_shm_comm", *root.glob("*/deepspeed_shm_comm"))
        return [p for p in found if p.is_dir()]

    if not built():
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
        build_cpu_ops()
    private = tmp_path / "ext"
    shutil.copytree(built()[0], private / "deepspeed_shm_comm")
    lock = private / "deepspeed_shm_comm" / "lock"
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(private))
    run = start_run(tmp_path / "run", [*FAST, "trainer.max_steps=2", "launcher.num_ranks=2"])
    assert run.code == 0 and not lock.exists()
    assert [p["rank"] for p in run.probes()] == [0, 1]


MAP_FILE = (
    "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); "
    "f.close(); print('mapped', flush=True); time.sleep(600)"
)


def test_shared_memory_buffers_of_dead_jobs_are_removed(tmp_path: Path) -> None:
    uid = os.getuid()
    names = {
        "finished": f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41000_0",
        "finished_1": f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41000_1",
        "killed": f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_42000_0",
        "live": f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_43000_0",
        "other_user": f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_44000_0",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 4096)
    live = subprocess.Popen(
        [sys.executable, "-c", MAP_FILE, str(tmp_path / names["live"])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "mapped"
        # A finished job removes its own buffers (both ranks), nothing else.
        assert clear_shm_buffers(41000, shm_dir=tmp_path) == 2 * 4096
        assert not (tmp_path / names["finished"]).exists()
        assert (tmp_path / names["killed"]).exists()
        # Before a job: every buffer of ours that no process maps.
        logged: list[str] = []
        assert clear_shm_buffers(shm_dir=tmp_path, log=logged.append) == 4096
        assert sorted(p.name for p in tmp_path.iterdir()) == [names["live"], names["other_user"]]
        assert "1 shared-memory buffer(s)" in logged[0]
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()


def test_a_finished_job_leaves_no_shared_memory(zero3_run: Run) -> None:
    words = (zero3_run.dir / "launch.txt").read_text().split()
    port = int(next(w for w in words if w.startswith("MASTER_PORT="))[len("MASTER_PORT=") :])
    assert shm_buffers(port) == []


def test_the_extensions_root_is_this_environments_dir_beneath_torchs_own(
    tmp_path: Path, monkeypatch
) -> None:
    """The launcher works out torch's JIT build root without importing torch: the same dir.
    memtune's ops go to a dir of this environment beneath it (another venv's builds of the same
    ops would otherwise replace them at every switch), which the ranks are given."""
    from torch.utils.cpp_extension import get_default_build_root

    from memtune.config import to_run_config
    from memtune.launcher.extensions import torch_build_root
    from memtune.launcher.spawn import rank_env
    from tests.conftest import compose_cfg

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    for xdg in (None, str(tmp_path / "xdg")):
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert torch_build_root() == Path(get_default_build_root())
        assert extensions_root().parent == torch_build_root()
    ours = extensions_root()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    other = extensions_root()
    assert other.parent == ours.parent and other != ours
    cfg = to_run_config(compose_cfg(["launcher.num_ranks=2"]))
    assert rank_env(cfg, base={})["TORCH_EXTENSIONS_DIR"] == str(other)
    # A dir the user chose is kept, for the ranks too.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert extensions_root() == tmp_path / "mine"
    assert rank_env(cfg)["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")
    assert rank_env(cfg, base={"TORCH_EXTENSIONS_DIR": "/x"})["TORCH_EXTENSIONS_DIR"] == "/x"


def test_a_process_of_its_own_loads_ops_from_memtunes_dir_without_stale_locks(
    tmp_path: Path, monkeypatch
) -> None:
    """What runs DeepSpeed in its own process (the GPU check's phases, the tests) is pointed
    at memtune's dir, where make install built the ops, and the locks killed processes left
    there are gone before anything loads; a dir the user chose is kept."""
    from memtune.launcher.extensions import use_own_ops_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ours = extensions_root()
    (ours / "cpu_adam").mkdir(parents=True)
    (ours / "cpu_adam/lock").touch()
    said: list[str] = []
    assert use_own_ops_dir(log=said.append) == ours
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(ours)
    assert not (ours / "cpu_adam/lock").exists()
    assert len(said) == 1 and str(ours / "cpu_adam/lock") in said[0]
    mine = tmp_path / "mine"
    (mine / "py311_cpu/cpu_adam").mkdir(parents=True)
    (mine / "py311_cpu/cpu_adam/lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(mine))
    assert use_own_ops_dir(log=said.append) == mine
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(mine)
    assert not (mine / "py311_cpu/cpu_adam/lock").exists()


def test_the_gpu_check_clears_a_stale_lock_before_a_phase(tmp_path: Path) -> None:
    """A CPU Adam lock left by a killed process made CI's dry run of the GPU check wait out
    mixture-qlora-offload's whole 600 s. The orchestrator clears the phases' ops dir before
    each one (here a phase that ends at once: Unsloth is not in memtune's environment)."""
    root = tmp_path / "ext"
    (root / "cpu_adam").mkdir(parents=True)
    (root / "cpu_adam/lock").touch()
    where = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "parts")]
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--phases", "unsloth-lora", *where],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert not (root / "cpu_adam/lock").exists(), out.stdout[-2000:] + out.stderr[-2000:]
    said = out.stdout.splitlines()
    removed = next(i for i, line in enumerate(said) if "removed a stale build lock" in line)
    assert said[removed + 1].startswith("gpu_check: unsloth-lora: starting")
