"""The shape of the code the architecture promises (docs/architecture.md): the job and the
ranks meet only in the run dir, the package graph has no circle, and the two entry points read
as short named phases."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

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


def test_the_script_finds_a_circle_when_there_is_one() -> None:
    graph = _graph()
    edges = {("memtune.a", "memtune.b"): ["x"], ("memtune.b", "memtune.a"): ["y"]}
    assert graph.cycles(edges) == [["memtune.a", "memtune.b"]]
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0 and "no cycle, no job -> rank import" in proc.stdout


def test_the_entry_points_are_short_named_phases() -> None:
    for path in ("src/memtune/rank/worker.py", "src/memtune/launcher/job.py"):
        tree = ast.parse((ROOT / path).read_text())
        long = [
            f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60
        ]
        assert long == []
