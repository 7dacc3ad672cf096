"""Write ``constraints.txt``: the exact versions installed in a venv, as pip constraints.

    python scripts/write_lock.py VENV [OUT]        # `make relock` runs it

Everything ``pip freeze --all`` lists is pinned except memtune itself and torch: the CPU build
of torch comes from ``TORCH_SPEC`` in the Makefile, and a GPU box keeps its own CUDA build (so
CUDA's own wheels, nvidia-* and triton, are left out too). Why constraints and not a lock file
of another tool: ``make install`` runs pip, the only installer that takes the CPU torch on our
machines' disk; constraints pin what pip resolves without making pip install anything extra.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SKIP = re.compile(r"^(memtune|torch|triton|nvidia-[\w-]+|cuda-[\w-]+)==", re.IGNORECASE)
OLDER_PYTHONS = {
    # package: (the first Python version its pinned release needs, the pin below that), for
    # pins whose release leaves out Pythons that pyproject.toml admits: Debian 12's CPython
    # 3.11.2, which a fresh machine's python3 can be, is below pymdown-extensions 13's 3.11.5.
    "pymdown-extensions": ("3.11.5", "12.3"),
}


def requirements_hash(pyproject: Path) -> str:
    """A digest of what pyproject.toml asks for (dependencies and extras): the lock records the
    one it was resolved from, and tests/test_install.py fails when they no longer agree."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = {"dependencies": project["dependencies"], "extras": project["optional-dependencies"]}
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]


def pins(venv: Path) -> list[str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = [line.strip() for line in out.splitlines()]
    kept = sorted((x for x in lines if "==" in x and not SKIP.match(x)), key=str.lower)
    out = []
    for line in kept:
        name = line.split("==")[0].lower()
        if name in OLDER_PYTHONS:
            floor, older = OLDER_PYTHONS[name]
            out.append(f'{line}; python_full_version >= "{floor}"')
            out.append(f'{name}=={older}; python_full_version < "{floor}"')
        else:
            out.append(line)
    return out


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python scripts/write_lock.py VENV [OUT]")
    venv = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) == 3 else Path("constraints.txt")
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    header = [
        "# The exact versions `make test` passed with: pip constraints, used by `make install`.",
        "# Written by `make relock` (scripts/write_lock.py): edit pyproject.toml's ranges instead.",
        f"# Resolved {dt.date.today().isoformat()} on CPython {version}, "
        f"{platform.system()} {platform.machine()}.",
        "# torch is not here: the Makefile's TORCH_SPEC (CPU) or your own CUDA build.",
        f"# pyproject.toml requirements: {requirements_hash(PYPROJECT)}",
    ]
    pinned = pins(venv)
    out.write_text("\n".join([*header, *pinned]) + "\n")
    print(f"memtune: {out} written ({len(pinned)} pins)")


if __name__ == "__main__":
    main()
