"""Refuse an installed torch older than pyproject.toml's floor, before memtune is installed.

    .venv/bin/python scripts/torch_floor.py [PYPROJECT]   # make install runs it: exit 2, one line

``make install`` keeps a torch already in the venv (a GPU box's CUDA build). Below the floor
pip would replace it with PyPI's default build (another CUDA version, gigabytes), and
transformers 5 disables a torch older than 2.6 at import ("Disabling PyTorch"), so memtune
failed later with errors about a missing PyTorch. The floor is read from pyproject.toml, the
one place it is written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torch_floor(pyproject: Path = ROOT / "pyproject.toml") -> tuple[int, int]:
    """pyproject.toml's ``torch>=X.Y`` (no tomllib: Python 3.10 has none)."""
    found = re.search(r'"torch>=(\d+)\.(\d+)', pyproject.read_text())
    if found is None:
        raise SystemExit(f"{pyproject}: no torch>=X.Y among the dependencies")
    return int(found.group(1)), int(found.group(2))


def below(version: str, floor: tuple[int, int]) -> bool:
    """Whether torch ``version`` is below ``floor`` as pip and transformers compare versions
    (PEP 440): a pre-release of the floor (``2.6.0a0+ecf3bae``, a container's build) is below
    it, and transformers disables it too."""
    from pip._vendor.packaging.version import Version  # pip is in every venv make install makes

    return Version(version) < Version(".".join(map(str, floor)))


def main(argv: list[str]) -> int:
    try:
        import torch
    except ImportError:
        return 0  # none yet: make install installs its own
    floor = torch_floor(Path(argv[0])) if argv else torch_floor()
    if not below(torch.__version__, floor):
        return 0
    want = ".".join(map(str, floor))
    print(
        f"memtune: torch {torch.__version__} in {sys.prefix} is older than {want}, which "
        f"memtune needs (transformers 5 disables torch below 2.6): install a torch >= {want} "
        "built for your CUDA first (pytorch.org's selector gives the command), then run make "
        "install again",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
