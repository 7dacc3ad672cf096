"""memtune's package import graph, imports inside functions included: its cycles and the
imports that cross from the job side into the rank side.

    python scripts/import_graph.py          # prints both; exit 1 if there is either

Packages are the nodes (memtune.config, memtune.rank, ...; a top-level module is its own
node). The job side (launcher, config, memory, data) must import nothing from memtune.rank: the
two sides meet in the run dir (memtune.rundir). tests/test_architecture_graph.py keeps it so.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "memtune"
JOB_SIDE = ("memtune.launcher", "memtune.config", "memtune.memory", "memtune.data")
RANK_SIDE = "memtune.rank"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def node(module: str) -> str:
    """The graph node of a module: its package under memtune (memtune.rank.loop →
    memtune.rank), or the module itself at the top level (memtune.rundir)."""
    return ".".join(module.split(".")[:2])


def imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported memtune module, line, inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    functions = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    for n in ast.walk(tree):
        inside = id(n) in functions
        if isinstance(n, ast.Import):
            for alias in n.names:
                if alias.name.startswith("memtune"):
                    yield alias.name, n.lineno, inside
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.rsplit(".", n.level - 1)[0] if n.level > 1 else package
                name = f"{base}.{n.module}" if n.module else base
            else:
                name = n.module or ""
            if name.startswith("memtune"):
                for alias in n.names:  # `from memtune.rank import loop` imports a module
                    sub = f"{name}.{alias.name}"
                    is_module = (SRC.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                    yield (sub if is_module else name), n.lineno, inside


def edges() -> dict[tuple[str, str], list[str]]:
    """(from node, to node) → where ("file:line", "(in a function)" marked)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        here = node(module_name(path))
        for target, line, inside in imports(path):
            there = node(target)
            if there != here:
                where = f"{path.relative_to(SRC.parent)}:{line}"
                where += " (in a function)" if inside else ""
                found.setdefault((here, there), []).append(where)
    return found


def cycles(graph: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Every elementary cycle's node list, found by a depth-first search from each node."""
    succ: dict[str, set[str]] = {}
    for a, b in graph:
        succ.setdefault(a, set()).add(b)
    found: set[tuple[str, ...]] = set()

    def walk(start: str, at: str, path: list[str]) -> None:
        for nxt in sorted(succ.get(at, ())):
            if nxt == start:
                cyc = path[:]
                i = cyc.index(min(cyc))
                found.add(tuple(cyc[i:] + cyc[:i]))
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(succ):
        walk(start, start, [start])
    return [list(c) for c in sorted(found)]


def job_to_rank(graph: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    return {(a, b): w for (a, b), w in graph.items() if a in JOB_SIDE and b == RANK_SIDE}


def main() -> int:
    graph = edges()
    bad = False
    for cyc in cycles(graph):
        bad = True
        print("cycle: " + " -> ".join([*cyc, cyc[0]]))
        for a, b in zip(cyc, [*cyc[1:], cyc[0]], strict=True):
            print(f"  {a} -> {b}: {', '.join(graph[(a, b)])}")
    for (a, b), where in job_to_rank(graph).items():
        bad = True
        print(f"job side imports the rank side: {a} -> {b}: {', '.join(where)}")
    if not bad:
        print(f"memtune import graph: {len(graph)} edges, no cycle, no job -> rank import")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
