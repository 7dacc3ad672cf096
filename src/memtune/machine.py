"""What this machine is and what it runs: the CPU, the instruction sets that switch library code
paths, and the versions of the libraries memtune trains with.

    memtune machine                  # one line each; .ci/run and `make test` start with it

The instruction sets matter because libraries pick kernels by them at run time: bitsandbytes
repacks 4-bit weights for an AVX512-BF16 kernel in inference (see
:func:`memtune.rank.model.prepare_quantized`), oneDNN takes AMX or AVX512 paths for bf16 matmuls.
A test result, a benchmark or a plan is only comparable with another from the same line.
Versions come from the installed metadata: nothing here imports torch or the training
libraries, except :func:`name_cpu_accelerator`, which asks torch whether CUDA is there.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import platform
from pathlib import Path

from memtune.paths import SOURCE_ROOT

# The libraries whose versions decide memtune's numbers (losses, memory, speed).
TRACKED = (
    "torch",
    "transformers",
    "peft",
    "deepspeed",
    "bitsandbytes",
    "accelerate",
    "tokenizers",
    "hydra-core",
    "wandb",
)
# The pins `make install` uses, in a source checkout (absent from an installed wheel).
REPO_LOCK = SOURCE_ROOT / "constraints.txt"
# CPU flags (as /proc/cpuinfo spells them) that change which library kernels run.
PATH_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags:
                break  # one processor's entry is enough
    return model, flags


def host_available_gib() -> float:
    """RAM the kernel says a new process can use now (MemAvailable), in GiB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1024**3
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> dict[str, bool]:
    """Each flag of :data:`PATH_FLAGS`: present on this CPU or not."""
    flags = _cpuinfo()[1]
    return {f: f in flags for f in PATH_FLAGS}


def versions() -> dict[str, str]:
    """Installed versions of :data:`TRACKED` (a missing one is left out)."""
    found = {}
    for name in TRACKED:
        with contextlib.suppress(md.PackageNotFoundError):
            found[name] = md.version(name)
    return found


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform reports one (a
    Slurm job's cores on a shared node, ``taskset``), else every core of the machine. What the
    ranks' threads are shared out of; :func:`describe` and :func:`cpu_line` name the machine's
    own count."""
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def describe() -> dict[str, object]:
    """Everything above, for a results file."""
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions(),
    }


def cpu_line() -> str:
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in cpu_flags().items())
    return f"CPU {cpu_model()} ({os.cpu_count()} cores; {flags})"


def versions_line() -> str:
    return ", ".join(f"{k} {v}" for k, v in versions().items())


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch where the answer is known: a
    CPU build of torch (its version ends in ``+cpu``) never has CUDA. The launcher asks before
    any rank starts, and importing torch costs it ~2 s of a 2-core machine's start-up."""
    with contextlib.suppress(md.PackageNotFoundError):
        if md.version("torch").endswith("+cpu"):
            return False
    import torch

    return torch.cuda.is_available()


def name_cpu_accelerator() -> None:
    """On a machine without CUDA, tell DeepSpeed it is the CPU accelerator (``DS_ACCELERATOR``,
    inherited by the launcher and every rank) instead of letting each process detect it and
    warn "If you have GPU or other accelerator, we were unable to detect it" — five times per
    CPU run. A value the user set is kept."""
    if "DS_ACCELERATOR" not in os.environ and not cuda_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def lock_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a pip constraints file, by normalized name; a line with an
    environment marker (``; python_full_version < "3.11.5"``) counts where it holds, as pip
    reads it."""
    from packaging.markers import Marker

    pins = {}
    for line in path.read_text().splitlines():
        spec, _, marker = line.split("#", 1)[0].partition(";")
        name, sep, version = spec.strip().partition("==")
        if sep and (not marker.strip() or Marker(marker.strip()).evaluate()):
            pins[_normalize(name)] = version.strip()
    return pins


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def lock_differences(path: Path) -> list[str]:
    """Installed packages whose version is not the one ``path`` pins ('name X, lock Y')."""
    installed = {
        _normalize(d.metadata["Name"]): d.version
        for d in md.distributions()
        if d.metadata["Name"]  # a broken install can lack it
    }
    return [
        f"{name} {installed[name]}, lock {version}"
        for name, version in sorted(lock_pins(path).items())
        if name in installed and installed[name] != version
    ]


def lock_line(path: Path = REPO_LOCK) -> str | None:
    if not path.is_file():
        return None
    diffs = lock_differences(path)
    if not diffs:
        return f"installed as {path.name} pins"
    return f"{len(diffs)} package(s) differ from {path.name}: " + "; ".join(diffs)


def main(argv: list[str] | None = None) -> None:
    import argparse  # in main: the library functions above need no command line

    from memtune.arguments import VerbParser

    parser = VerbParser(
        prog="memtune machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    print(f"memtune: {cpu_line()}")
    print(f"memtune: Python {platform.python_version()}, {versions_line()}")
    lock = lock_line()
    if lock:
        print(f"memtune: {lock}")


if __name__ == "__main__":
    main()
