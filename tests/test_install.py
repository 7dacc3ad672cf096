"""The lock (constraints.txt), the README's tested versions and what is installed agree."""

from __future__ import annotations

import re

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
    for line in REPO_LOCK.read_text().splitlines():
        assert line.startswith("#") or re.fullmatch(r"[\w.-]+==[\w.+-]+", line), line


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
