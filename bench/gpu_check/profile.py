"""The profile phases, first in priority (issue #47 item 1): where one step's time goes,
memtune's (``profile-memtune``) and the usual recipe's (``profile-baseline``, Trainer + peft),
on the same model, tokens and LoRA, under ``torch.profiler``.

Each side runs its warm-up steps unprofiled, then its timed steps profiled. Every operator the
profiler records is put in one kind by what it is and where it runs (:func:`kind_of`): the
base's GEMMs and LoRA's (a GEMM with the adapters' rank among its dimensions), the loss head
(a GEMM with the vocabulary among its dimensions, cross-entropy), attention, LoRA's dropout,
norms and other elementwise work (autograd's own nodes with them), bitsandbytes' 4-bit
dequantization, copies, communication; and by the scope it runs in: the forward recomputed in
backward (a checkpointed layer's function run again, labelled here), the optimizer step with
ZeRO's work in it. Times are each operator's own
(children excluded), on the device when there is one (its kernels' time), else on the CPU; what
the step's wall time holds beyond them is the device idle: host syncs, launch gaps, Python.

Per kind, milliseconds per step and the share of the step; the 20 costliest operators too.
The same phases measure every later change the same way (bench/README.md, "GPU check")."""

from __future__ import annotations

import contextlib
import gc
import itertools
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .batches import synthetic_batch
from .configs import compose_cfg, decided_at
from .measure import empty_cache, memory_now, step_clock, sync
from .recorder import Phase, device_and_env, init_one_rank, time_left

KINDS = (
    "base GEMMs",
    "LoRA GEMMs",
    "recompute (forward again in backward)",
    "attention",
    "LoRA dropout",
    "norms and elementwise",
    "loss head",
    "4-bit dequantization",
    "optimizer and ZeRO",
    "copies",
    "communication",
    "device idle (host syncs, launch gaps)",
)
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_grouped_mm")
ATTENTION = ("scaled_dot_product", "flash", "efficient_attention", "_fused_sdp", "sdpa")
LOSS = ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")
DROPOUT = ("dropout", "bernoulli")
"""peft's LoRA dropout on each adapted module's input (Qwen's attention has none)."""
DEQUANT = ("dequantize", "bitsandbytes", "gemv_4bit", "bnb")
COMMS = ("nccl", "c10d", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "broadcast")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::cat", "Memcpy")
SCOPE_RECOMPUTE = "gpu_check.recompute"
SCOPE_FORWARD = "gpu_check.forward"
"""A checkpointed layer's first forward: a label of no kind (:func:`label_recompute`)."""
SCOPE_OPTIMIZER = "gpu_check.optimizer"


def kind_of(name: str, shapes: list[Any], scopes: set[str], r: int, vocab: int) -> str:
    """The kind of one recorded operator (module docstring)."""
    if SCOPE_OPTIMIZER in scopes:
        return "optimizer and ZeRO"
    low = name.lower()
    if any(c in low for c in COMMS):
        return "communication"
    if SCOPE_RECOMPUTE in scopes:
        return "recompute (forward again in backward)"
    if any(d in low for d in DEQUANT):
        return "4-bit dequantization"
    dims = {int(d) for shape in shapes if isinstance(shape, list | tuple) for d in shape}
    if name in GEMMS:
        if vocab in dims:
            return "loss head"
        return "LoRA GEMMs" if r in dims else "base GEMMs"
    if any(a in low for a in LOSS):
        return "loss head"
    if any(a in low for a in ATTENTION):
        return "attention"
    if any(a in low for a in DROPOUT):
        return "LoRA dropout"
    if name in COPIES or "memcpy" in low:
        return "copies"
    return "norms and elementwise"


def _scopes(event: Any) -> set[str]:
    out, parent = set(), event.cpu_parent
    while parent is not None:
        out.add(parent.name)
        parent = parent.cpu_parent
    return out


def _timed_events(prof: Any, on_device: bool) -> Iterator[tuple[float, Any, set[str]]]:
    """(µs, the operator, the scopes it ran in) for each operator's own time: off a device its
    own CPU time (children excluded); on a device the time of the kernels it launched itself.

    On a device torch.profiler's event list holds both the operators, each with the kernels
    (and copies, memsets) it launched attached (``.kernels``), and those kernels again as
    events of their own, on the device: counting the kernels' events as well would count
    every kernel twice, the second time nameless to :func:`kind_of` (in "norms and
    elementwise"). So only the operators are read, a scope label included (the kernels a
    Triton function launches inside one are its own), the label's own name among its scopes.
    Off a device the labels themselves are left out: their operators are counted."""
    from torch.autograd import DeviceType

    for event in prof.events():
        if event.device_type != DeviceType.CPU or event.is_async:
            continue  # a device's kernel (counted in its operator), or async work
        if event.name.startswith("ProfilerStep"):
            continue
        if on_device:
            own = float(sum(k.duration for k in event.kernels))
            yield own, event, _scopes(event) | {event.name}
        elif not event.name.startswith("gpu_check."):
            yield float(event.self_cpu_time_total), event, _scopes(event)


