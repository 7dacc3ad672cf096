"""memtune's import graph, imports inside functions included: its cycles, between packages and
between the modules of one package, and the imports that cross from the job side into the rank
side.

    python scripts/import_graph.py          # prints them; exit 1 if there is any

Two graphs are walked. Between packages: the nodes are memtune's packages (memtune.config,
memtune.rank, ...; a top-level module is its own node). Inside each package: the nodes are its
modules (memtune.rank.model, memtune.rank.long_context, ...; the package's ``__init__`` is the
package's name), so a circle that two function-level imports hide inside one package is found
too. A circle through modules of several packages is a circle between those packages. The job
side (launcher, config, memory, data) must import nothing from memtune.rank: the two sides meet
in the run dir (memtune.rundir). tests/test_architecture_graph.py keeps it so.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "memtune"
JOB_SIDE = ("memtune.launcher", "memtune.config", "memtune.memory", "memtune.data")
RANK_SIDE = "memtune.rank"

Graph = dict[tuple[str, str], list[str]]
"""(from node, to node) → where each import is ("file:line", "(in a function)" marked)."""


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def node(module: str) -> str:
    """The package graph's node of a module: its package under memtune (memtune.rank.loop →
    memtune.rank), or the module itself at the top level (memtune.rundir)."""
    return ".".join(module.split(".")[:2])


def imports(path: Path, src: Path = SRC) -> Iterator[tuple[str, int, bool]]:
    """(imported memtune module, line, inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path, src)
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
                    is_module = (src.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                    yield (sub if is_module else name), n.lineno, inside


def _walk(src: Path, same_package: bool) -> Graph:
    found: Graph = {}
    for path in sorted(src.rglob("*.py")):
        module = module_name(path, src)
        for target, line, inside in imports(path, src):
            if same_package:
                if node(target) != node(module) or target == module:
                    continue
                a, b = module, target
            else:
                a, b = node(module), node(target)
                if a == b:
                    continue
            where = f"{path.relative_to(src.parent)}:{line}"
            where += " (in a function)" if inside else ""
            found.setdefault((a, b), []).append(where)
    return found


def edges(src: Path = SRC) -> Graph:
    """The package graph: (from package, to package) → where."""
    return _walk(src, same_package=False)


def module_edges(src: Path = SRC) -> Graph:
    """The graph inside each package: (from module, to module of the same package) → where."""
    return _walk(src, same_package=True)


def cycles(graph: Graph) -> list[list[str]]:
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


def job_to_rank(graph: Graph) -> Graph:
    return {(a, b): w for (a, b), w in graph.items() if a in JOB_SIDE and b == RANK_SIDE}


def problems(src: Path = SRC) -> tuple[list[str], str]:
    """The lines that report each cycle (with where its imports are) and each job → rank
    import; and the summary line when there is none."""
    packages, modules = edges(src), module_edges(src)
    lines = []
    for graph in (packages, modules):
        for cyc in cycles(graph):
            lines.append("cycle: " + " -> ".join([*cyc, cyc[0]]))
            for a, b in zip(cyc, [*cyc[1:], cyc[0]], strict=True):
                lines.append(f"  {a} -> {b}: {', '.join(graph[(a, b)])}")
    for (a, b), where in job_to_rank(packages).items():
        lines.append(f"job side imports the rank side: {a} -> {b}: {', '.join(where)}")
    summary = (
        f"memtune import graph: {len(packages)} edges between packages, {len(modules)} inside "
        "them, no cycle, no job -> rank import"
    )
    return lines, summary


def main(src: Path = SRC) -> int:
    lines, summary = problems(src)
    print("\n".join(lines) if lines else summary)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
