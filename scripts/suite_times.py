"""Where `make test`'s time goes, by test file, from a JUnit report of a full run:

    .venv/bin/python -m pytest --junitxml=outputs/suite.xml
    .venv/bin/python scripts/suite_times.py outputs/suite.xml WALL_SECONDS

Prints a markdown table (file, tests, seconds, share of the summed test time) and the wall
time given on the command line; the README's Development section and bench/results/ keep it.
A session fixture's setup (a shared multi-rank run) is counted in the first test that needs it.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    root = ET.parse(Path(argv[0])).getroot()
    wall = float(argv[1]) if len(argv) > 1 else None
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    outcome = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1] or "?"
        seconds[module] += float(case.get("time", 0.0))
        count[module] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"] += 1
        elif case.find("skipped") is not None:
            outcome["skipped"] += 1
        else:
            outcome["passed"] += 1
    total = sum(seconds.values())
    print("| test file | tests | seconds | share |")
    print("|---|---:|---:|---:|")
    for module, secs in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {module} | {count[module]} | {secs:.0f} | {secs / total:.0%} |")
    print(f"| **all** | {sum(count.values())} | {total:.0f} | |")
    summary = ", ".join(f"{n} {k}" for k, n in outcome.items())
    print(f"\n{summary}" + (f"; wall time {wall / 60:.1f} min" if wall else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