def kernels_us(prof: Any) -> float:
    """The device's kernels, copies and memsets in all (the spans of ``record_function`` labels
    on the device's timeline are not work: left out, as torch's own table leaves them out)."""
    from torch.autograd import DeviceType

    return sum(
        float(e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type != DeviceType.CPU
        and not e.is_async
        and not getattr(e, "is_user_annotation", False)
    )


def summarize(prof: Any, steps: int, wall_s: float, on_device: bool, r: int, vocab: int) -> dict:
    """Per kind, ms per step (and its share of the step's wall time); the costliest ops."""
    per_kind: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for us, event, scopes in _timed_events(prof, on_device):
        if us <= 0:
            continue
        kind = kind_of(event.name, list(event.input_shapes or []), scopes, r, vocab)
        per_kind[kind] += us
        per_op[f"{event.name} [{kind}]"] += us
    step_ms = 1e3 * wall_s / steps
    busy = sum(per_kind.values()) / 1e3 / steps
    kinds = {k: per_kind.get(k, 0.0) / 1e3 / steps for k in KINDS[:-1]}
    kinds[KINDS[-1]] = max(0.0, step_ms - busy)
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:20]
    extra: dict[str, float] = {}
    if on_device:  # kernels no operator launched (none expected): the idle above holds them
        extra["kernels_outside_ops_ms"] = max(0.0, kernels_us(prof) / 1e3 / steps - busy)
    return {
        **extra,
        "steps": steps,
        "step_ms": step_ms,
        "measured_on": "device kernels" if on_device else "CPU (dry run: no device)",
        "kinds_ms": kinds,
        "shares": {k: (v / step_ms if step_ms else 0.0) for k, v in kinds.items()},
        "top_ops_ms": [(name, us / 1e3 / steps) for name, us in top],
    }


@contextlib.contextmanager
def labelled(name: str) -> Iterator[None]:
    from torch.profiler import record_function

    with record_function(name):
        yield


