"""The GPU check's Unsloth phases, what can be checked without a GPU (bench/gpu_check/unsloth.py,
bench/unsloth_imports.py, bench/gpu_wheels_unsloth.sh): the import graph's reading of source,
the carried set against it (when .whl-unsloth/ was built here), the cannot-run record and the
comparison table. The phases themselves run in .ci/run's dry run (Unsloth not installed there:
the cannot-run path)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

KINDS = Path("/work/.library/device/KINDS.md")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))
    from bench import unsloth_imports
    from bench.gpu_check import phases, unsloth, unsloth_report

    return unsloth_imports, phases, unsloth, unsloth_report


def write(site: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_import_graph_reads_branches_tries_and_functions(bench, tmp_path: Path) -> None:
    """What runs at import on the H200 is required; a try's (and its except's) imports are
    tried; the Apple-MLX and Windows branches are not taken; function bodies are listed apart;
    a module the graph reaches that is not installed is missing."""
    imports = bench[0]
    write(
        tmp_path,
        {
            "unsloth/__init__.py": """
                import os, platform
                from ._gpu import *
                import torch
                _IS_MLX = False
                if _IS_MLX:
                    import mlx
                    from unsloth_zoo.mlx import trainer
                if platform.system() == "Darwin":
                    import coremltools
                else:
                    import triton
                try:
                    import xformers
                except ImportError:
                    import xformers_fallback
                def later():
                    import vllm
                    from .never import x
                if os.environ.get("X"):
                    import undecided
            """,
            "unsloth/_gpu.py": """
                from .models import loader
                from unsloth_zoo import zoo_util
                import importlib
                importlib.import_module("datasets")
            """,
            "unsloth/models/__init__.py": "",
            "unsloth/models/loader.py": "from ..kernels import fast\n",
            "unsloth_zoo/__init__.py": "import trl\n",
            "unsloth_zoo/zoo_util.py": "",
            "unsloth_zoo/mlx/__init__.py": "",
            "trl/__init__.py": "import jinja2\n",
        },
    )
    files = imports.module_files(tmp_path)
    graph = imports.walk(files, ["unsloth"])
    assert graph.modules == {
        "unsloth",
        "unsloth._gpu",
        "unsloth.models",
        "unsloth.models.loader",
        "unsloth_zoo",
        "unsloth_zoo.zoo_util",
        "trl",
    }
    assert set(graph.required) == {
        "os",
        "platform",
        "torch",
        "triton",
        "importlib",
        "datasets",
        "jinja2",
    }
    assert set(graph.tried) == {"xformers", "xformers_fallback", "undecided"}
    assert set(graph.in_functions) == {"vllm"}
    assert graph.missing == {"unsloth.kernels": ["unsloth.models.loader:1"]}
    # mlx, unsloth_zoo.mlx.trainer and coremltools: branches not taken on the H200
    assert "mlx" not in graph.required and "coremltools" not in {**graph.required, **graph.tried}


@pytest.mark.skipif(
    not list((ROOT / ".whl-unsloth").glob("unsloth-*.whl")),
    reason="no .whl-unsloth/ (bash bench/gpu_wheels_unsloth.sh builds it, not make test)",
)
def test_the_carried_unsloth_has_every_module_its_phases_import(bench, tmp_path: Path) -> None:
    """.whl-unsloth/ installed as the device installs it (pip --target, no index): the repack
    dropped no module Unsloth imports, and every package imported outside a try is carried or
    the image's (KINDS.md, where this machine has it)."""
    imports = bench[0]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--target", str(tmp_path), "--python-version", "3.12", "--implementation", "cp",
         "--only-binary=:all:", "--platform", "manylinux_2_24_x86_64",
         *map(str, sorted((ROOT / ".whl-unsloth").glob("*.whl")))],
        check=True,
    )  # fmt: skip
    assert not (tmp_path / "studio").exists() and not (tmp_path / "unsloth_cli").exists()
    result = imports.check(tmp_path, KINDS if KINDS.is_file() else None)
    assert result["missing_modules"] == {} and result["unmet"] == {}, result
    assert result["ok"]
    reached = set(result["carried_reached"])
    assert {"unsloth", "unsloth_zoo", "trl", "datasets", "dill", "multiprocess"} <= reached
    req = result["required"]
    if result["image_checked"]:
        assert req["transformers"] == req["torch"] == req["triton"] == "image"
        assert "xformers" in result["tried_absent"] and "flash_attn" in result["tried_absent"]
    assert result["modules"] > 300  # unsloth, unsloth_zoo, trl, datasets ... as imported


