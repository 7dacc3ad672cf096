"""What Unsloth imports, read from its source: the static import graph of the carried Unsloth.

    python bench/unsloth_imports.py SITE [--kinds KINDS.md]     # SITE: the wheels installed
    PYTHONPATH=SITE python bench/unsloth_imports.py --import-on-cpu   # and the image's versions

The GPU check's Unsloth phases (``bench/gpu_check/unsloth.py``) run Unsloth from the wheels in
``.whl-unsloth/`` (``bench/gpu_wheels_unsloth.sh``) on the lent H200's image, which has no
network. Unsloth refuses to import without CUDA, so nothing here can import it; this reads its
source instead. From the modules the phases reach (:data:`ENTRIES`: ``import unsloth``, which
``from unsloth import FastLanguageModel`` is part of, and the modules its loading, LoRA,
gradient checkpointing and loss run), it follows every ``import`` executed when a module is
imported (module level and class bodies, not function bodies) through ``unsloth`` and
``unsloth_zoo``, and sorts what they import from elsewhere:

* **required**: imported outside any ``try`` (and outside an ``if`` this file cannot decide):
  must be installed, from the carried wheels, the image or the standard library;
* **tried**: imported inside a ``try`` (or its ``except``) or an undecided ``if``: Unsloth goes
  on without it (xformers, flash_attn, vllm, cut_cross_entropy ...); the result says which are
  absent;
* **in functions**: imported only inside function bodies of those modules: needed only if that
  function runs (listed, not required).

``if`` tests are decided where they only read the platform or Unsloth's own backend flags
(:data:`LINUX_CUDA`): the Apple-MLX, Windows and CPU-backend branches are not taken on the
H200, so what only they import (``mlx``, ``unsloth_zoo.mlx.trainer``) is not required.

Every internal module the graph reaches must exist in ``SITE`` (so the repack that dropped
``studio/`` and ``unsloth_cli/`` dropped nothing Unsloth imports), and every required external
package must be found. The check stops where the source does: a function called at import time
can import more (those imports are listed under "in functions"), and Unsloth's CUDA check itself
runs only on the device.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ENTRIES = (
    "unsloth",  # import unsloth (its _gpu_init holds `from .models import *`: FastLanguageModel)
    "unsloth.models.loader",  # FastLanguageModel.from_pretrained
    "unsloth.models.llama",  # FastLlamaModel: get_peft_model, the fast forward, the loss
    "unsloth.models.qwen2",  # FastQwen2Model (Qwen2.5 is model_type qwen2)
    "unsloth.kernels",  # the Triton kernels: LoRA MLP/QKV/O, RMSNorm, RoPE, SwiGLU, CE
    "unsloth_zoo.gradient_checkpointing",  # use_gradient_checkpointing="unsloth"
    "unsloth_zoo.loss_utils",  # unsloth_fused_ce_loss
    "unsloth_zoo.peft_utils",
    "unsloth_zoo.patching_utils",
    "unsloth_zoo.training_utils",
    "trl.trainer.sft_trainer",  # what Unsloth patches at import (PatchFastRL), users train with
)
"""The modules the Unsloth phases import or run (the path of bench/gpu_check/unsloth.py)."""


class _Platform:
    @staticmethod
    def system() -> str:
        return "Linux"

    @staticmethod
    def machine() -> str:
        return "x86_64"


LINUX_CUDA = {
    "_IS_MLX": False,
    "_is_mlx_only": False,
    "_SKIP_GPU_INIT": False,
    "_IS_CPU_BACKEND": False,
    "platform": _Platform,
    "sys": type("sys", (), {"platform": "linux"}),
    "os": type("os", (), {"name": "posix"}),
}
"""The names an ``if`` test may read to be decided: the lent H200 (Linux, x86-64, CUDA)."""

IMAGE_IMPORT_NAMES = {
    "pyyaml": "yaml",
    "pillow": "PIL",
    "protobuf": "google",
    "python-dateutil": "dateutil",
    "huggingface-hub": "huggingface_hub",
    "opencv-python-headless": "cv2",
    "scikit-learn": "sklearn",
    "scikit-image": "skimage",
    "nvidia-ml-py": "pynvml",
    "py-cpuinfo": "cpuinfo",
    "pytorch-lightning": "pytorch_lightning",
    "sentence-transformers": "sentence_transformers",
    "cupy-cuda13x": "cupy",
    "typing-extensions": "typing_extensions",
    "tensorboard-data-server": "tensorboard_data_server",
}
"""Import names of the image's distributions where they are not the name with ``_`` for ``-``."""