def label_recompute(model: Any) -> int:
    """The checkpointed decoder layers' forward, when it runs again in backward, inside a
    ``gpu_check.recompute`` scope (profiling only: the function transformers calls is wrapped
    around the layer's own). Returns how many layers are labelled. The first forward runs in a
    label too, of no kind: a selective layer's recompute must replay the forward's operators
    one for one, a label's among them, and a label in backward alone stopped the step
    ("profiler._record_function_enter_new.default encountered during backward but not found in
    storage": the CPU dry run, once it ran a selective layer as the 24 GB plans do)."""
    import torch

    from memtune.rank.layers import decoder_layers

    n = 0
    for layer in decoder_layers(model):
        inner = getattr(layer, "_gradient_checkpointing_func", None)
        if not layer.gradient_checkpointing or inner is None:
            continue

        def checkpoint(function: Any, *args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            def again(*a: Any, **k: Any) -> Any:
                if torch._C._current_graph_task_id() == -1:  # the forward pass
                    with labelled(SCOPE_FORWARD):
                        return function(*a, **k)
                with labelled(SCOPE_RECOMPUTE):
                    return function(*a, **k)

            return _inner(again, *args, **kwargs)

        layer._gradient_checkpointing_func = checkpoint
        n += 1
    return n


@contextlib.contextmanager
def profiling(device: Any) -> Iterator[Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        yield prof
        sync(device)


def profile_length(phase: Phase) -> int:
    """The row the profile explains: 2,048 tokens on the GPU (where memtune's LoRA was 0.89×
    the recipe's), the dry run's shortest."""
    return min(phase.mode.lengths)


def at_profile_length(phase: Phase) -> tuple[Any, int, Any, Any, Any]:
    """A phase's one rank on its device, at the profile's length: (device, length, settings,
    decisions as a launch makes them, parameter counts); shared by the phases that measure
    that step (profile-memtune, zero-cost)."""
    from memtune.memory.counts import count_params

    device = device_and_env(phase)
    init_one_rank(device)
    seq_len = profile_length(phase)
    cfg0 = compose_cfg(phase.mode, phase.method, seq_len)
    counts = count_params(cfg0)
    cfg, d = decided_at(cfg0, seq_len, counts)
    return device, seq_len, cfg, d, counts


def run_profile_memtune(phase: Phase, deadline: float) -> None:
    """memtune's LoRA step, built as a rank builds it (memtune_runner), profiled."""
    from memtune.config.decisions import with_sections
    from memtune.config.deepspeed import build_ds_config
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    from .memtune_runner import build_memtune

    mode, method = phase.mode, phase.method
    device, seq_len, cfg, d, counts = at_profile_length(phase)
    parts, _ = build_memtune(cfg, d, build_ds_config(cfg, d), device)
    engine = parts.engine
    labelled_layers = label_recompute(engine.module.model)
    step = engine.step

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        with labelled(SCOPE_OPTIMIZER):
            return step(*args, **kwargs)

    engine.step = optimizer_step
    vocab = int(cfg.model.architecture["vocab_size"])
    batches = itertools.repeat(synthetic_batch(vocab, seq_len, seq_len))

    def steps(n: int) -> Any:
        clock = step_clock(device)
        run_cfg = with_sections(cfg, trainer={"max_steps": n})
        train(engine, batches, run_cfg, d, device, NullLogger(), TrainResult(), clock)
        return clock

    steps(mode.warmup)
    if not time_left(deadline, 10):
        phase.data["errors"].append({"where": "profile", "error": "skipped: out of time"})
        return
    with profiling(device) as prof:
        clock = steps(mode.timed)
    wall = clock.marks[-1] - clock.marks[0]
    measured_before_summary(phase, wall, mode.timed)
    summary = summarize(prof, mode.timed, wall, device.type == "cuda", cfg.peft.r, vocab)
    summary.update(
        side="memtune",
        method=method,
        seq_len=seq_len,
        checkpointed_layers=d.checkpointing.recomputed,
        selective_layers=d.checkpointing.selective,
        recompute_labelled_layers=labelled_layers,
        attention=parts.attention,
        loss_kind=parts.loss_kind,
        memory=memory_now(device),
        planned=planned_step(cfg, d, counts),
    )
    phase.data["profile"] = summary
    phase.save()
    print(f"gpu_check: {phase.name}: {summary['step_ms']:.0f} ms a step profiled", flush=True)


def measured_before_summary(phase: Any, wall_s: float, steps: int) -> None:
    """The profiled steps' time, saved before their events are read: reading them (record
    shapes, every operator of every step) is the phase's slowest part on a 7B model, and a
    phase stopped at its deadline in it kept nothing of a step already measured."""
    phase.data["notes"].append(
        f"{steps} profiled steps: {1e3 * wall_s / steps:.0f} ms a step (wall), before their "
        "events were summarized"
    )
    phase.save()


def planned_step(cfg: Any, d: Any, counts: Any) -> dict[str, float]:
    """What the step-time estimate counts in the profiled step (one micro batch): its matmul
    TFLOPs (full recomputes included) and the memory-bound passes it prices apart, in GB —
    beside the measured kinds, what a GPU's times check it against."""
    from memtune.memory.step_time import (
        dropout_pass_bytes,
        micro_step_flops,
        selective_pass_bytes,
    )

    return {
        "matmul_tflop": micro_step_flops(cfg, d, counts).total / 1e12,
        "selective_recompute_gb": selective_pass_bytes(cfg, d, counts) / 1e9,
        "lora_dropout_gb": dropout_pass_bytes(cfg, d, counts) / 1e9,
    }


def run_profile_baseline(phase: Phase, deadline: float) -> None:
    """The usual recipe's step (Trainer + peft, every layer recomputed: baseline_runner's
    setup), profiled on the same tokens."""
    from baseline import CountingTrainer, training_args
    from transformers import TrainerCallback, default_data_collator

    from memtune.config.decisions import with_sections
    from memtune.memory.counts import count_params

    from .baseline_runner import recipe_model

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    seq_len = profile_length(phase)
    cfg = compose_cfg(mode, method, seq_len)
    counts = count_params(cfg)
    model = recipe_model(cfg, method, device)
    vocab = int(cfg.model.architecture["vocab_size"])
    batch = synthetic_batch(vocab, seq_len, seq_len)
    scope: dict[str, Any] = {}

    class Scopes(TrainerCallback):
        """Labels the recompute once Trainer has turned checkpointing on, and the optimizer
        step (its callbacks bracket it)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            scope["layers"] = label_recompute(model)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            scope["step"] = labelled(SCOPE_OPTIMIZER)
            scope["step"].__enter__()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            scope.pop("step").__exit__(None, None, None)

    class Marks(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not self.marks:
                sync(device)
                self.marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync(device)
            self.marks.append(time.perf_counter())

    def run(n: int) -> Marks:
        at, d = decided_at(cfg, seq_len, counts)
        rows = [{k: v[0] for k, v in batch.items()} for _ in range(n)]
        marks = Marks()
        with tempfile.TemporaryDirectory() as tmp:
            CountingTrainer(
                model=model,
                args=training_args(with_sections(at, trainer={"max_steps": n}), d, Path(tmp)),
                train_dataset=rows,
                data_collator=default_data_collator,
                callbacks=[Scopes(), marks],
            ).train()
        return marks

    run(mode.warmup)
    if not time_left(deadline, 10):
        phase.data["errors"].append({"where": "profile", "error": "skipped: out of time"})
        return
    with profiling(device) as prof:
        marks = run(mode.timed)
    wall = marks.marks[-1] - marks.marks[0]
    measured_before_summary(phase, wall, mode.timed)
    summary = summarize(prof, mode.timed, wall, device.type == "cuda", cfg.peft.r, vocab)
    summary.update(
        side="baseline",
        method=method,
        seq_len=seq_len,
        checkpointed_layers=int(cfg.model.architecture["num_hidden_layers"]),
        recompute_labelled_layers=scope.get("layers", 0),
        attention=model.config._attn_implementation,
        loss_kind="model's own (full logits)",
        memory=memory_now(device),
    )
    phase.data["profile"] = summary
    phase.save()
    print(f"gpu_check: {phase.name}: {summary['step_ms']:.0f} ms a step profiled", flush=True)
    gc.collect()
    empty_cache(device)
