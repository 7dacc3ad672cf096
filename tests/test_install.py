"""The lock (constraints.txt), the README's tested versions and what is installed agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from memtune.machine import REPO_LOCK, lock_differences, lock_pins
from tests.conftest import ROOT


def _readme_table() -> dict[str, str]:
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("## Tested versions and the lock", 1)[1].split("\n#", 1)[0]
    return dict(re.findall(r"^\| ([a-z][\w-]*) \| ([\d.]+)[^|]*\|$", section, re.MULTILINE))


def test_the_lock_pins_everything_but_torch_and_memtune() -> None:
    pins = lock_pins(REPO_LOCK)
    assert len(pins) > 50 and "torch" not in pins and "memtune" not in pins
    assert not any(name.startswith("nvidia-") or name == "triton" for name in pins)
    marker = r'(; python_full_version [<>]=? "[\d.]+")?'  # scripts/write_lock.py OLDER_PYTHONS
    for line in REPO_LOCK.read_text().splitlines():
        assert line.startswith("#") or re.fullmatch(r"[\w.-]+==[\w.+-]+" + marker, line), line


def test_a_pin_split_by_python_version_resolves_on_debians_python(tmp_path) -> None:
    """A fresh Debian 12 machine's python3 is CPython 3.11.2, below what some pinned releases
    need (pymdown-extensions 13 asks for 3.11.5): the lock gives such a pin a marker and an
    older release for those Pythons, and lock_pins reads the one that holds."""
    from packaging.markers import Marker

    lines = [x for x in REPO_LOCK.read_text().splitlines() if "python_full_version" in x]
    assert any(x.startswith("pymdown-extensions==") for x in lines), lines
    for line in lines:
        name = line.split("==")[0]
        holds = Marker(line.split(";", 1)[1].strip()).evaluate()
        assert (lock_pins(REPO_LOCK)[name] == line.split("==")[1].split(";")[0]) == holds
        old = Marker(line.split(";", 1)[1].strip()).evaluate({"python_full_version": "3.11.2"})
        new = Marker(line.split(";", 1)[1].strip()).evaluate({"python_full_version": "3.12.0"})
        assert old != new, line  # each pair covers every version once


def test_the_readme_lists_the_locked_versions() -> None:
    table = _readme_table()
    assert {"transformers", "peft", "deepspeed", "bitsandbytes", "torch"} <= table.keys()
    torch_spec = re.search(
        r"^TORCH_SPEC \?= torch==([\d.]+)$", (ROOT / "Makefile").read_text(), re.M
    )
    assert torch_spec and table.pop("torch") == torch_spec.group(1)
    pins = lock_pins(REPO_LOCK)
    assert {name: pins.get(name) for name in table} == table


def test_lock_differences_name_the_package_and_both_versions(tmp_path) -> None:
    import importlib.metadata as md

    lock = tmp_path / "constraints.txt"
    lock.write_text(f"# header\nPyYAML==0.0.1\npeft=={md.version('peft')}\n")
    assert lock_differences(lock) == [f"pyyaml {md.version('pyyaml')}, lock 0.0.1"]


def test_the_lock_was_resolved_from_this_pyproject() -> None:
    """pyproject.toml's requirements changed without `make relock`: the lock is stale."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_lock", ROOT / "scripts" / "write_lock.py")
    assert spec is not None and spec.loader is not None
    write_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_lock)
    recorded = re.search(r"^# pyproject.toml requirements: (\w+)$", REPO_LOCK.read_text(), re.M)
    assert recorded, "constraints.txt has no requirements line: run make relock"
    assert recorded.group(1) == write_lock.requirements_hash(ROOT / "pyproject.toml")


def test_every_target_the_help_gives_exp_runs_that_experiment() -> None:
    """make help says which targets take EXP=: each passes it to train.py or memtune (make
    preprocess once tokenized the CPU demo's way whatever EXP said)."""
    import subprocess

    help_text = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    named = re.search(r"EXP=<experiment> \(([^)]*)\)", help_text)
    assert named is not None, help_text
    targets = [t.strip() for t in named.group(1).split(",")]
    assert {"train", "preprocess", "plan"} <= set(targets)
    for target in targets:  # under make test, as a sub-make: no directory lines
        dry = subprocess.run(
            ["make", "--no-print-directory", "-n", target, "EXP=qwen3-8b-4x4090-lora"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        lines = [line for line in dry.stdout.splitlines() if not line.startswith("#")]
        runs = [line for line in lines if "train.py" in line or " plan " in line]
        assert runs and all("experiment=qwen3-8b-4x4090-lora" in r for r in runs), (target, dry)


def test_an_installed_torch_below_the_floor_is_refused_before_memtune_installs(
    tmp_path: Path,
) -> None:
    """make install keeps a torch already in .venv (a GPU box's CUDA build); one older than
    pyproject.toml's floor (2.6: transformers 5 disables torch below it) is refused in one line
    (scripts/torch_floor.py, the first thing make install runs), naming the version found. Run
    with this venv's real torch against pyproject's floor, then against a floor above it."""
    import re

    import torch

    script = ROOT / "scripts" / "torch_floor.py"
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert re.search(r'"torch>=2\.6"', (ROOT / "pyproject.toml").read_text())
    higher = tmp_path / "pyproject.toml"
    higher.write_text('dependencies = [\n    "torch>=99.1",\n]\n')
    old = subprocess.run([sys.executable, str(script), str(higher)], capture_output=True, text=True)
    assert old.returncode == 2
    assert old.stderr.startswith(f"memtune: torch {torch.__version__} in {sys.prefix} is older ")
    assert "than 99.1, which memtune needs" in old.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from torch_floor import below
    finally:
        sys.path.pop(0)
    # as pip and transformers compare: a container's pre-release of 2.6 is below 2.6
    assert below("2.6.0a0+ecf3bae40a", (2, 6)) and below("2.5.1+cu124", (2, 6))
    assert not below("2.6.0", (2, 6)) and not below("2.13.0+cpu", (2, 6))
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.index("scripts/torch_floor.py") < makefile.index('"$(TORCH_SPEC)"')