@dataclass(frozen=True)
class Import:
    name: str  # absolute dotted module name
    where: str  # "module" (runs at import) or "function"
    guarded: bool  # inside a try, or an if this file cannot decide
    line: int


@dataclass
class Graph:
    modules: set[str] = field(default_factory=set)  # internal modules reached at import
    missing: dict[str, list[str]] = field(default_factory=dict)  # internal, absent: by whom
    required: dict[str, list[str]] = field(default_factory=dict)  # external top-level: by whom
    tried: dict[str, list[str]] = field(default_factory=dict)
    in_functions: dict[str, list[str]] = field(default_factory=dict)


def module_files(site: Path) -> dict[str, Path]:
    """{dotted module name: file} for every Python module under ``site`` (sources, and
    extensions, which are leaves)."""
    files = {}
    for path in [*site.rglob("*.py"), *site.rglob("*.so")]:
        rel = path.relative_to(site)
        if any(
            p.endswith((".dist-info", ".data")) or p in ("bin", "__pycache__") for p in rel.parts
        ):
            continue
        parts = [*rel.parts[:-1], rel.name.split(".")[0]]
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            files.setdefault(".".join(parts), path)
    return files


def decide(test: ast.expr) -> bool | None:
    """The value of an ``if`` test on the H200, or None when it reads anything else."""
    try:
        code = compile(ast.Expression(test), "<if>", "eval")
        return bool(eval(code, {"__builtins__": {}}, dict(LINUX_CUDA)))
    except Exception:
        return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, files: dict[str, Path]):
        self.module, self.is_package, self.files = module, is_package, files
        self.found: list[Import] = []
        self.depth = self.guard = 0

    def _add(self, name: str, line: int) -> None:
        where = "function" if self.depth else "module"
        self.found.append(Import(name, where, self.guard > 0, line))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Try(self, node: ast.Try) -> None:
        self.guard += 1  # the body, and the handlers: the fallback when it failed
        for other in [*node.body, *node.handlers]:
            self.visit(other)
        self.guard -= 1
        for stmt in [*node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        value = decide(node.test)
        if value is None:
            self.guard += 1
        for stmt in (node.body if value is not False else []) + (
            node.orelse if value is not True else []
        ):
            self.visit(stmt)
        if value is None:
            self.guard -= 1

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        self._add(target, node.lineno)
        for alias in node.names:  # `from pkg import submodule` imports the submodule
            if f"{target}.{alias.name}" in self.files:
                self._add(f"{target}.{alias.name}", node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        """``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0] if node.args else None
        literal = first.value if isinstance(first, ast.Constant) else None
        relative = isinstance(literal, str) and literal.startswith(".")
        if name in ("import_module", "__import__") and isinstance(literal, str) and not relative:
            self._add(literal, node.lineno)
        self.generic_visit(node)


def imports_of(module: str, files: dict[str, Path]) -> list[Import]:
    path = files[module]
    if path.suffix != ".py":
        return []
    visitor = _Visitor(module, path.name == "__init__.py", files)
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return visitor.found


def walk(files: dict[str, Path], entries: Iterable[str] = ENTRIES) -> Graph:
    """The graph from ``entries``: the modules under the site their import runs (followed into
    every package installed there: unsloth, unsloth_zoo, trl, datasets ...), and what they
    import from elsewhere."""
    installed = {name.split(".")[0] for name in files}
    graph = Graph()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in graph.modules or module not in files:
            continue
        graph.modules.add(module)
        for imp in imports_of(module, files):
            top = imp.name.split(".")[0]
            by = f"{module}:{imp.line}"
            if top not in installed:
                if imp.where == "function":
                    kind = graph.in_functions
                else:
                    kind = graph.tried if imp.guarded else graph.required
                kind.setdefault(top, []).append(by)
                continue
            if imp.where == "function":
                continue
            if imp.name not in files:
                if not imp.guarded:
                    graph.missing.setdefault(imp.name, []).append(by)
                continue
            parts = imp.name.split(".")  # importing a.b.c runs a, a.b and a.b.c
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for absent in [e for e in entries if e not in files]:
        graph.missing.setdefault(absent, []).append("ENTRIES")
    for kind in (graph.tried, graph.in_functions):
        for top in list(kind):
            if top in graph.required:
                del kind[top]
    graph.in_functions = {k: v for k, v in graph.in_functions.items() if k not in graph.tried}
    return graph


def installed_names(site: Path) -> set[str]:
    """Top-level import names installed in ``site`` (its folders, modules and extensions)."""
    names = set()
    for path in site.iterdir():
        if path.suffix in (".dist-info", ".data", ".pth") or path.name in ("__pycache__", "bin"):
            continue
        if path.is_dir():
            names.add(path.name)
        elif path.suffix in (".py", ".so"):
            names.add(path.name.split(".")[0])
    return names


def image_names(kinds: Path) -> set[str]:
    """Import names of the packages KINDS.md lists for the nvidia-h200 image."""
    listed = re.search(r"Packages: (.+?)\.\n", kinds.read_text())
    if not listed:
        raise SystemExit(f"{kinds}: no 'Packages: ...' line")
    dists = [n.strip().lower() for n in listed.group(1).split(",")]
    return {IMAGE_IMPORT_NAMES.get(d, d.replace("-", "_")) for d in dists}


def check(site: Path, kinds: Path | None, also: Iterable[Path] = ()) -> dict[str, object]:
    """The graph of the Unsloth installed in ``site`` against what the device will have: the
    wheels in ``site`` (and ``also``: the main check's site), the image (``kinds``), the
    standard library. ``ok`` when no internal module is missing and every required external
    package is found (without ``kinds``, the image is not checked: ``image_checked`` false)."""
    graph = walk(module_files(site))
    carried = installed_names(site)
    for other in also:
        carried |= installed_names(other)
    image = image_names(kinds) if kinds is not None else set()
    stdlib = set(sys.stdlib_module_names) | {"__main__"}

    def source(top: str) -> str:
        if top in stdlib:
            return "stdlib"
        if top in carried:
            return "carried"
        if top in image:
            return "image"
        return "absent" if kinds is not None else "not carried (image not checked)"

    required = {top: source(top) for top in sorted(graph.required)}
    unmet = [t for t, s in required.items() if s == "absent"]
    tried = {top: source(top) for top in sorted(graph.tried) if top not in stdlib}
    return {
        "ok": not graph.missing and not unmet,
        "image_checked": kinds is not None,
        "modules": len(graph.modules),
        "carried_reached": sorted({m.split(".")[0] for m in graph.modules}),
        "missing_modules": graph.missing,
        "required": {t: s for t, s in required.items() if s != "stdlib"},
        "unmet": {t: graph.required[t][:3] for t in unmet},
        "tried_absent": [t for t, s in tried.items() if s not in ("carried", "image")],
        "tried_found": [t for t, s in tried.items() if s in ("carried", "image")],
        "in_functions": sorted(t for t in graph.in_functions if t not in stdlib),
    }


def image_stand_in(kinds: Path, dest: Path, carried: Path) -> list[str]:
    """Links in ``dest`` to this Python's installed packages that KINDS.md lists for the image
    and ``carried`` does not hold: with ``python -S`` and ``PYTHONPATH=carried:dest`` nothing
    else is importable (the .venv's deepspeed, pydantic, its newer transformers are not)."""
    import importlib.metadata as md
    import os
    import sysconfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_wheels_check import canon, image_packages

    image = image_packages(kinds)
    held = {canon(p.name.split("-")[0]) for p in carried.glob("*.dist-info")}
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True, exist_ok=True)
    linked = []
    for dist in md.distributions():
        name = canon(dist.metadata["Name"])
        if name not in image or name in held:
            continue
        for top in {f.parts[0] for f in dist.files or []}:
            if top in ("..", "bin", "__pycache__") or top.endswith(".data"):
                continue
            if (site / top).exists() and not (dest / top).exists():
                os.symlink(site / top, dest / top)
        linked.append(name)
    return sorted(linked)


def import_on_cpu() -> None:
    """``import unsloth`` and ``from unsloth import FastLanguageModel`` for real, on this CPU,
    with the carried set and the image's versions of transformers, huggingface_hub and Triton
    on the path (``gpu_wheels_unsloth.sh`` with ``UNSLOTH_IMPORT_CHECK=1`` lays them out), under
    Unsloth's own CPU-CI switch ``UNSLOTH_ALLOW_CPU=1`` (its GPU import path on a machine
    without CUDA); then the trl patching that switch skips (``PatchFastRL``, the SFTTrainer
    rewrite), as the import runs it on the device. Not checked: anything past import (loading a
    model asks the device for its properties)."""
    import os
    import time

    os.environ["UNSLOTH_ALLOW_CPU"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    # the trainers Unsloth rewrites are written here, not into the checkout
    import tempfile

    os.environ["UNSLOTH_COMPILE_LOCATION"] = tempfile.mkdtemp(prefix="unsloth_compiled.")
    t0 = time.perf_counter()
    import unsloth
    from unsloth import FastLanguageModel  # noqa: F401

    imported = time.perf_counter() - t0
    del os.environ["UNSLOTH_ALLOW_CPU"]
    from unsloth import _gpu_init
    from unsloth.context_parallel import patch_sft_trainer
    from unsloth.models.llama import FastLlamaModel
    from unsloth.models.rl import PatchFastRL

    PatchFastRL(FastLanguageModel=FastLlamaModel)
    _gpu_init._patch_trl_trainer()
    patch_sft_trainer()
    import importlib.metadata as md

    import trl

    names = ("unsloth", "unsloth_zoo", "transformers", "trl", "peft", "datasets", "triton", "torch")
    print(
        f"import unsloth (UNSLOTH_ALLOW_CPU=1) in {imported:.0f} s, trl patched "
        f"(SFTTrainer: {type(trl.SFTTrainer).__name__} {trl.SFTTrainer.__name__}): "
        + ", ".join(f"{n} {md.version(n)}" for n in names)
        + f"; unsloth {unsloth.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--import-on-cpu"]:
        import_on_cpu()
        return 0
    if argv is None and sys.argv[1:2] == ["--image-stand-in"]:
        kinds, dest, carried = map(Path, sys.argv[2:5])
        linked = image_stand_in(kinds, dest, carried)
        print(f"the image stood in by {len(linked)} of this Python's packages: {', '.join(linked)}")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="the Unsloth wheels installed (pip --target)")
    ap.add_argument("--kinds", type=Path, default=None, help="KINDS.md: the image's packages")
    ap.add_argument("--also", type=Path, action="append", default=[], help="another site")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = check(args.site, args.kinds, args.also)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"Unsloth's import graph: {result['modules']} carried modules reached, of "
            + ", ".join(result["carried_reached"])
        )
        print("required: " + ", ".join(f"{t} ({s})" for t, s in result["required"].items()))
        print("tried, absent on the device (Unsloth goes on without): "
              + ", ".join(result["tried_absent"]))  # fmt: skip
        print("tried, present: " + ", ".join(result["tried_found"]))
        print(f"only inside functions ({len(result['in_functions'])}): "
              + ", ".join(result["in_functions"]))  # fmt: skip
        for name, by in result["missing_modules"].items():
            print(f"MISSING module {name} (imported by {', '.join(by[:3])})")
        for name, by in result["unmet"].items():
            print(f"UNMET: {name} is imported unguarded by {', '.join(by)}")
        print("import graph " + ("complete" if result["ok"] else "INCOMPLETE"))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