def test_cannot_run_records_the_exact_error_and_the_table_shows_it(bench, tmp_path: Path) -> None:
    """Unsloth that cannot import: a record per length with the exception's type, message and
    last frame, the error in full in the phase; the comparison table puts Unsloth's row beside
    the recipe's, memtune's and memtune's at Unsloth's card, with the ratios."""
    _, _, unsloth, report = bench
    from bench.gpu_check.modes import DRY, GPU
    from bench.gpu_check.recorder import Phase

    phase = Phase(GPU, "unsloth-lora", "lora", "unsloth", tmp_path / "f.json", tmp_path / "out")
    try:
        raise NotImplementedError("Unsloth cannot find any torch accelerator? You need a GPU.")
    except NotImplementedError as err:
        unsloth.cannot_run(phase, "import unsloth", err, [4096, 2048])
    recs = phase.data["records"]
    assert [r["seq_len"] for r in recs] == [4096, 2048]
    assert recs[0]["error"].startswith(
        "cannot run (import unsloth): NotImplementedError: Unsloth cannot find any torch"
    )
    bad = phase.data["unsloth"]["cannot_run"]
    assert bad["type"] == "NotImplementedError" and bad["frames"][-1].startswith("test_gpu_unsloth")
    assert phase.data["errors"][0]["where"] == "import unsloth"  # on the GPU: an error

    def rec(side: str, tps: float, gib: float) -> dict:
        return {"side": side, "method": "lora", "seq_len": 4096, "tokens_per_s": tps,
                "measured_gib": gib, "device_used_gib": gib + 1}  # fmt: skip

    records = [
        rec("unsloth", 8000.0, 16.0),
        rec("memtune", 8800.0, 19.0),
        rec("baseline", 7000.0, 22.0),
        rec("memtune-at-unsloth", 8400.0, 15.5),
    ]
    (row,) = report.compare_unsloth(records)
    assert row["memtune_speed"] == pytest.approx(1.1) and row["at_peak_speed"] == pytest.approx(
        1.05
    )
    assert row["at_peak_memory"] == pytest.approx(15.5 / 16.0)
    text = "\n".join(report.unsloth_markdown({"comparison": [row], "methods": {}}))
    assert "| lora | 4096 | 7,000 | 8,800 | 8,000 | 1.10× | 16.00 (17.00) | 8,400 " in text
    # the dry run: cannot run is expected there, a note, not an error
    dry = Phase(DRY, "unsloth-qlora", "qlora", "unsloth", tmp_path / "g.json", tmp_path / "out")
    unsloth.cannot_run(
        dry, "import unsloth", ModuleNotFoundError("No module named 'unsloth'"), [64]
    )
    assert dry.data["errors"] == [] and "dry run: cannot run" in dry.data["notes"][0]


def test_the_unsloth_phases_run_in_their_own_call(bench) -> None:
    """A group: not in the main call's default selection; named by --phases unsloth (in
    priority order), or by its phases' names; in the dry run's."""
    phases = bench[1]
    group = [
        "unsloth-model",
        "unsloth-lora",
        "unsloth-qlora",
        "lora-at-unsloth",
        "qlora-at-unsloth",
    ]
    assert not {p.name for p in phases.select(None)} & set(group)
    assert [p.name for p in phases.select("unsloth")] == group
    assert [p.name for p in phases.select(None, ("unsloth",))][-5:] == group
    assert [p.name for p in phases.select("lora-memtune,unsloth-lora")] == [
        "lora-memtune",
        "unsloth-lora",
    ]


