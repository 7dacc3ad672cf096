"""Is the .whl/ set complete for the H200 image? Run by ``bench/gpu_wheels.sh``.

    python3.12 -m venv V && V/bin/pip install --no-index --no-deps .whl/*.whl
    V/bin/python bench/gpu_wheels_check.py /work/.library/device/KINDS.md

Inside a scratch Python 3.12 venv that holds the carried wheels, it stands in for the image:
an empty ``.dist-info`` for every package KINDS.md lists as installed there (at the version
KINDS.md gives, else at an unknown one), except those the wheels replace. Then:

1. ``pip check``: every requirement of every carried wheel is met by a wheel or the image;
2. the requirements with a version bound that only an image package of unknown version meets
   are listed (nothing here can tell whether the image satisfies them);
3. the carried packages that need neither torch nor a GPU are imported on 3.12 (pydantic and
   its compiled core, hjson, omegaconf with antlr4, hydra) and memtune's config for the check
   is composed with them.

Exit status 0 when 1 and 3 pass.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "0+unknown"


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(kinds: Path) -> dict[str, str]:
    """{name: version} of the nvidia-h200 image, from KINDS.md (unknown versions marked)."""
    text = kinds.read_text()
    listed = re.search(r"Packages: (.+?)\.\n", text)
    if not listed:
        raise SystemExit(f"{kinds}: no 'Packages: ...' line")
    names = [n.strip() for n in listed.group(1).split(",")]
    versions = {canon(n): UNKNOWN for n in names}
    pip_row = re.search(r"pip list, as a session saw it \| (.+)", text)
    if pip_row:
        for name, version in re.findall(r"([A-Za-z0-9_.-]+) (\d[\w.+]*)(?=,| \||$)", pip_row[1]):
            if canon(name) in versions:
                versions[canon(name)] = version
    return versions


def write_stubs(image: dict[str, str], carried: set[str]) -> list[str]:
    site = Path(sysconfig.get_paths()["purelib"])
    stubbed = []
    for name, version in image.items():
        if name in carried or name == "pip":  # pip: the venv's own
            continue
        # An unknown version must not fail a bound: stand it in high, and report it below.
        shown = "9999" if version == UNKNOWN else version
        info = site / f"{name.replace('-', '_')}-{shown}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {shown}\nSummary: image stub\n"
        )
        (info / "INSTALLER").write_text("gpu_wheels_check\n")
        stubbed.append(name)
    return stubbed


def unverified(image: dict[str, str], carried: set[str]) -> list[str]:
    from pip._vendor.packaging.requirements import Requirement

    out = []
    for dist in md.distributions():
        name = canon(dist.metadata["Name"])
        if name not in carried:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = canon(req.name)
            if dep not in carried and image.get(dep) == UNKNOWN and str(req.specifier):
                out.append(f"{name} needs {req}: the image's {dep} version is not known here")
    return sorted(set(out))


def imports_and_config() -> None:
    helpers = os.environ.get("GPU_WHEELS_HELPERS")  # pyyaml, packaging: the image's own
    if helpers:
        sys.path.append(helpers)
    import hjson  # noqa: F401
    import hydra
    import omegaconf
    import pydantic
    import pydantic_core

    print(
        f"imports on Python {sys.version.split()[0]}: pydantic {pydantic.VERSION} (core "
        f"{pydantic_core.__version__}), omegaconf {omegaconf.__version__}, hydra "
        f"{hydra.__version__}, hjson"
    )
    sys.path.insert(0, str(ROOT / "src"))
    from memtune.config import compose, to_run_config

    cfg = to_run_config(
        compose(
            [
                "experiment=qwen2.5-7b-4x4090-qlora",
                "model=qwen2.5-7b",
                "launcher.num_ranks=1",
                "logger=none",
            ]
        )
    )
    print(f"memtune config composed: {cfg.experiment}, {cfg.peft.method}, {cfg.model.name_or_path}")


def main() -> int:
    kinds = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/.library/device/KINDS.md")
    carried = {canon(d.metadata["Name"]) for d in md.distributions()} - {"pip", "setuptools"}
    image = image_packages(kinds)
    stubbed = write_stubs(image, carried)
    known = {n: v for n, v in image.items() if v != UNKNOWN}
    print(f"carried: {', '.join(sorted(carried))}")
    print(
        f"image: {len(image)} packages from {kinds.name}, {len(stubbed)} stubbed; versions "
        f"known for {', '.join(f'{n} {v}' for n, v in known.items())}"
    )
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    print(f"pip check: {check.stdout.strip() or check.stderr.strip()}")
    for line in unverified(image, carried):
        print(f"  unverified: {line}")
    imports_and_config()
    return check.returncode


if __name__ == "__main__":
    sys.exit(main())
