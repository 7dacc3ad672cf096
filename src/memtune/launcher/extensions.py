"""Pre-build the DeepSpeed ops a CPU run loads, so the one-off build happens at install time.

DeepSpeed builds some native ops on first use through ``torch.utils.cpp_extension`` (on a CPU
machine its shared-memory all-reduce and CPU Adam). ``python -m memtune.launcher.extensions``
(run by ``make install``) clears stale build locks (see memtune.launcher.hygiene) and builds them
once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from memtune.launcher.hygiene import clear_stale_locks
from memtune.machine import name_cpu_accelerator


def extensions_root() -> Path:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR or its per-user cache —
    ``torch.utils.cpp_extension.get_default_build_root()`` ($XDG_CACHE_HOME or ~/.cache, then
    torch_extensions), worked out here because the launcher asks before every launch and
    importing torch for it would cost ~2 s (tests/test_leftovers.py holds the two equal)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions")))


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
    clear_stale_locks(extensions_root())
    print("memtune: checking DeepSpeed's native CPU ops (the first build takes ~2 min on 2 cores)")
    for name in build_cpu_ops():
        print(f"memtune: {name} ready in {extensions_root()}")


if __name__ == "__main__":
    main()
