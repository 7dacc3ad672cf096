"""Torch JIT-extension builds: clear the locks that killed processes leave, and pre-build ops.

DeepSpeed builds some native ops on first use through ``torch.utils.cpp_extension`` (on a CPU
machine its shared-memory all-reduce, on GPU boxes e.g. ``cpu_adam`` for optimizer offload).
Torch guards each build directory with a ``lock`` file that the builder creates and keeps open
until the build is loaded. A process killed while it holds the lock (kill -9, the OOM killer, a
Ctrl-C during start-up, a preempted job) leaves the file behind, and every later rank that loads
the op waits on it forever, printing nothing. So before any rank starts, the launcher removes
lock files that no live process has open.

``python -m memtune.extensions`` (run by ``make install``) does the same clean-up and then builds
the ops a CPU run needs, so the one-off build happens at install time, not in the first job.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

LOCK_NAME = "lock"
# Torch's holder closes the lock's fd and removes the file microseconds apart; a lock seen
# closed twice this far apart is not in that window.
RECHECK_S = 1.0


def extensions_root() -> Path:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR or its per-user cache."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    """Lock files under root: root/<ext>/lock and root/<py_accel>/<ext>/lock."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})


def open_paths() -> set[str]:
    """Every file some process on this machine has open (that we may look at)."""
    paths: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    paths.add(os.readlink(fd))
    return paths


def stale_locks(root: Path, recheck_s: float = RECHECK_S) -> list[Path]:
    """Lock files that nobody holds open, seen so twice ``recheck_s`` apart."""
    candidates = [p for p in build_locks(root) if str(p.resolve()) not in open_paths()]
    if not candidates:
        return []
    time.sleep(recheck_s)
    held = open_paths()
    return [p for p in candidates if p.exists() and str(p.resolve()) not in held]


def clear_stale_locks(
    root: Path | None = None, log: Callable[[str], None] = print, recheck_s: float = RECHECK_S
) -> list[Path]:
    """Remove stale build locks (see the module docstring); returns the removed paths."""
    removed = []
    for lock in stale_locks(root or extensions_root(), recheck_s):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            removed.append(lock)
            log(
                f"memtune: removed a stale build lock left by a killed process: {lock} "
                "(without this, every rank would wait on it forever)"
            )
    return removed


def build_cpu_ops() -> list[str]:
    """Build (or load, if up to date) the DeepSpeed ops a CPU run loads in every rank."""
    from deepspeed.accelerator import get_accelerator

    built = []
    if get_accelerator().device_name() == "cpu":
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            builder.load(verbose=False)
            built.append(builder.absolute_name())
    return built


def main() -> None:
    clear_stale_locks()
    print("memtune: checking DeepSpeed's native CPU ops (the first build takes ~1 min on 2 cores)")
    for name in build_cpu_ops():
        print(f"memtune: {name} ready in {extensions_root()}")


if __name__ == "__main__":
    main()