def test_memtunes_row_runs_capped_and_out_of_memory_there_is_its_result(bench, tmp_path) -> None:
    """Like for like with Unsloth's rows: memtune's row runs inside ``capped_row`` (the cap
    helper Unsloth's phase uses too) and records the card it was capped at; out of memory
    under the cap is the row's result, the phase goes on; the report shows the row's cap."""
    import torch

    from bench.gpu_check import memtune_runner, unsloth
    from bench.gpu_check.modes import CAP_GIB, GPU
    from bench.gpu_check.recorder import Phase

    assert memtune_runner.cap_allocator is unsloth.cap_allocator  # one place for the cap
    out = tmp_path / "out"
    phase = Phase(GPU, "lora-memtune", "lora", "memtune", tmp_path / "lora-memtune.json", out)
    cpu = torch.device("cpu")
    rows = []
    for seq_len, fits in ((4096, True), (8192, False)):
        rec = {"side": "memtune", "method": "lora", "seq_len": seq_len, "plan": {"fits": fits}}
        with memtune_runner.capped_row(phase, cpu, CAP_GIB, rec):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        phase.add(rec)
        rows.append(rec)
    rec = {"side": "memtune", "method": "lora", "seq_len": 2048, "plan": {"fits": True}}
    with memtune_runner.capped_row(phase, cpu, CAP_GIB, rec):
        rec.update(tokens_per_s=6059.0, losses=[12.0, 11.9])
    phase.add(rec)
    first, planned_out = rows
    assert first["cap_gib"] == 23.99 and first["oom"] and "CUDA out of memory" in first["error"]
    assert planned_out["as_planned"] and planned_out["cap_gib"] == 23.99  # the plan said so
    assert [e["where"] for e in phase.data["errors"]] == ["memtune 4096"]  # only the unforeseen
    assert rec["cap_gib"] == 23.99 and "error" not in rec
    text = (out / "gpu_check.md").read_text()
    assert "| lora | 2048 | memtune | 6,059 | — | — | — | 23.99 | — |" in text
    assert "| lora | 4096 | memtune | — | — | — | — | 23.99 | — |" in text
    assert "OutOfMemoryError('CUDA out of memory." in text


def test_the_recipes_rows_run_uncapped_and_say_whether_they_fit_the_card(bench, tmp_path) -> None:
    """The recipe's rows of the H200 run (2026-12-04) through the accounting its runner does
    (``add_plan_error``): its LoRA 4,096 row had 25.53 GiB of the card in use at its peak,
    over a 24 GB card, and says so in the record, the table and the comparison; its other
    rows fit. Unsloth's table marks it too."""
    import json

    from bench.gpu_check.measure import add_plan_error
    from bench.gpu_check.modes import GPU
    from bench.gpu_check.report import collect, markdown

    results = json.loads((ROOT / "bench" / "results" / "2026-12-04-h200.json").read_text())
    derived = ("measured_gib", "device_used_gib", "plan_error_pct", "plan_total_error_pct")
    frags = {}
    for r in results["records"]:
        if r["method"] != "lora" or r["seq_len"] not in (4096, 2048):
            continue
        rec = {k: v for k, v in r.items() if k not in derived}
        if r["side"] == "baseline":
            rec["cap_gib"] = None  # as baseline_runner writes it now
        add_plan_error(rec)
        frags.setdefault(r["side"], []).append(rec)
    for side, recs in frags.items():
        frag = {"phase": f"lora-{side}", "method": "lora", "side": side, "records": recs}
        frag.update(search=[], errors=[], notes=[])
        (tmp_path / f"lora-{side}.json").write_text(json.dumps(frag))
    result = collect(GPU, tmp_path)
    fits = {(r["side"], r["seq_len"]): r["fits_cap"] for r in result["records"]}
    assert fits == {
        ("baseline", 4096): False,
        ("baseline", 2048): True,
        ("memtune", 4096): True,
        ("memtune", 2048): True,
    }
    text = markdown(result)
    over = "none — **over 24 GB: would not fit a 4090**"
    assert f"| lora | 4096 | baseline | 7,325 | 0.559 | 22.52 | 25.53 | {over} | 22.69 |" in text
    assert "| lora | 2048 | baseline | 6,793 | 0.301 | 18.63 | 20.46 | none | 18.80 |" in text
    assert "| lora | 4096 | 1.10× | 0.86× | **no** (25.53 GiB: over 24 GB: would not fit" in text
    assert "| lora | 2048 | 0.89× | 1.07× | yes |" in text
    # memtune's rows of that run recorded no cap (they ran uncapped then): "—", not a cap
    assert "| lora | 4096 | memtune | 8,085 | 0.507 | 19.31 | 21.36 | — |" in text
    _, _, _, report = bench
    by = {r["side"]: r for r in result["records"] if r["seq_len"] == 4096}
    made_up = {**by["baseline"], "side": "unsloth", "tokens_per_s": 8000.0, "cap_gib": 23.99}
    (row,) = report.compare_unsloth([by["baseline"], by["memtune"], made_up])
    table = "\n".join(report.unsloth_markdown({"comparison": [row], "methods": {}}))
    assert (
        "| lora | 4096 | 7,325 (**over 24 GB: would not fit a 4090**: 25.53 GiB) | 8,085 " in table
    )
