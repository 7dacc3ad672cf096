"""The README's tables against what they describe: a claim that can drift has a test."""

from __future__ import annotations

import re

import memtune.exit_codes as exit_codes
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def _table_row(first_cell: str) -> str:
    (row,) = [line for line in README.splitlines() if line.startswith(f"| {first_cell} |")]
    return row


def test_the_config_table_lists_every_option_of_every_group() -> None:
    for group in ("model", "data", "peft", "zero", "trainer", "logger", "launcher", "experiment"):
        listed = set(re.findall(r"`([\w.\-]+)`", _table_row(f"`{group}`").split("|")[2]))
        shipped = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert shipped <= listed, f"{group}: {sorted(shipped - listed)} missing from the README"


def test_the_exit_code_table_lists_every_exit_code() -> None:
    codes = {v for k, v in vars(exit_codes).items() if k.startswith("EXIT_")}
    for code in codes:
        assert _table_row(str(code)), code
