"""The shape of the code the architecture promises (docs/architecture.md): the job and the
ranks meet only in the run dir, the import graph has no circle (between packages, nor between
the modules of one package), and the two entry points read as short named phases."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "import_graph.py"


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_and_no_job_to_rank_import() -> None:
    graph = _graph()
    edges = graph.edges()
    assert graph.cycles(edges) == []
    assert graph.job_to_rank(edges) == {}
    # The script sees imports inside functions too: the rank side reaches the run dir.
    assert ("memtune.rank", "memtune.rundir") in edges
    # and the modules inside each package: no circle there either
    modules = graph.module_edges()
    assert graph.cycles(modules) == []
    assert ("memtune.rank.model", "memtune.rank.layers") in modules


def test_the_script_finds_a_circle_when_there_is_one() -> None:
    graph = _graph()
    edges = {("memtune.a", "memtune.b"): ["x"], ("memtune.b", "memtune.a"): ["y"]}
    assert graph.cycles(edges) == [["memtune.a", "memtune.b"]]
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0 and "no cycle, no job -> rank import" in proc.stdout


def test_the_script_finds_a_circle_between_the_modules_of_one_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two modules of one package that import each other, one inside a function: a circle the
    package graph cannot see (both ends are memtune.pkg), named with where each import is."""
    graph = _graph()
    src = tmp_path / "memtune"
    (src / "pkg").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "a.py").write_text("from memtune.pkg.b import g\n\n\ndef f():\n    return g()\n")
    (src / "pkg" / "b.py").write_text("def g():\n    from memtune.pkg import a\n\n    return a\n")
    assert graph.edges(src) == {}
    assert graph.cycles(graph.module_edges(src)) == [["memtune.pkg.a", "memtune.pkg.b"]]
    assert graph.main(src) == 1
    assert capsys.readouterr().out.splitlines() == [
        "cycle: memtune.pkg.a -> memtune.pkg.b -> memtune.pkg.a",
        "  memtune.pkg.a -> memtune.pkg.b: memtune/pkg/a.py:1",
        "  memtune.pkg.b -> memtune.pkg.a: memtune/pkg/b.py:2 (in a function)",
    ]


def test_the_entry_points_are_short_named_phases() -> None:
    for path in ("src/memtune/rank/worker.py", "src/memtune/launcher/job.py"):
        tree = ast.parse((ROOT / path).read_text())
        long = [
            f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60
        ]
        assert long == []
