"""Pre-build the DeepSpeed ops a CPU run loads, so the one-off build happens at install time.

DeepSpeed builds some native ops on first use through ``torch.utils.cpp_extension`` (on a CPU
machine its shared-memory all-reduce and CPU Adam). ``python -m memtune.launcher.extensions``
(run by ``make install``) clears stale build locks (see memtune.launcher.hygiene) and builds them
once per machine.

torch keeps one build dir per op and Python version (``py311_cpu/cpu_adam``) whatever the
environment, and a build records the paths of the torch and DeepSpeed it was built against: a
second virtual environment on the machine (another checkout's ``.venv``, a fresh clone) rebuilt
both ops on every switch, ~1 min each on 2 cores, inside whichever job came next (a rank waits
on the build; one suite measured 56 s for a 12 s test). So unless ``TORCH_EXTENSIONS_DIR`` is
set, memtune builds and loads them under a dir of this environment's own, beneath torch's root.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from memtune.launcher.hygiene import clear_stale_locks
from memtune.machine import name_cpu_accelerator


def torch_build_root() -> Path:
    """torch's own JIT build root, ``torch.utils.cpp_extension.get_default_build_root()``
    ($XDG_CACHE_HOME or ~/.cache, then torch_extensions), worked out here because the launcher
    asks before every launch and importing torch for it would cost ~2 s
    (tests/test_leftovers.py holds the two equal)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions")))


def extensions_root() -> Path:
    """Where memtune's processes build and load DeepSpeed's ops: $TORCH_EXTENSIONS_DIR when
    set, else this environment's own dir beneath torch's root (see the module docstring),
    named by the environment's prefix."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    prefix = os.path.realpath(sys.prefix)
    key = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return torch_build_root() / f"env-{key}"


def use_own_ops_dir(log: Callable[[str], None] = print) -> Path:
    """Make this process and its children build and load DeepSpeed's ops in
    :func:`extensions_root` ($TORCH_EXTENSIONS_DIR, unless the user set it), with the build
    locks killed processes left there removed first: torch waits on a lock for as long as the
    file exists, printing nothing, so one left by a kill -9 would stop the next load for good
    (one did: the GPU check's dry run in CI, 600 s on CPU Adam's lock). For what runs DeepSpeed
    in its own process (the GPU check's phases, the tests); the launcher does the same for
    the ranks it starts (memtune.launcher.spawn)."""
    root = extensions_root()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root))
    clear_stale_locks(root, log=log)
    return root


def build_cpu_ops() -> list[str]:
    """Build (or load, if up to date) the DeepSpeed ops a CPU run loads in every rank."""
    from deepspeed.accelerator import get_accelerator

    built = []
    if get_accelerator().device_name() == "cpu":
        # The shm all-reduce every multi-rank CPU run loads; CPU Adam (trainer.optimizer=
        # cpu_adam) only when chosen, but its build takes as long again on first use.
        for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
            builder = get_accelerator().create_op_builder(name)
            if builder is not None:
                builder.load(verbose=False)
                built.append(builder.absolute_name())
    return built


def main() -> None:
    name_cpu_accelerator()
    use_own_ops_dir()
    print("memtune: checking DeepSpeed's native CPU ops (the first build takes ~2 min on 2 cores)")
    for name in build_cpu_ops():
        print(f"memtune: {name} ready in {extensions_root()}")


if __name__ == "__main__":
    main()
