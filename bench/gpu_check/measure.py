"""Measurement: clocks and syncs, memory (peaks, the allocator's census), step timing, model
FLOPs and MFU, the plan's error, the matmul ceiling and the machine's record."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import itertools
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .modes import CAP_GIB, GIB, MEASURED_TFLOPS, PEAK_TFLOPS


def flops_per_step(
    counts: Any, arch: dict[str, Any], tokens: int, sequences: tuple[int, ...] | None = None
) -> dict[str, float]:
    """Model FLOPs of one training step (recompute not counted, as MFU never counts it).

    N = weights that multiply activations: the decoder's linear layers and the LM head (the
    embedding is a lookup). Forward 2N per token. Backward: the base is frozen, so only the
    input gradient (2N per token) is needed, not the weight gradient: 4N per token in all,
    where full training takes 6N. LoRA adds 6 per adapter weight per token. Attention (no
    weights, causal; h the query width): forward 2·T²·h per layer (QKᵀ and AV, half of T²
    each), backward twice that: 6·L·T²·h, T a sequence's tokens: a row of several sequences
    (``sequences``, their lengths; a DPO row holds a pair) attends within each, 6·L·h·Σ Tᵢ².
    ``six_n`` is the usual 6N convention on the same N, for comparison.

    A mixture's routed experts count as a token uses them: num_experts_per_tok of
    num_experts, their stacks and their adapters (``counts.routed_share``; 1 for a dense
    model, which has none). The router's matmul is left out (experts × hidden a token)."""
    share = counts.routed_share
    n = counts.linear + round(counts.experts * share) + (counts.head or counts.embedding)
    lora = counts.lora - counts.expert_lora + round(counts.expert_lora * share)
    heads, layers = int(arch["num_attention_heads"]), int(arch["num_hidden_layers"])
    # h: the query width, heads × head_dim (Qwen3-30B-A3B's 4,096 over a 2,048 hidden state)
    h = heads * int(arch.get("head_dim") or int(arch["hidden_size"]) // heads)
    attention = 6 * layers * h * sum(t**2 for t in (sequences or (tokens,)))
    return {
        "n_matmul": n,
        "n_lora": lora,
        "lora": (4 * n + 6 * lora) * tokens + attention,
        "six_n": 6 * n * tokens + attention,
    }


# ------------------------------------------------------------------ device helpers


def empty_cache(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_clock(device: Any, on_step: Any = None) -> Any:
    """memtune's training-loop hooks that mark each step's end (after a device sync) in
    ``.marks``; ``on_step(marks)`` after each."""
    from memtune.rank.loop import Hooks

    class StepClock(Hooks):
        def __init__(self) -> None:
            sync(device)
            self.marks = [time.perf_counter()]

        def after_step(self, step: int, result: Any) -> None:
            sync(device)
            self.marks.append(time.perf_counter())
            if on_step is not None:
                on_step(self.marks)

    return StepClock()


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_now(device: Any) -> dict[str, float]:
    import torch

    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": reserved / GIB,
        "total_gib": total / GIB,
        # The CUDA context and loaded kernels: used on the device, never seen by the allocator.
        "outside_allocator_gib": (total - free - reserved) / GIB,
    }


def cap_allocator(device: Any, device_gib: float | None, rec: dict[str, Any]) -> None:
    """Cap the allocator so the whole device use stays under ``device_gib`` (a 24 GB card:
    ``CAP_GIB``): ``set_per_process_memory_fraction`` at ``device_gib`` less what lies outside
    the allocator now (the CUDA context, kernels, DeepSpeed's libraries), recorded in ``rec``
    as ``allocator_cap_gib``; ``rec["cap_gib"]`` is the card. None lifts the cap. The one
    place every capped side (memtune's rows, Unsloth's, the searches, the mixture) caps
    through. Off CUDA (the dry run) the card is recorded and nothing is capped."""
    if device_gib is not None:
        rec["cap_gib"] = device_gib
    if device.type != "cuda":
        return
    import torch

    if device_gib is None:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    gc.collect()
    empty_cache(device)
    now = memory_now(device)
    rec["allocator_cap_gib"] = device_gib - now["outside_allocator_gib"]
    torch.cuda.set_per_process_memory_fraction(rec["allocator_cap_gib"] / now["total_gib"], device)


def add_fits_card(rec: dict[str, Any]) -> None:
    """``rec["fits_cap"]``: whether what the card had in use at the row's peak
    (``device_used_gib``: peak reserved + what lies outside the allocator) fits a 24 GB card
    (``CAP_GIB``). The usual recipe runs uncapped, so that its speed is measured at all: this
    says whether it would have fitted the card memtune and Unsloth are capped at."""
    if rec.get("device_used_gib") is not None:
        rec["fits_cap"] = rec["device_used_gib"] <= CAP_GIB


@contextlib.contextmanager
def peak_window(device: Any, out: dict[str, Any]) -> Iterator[None]:
    import torch

    if device.type == "cuda":
        sync(device)
        empty_cache(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        sync(device)
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        out.update(memory_now(device))


def rss_gib() -> tuple[float, float] | None:
    """This process's resident memory, (anonymous, file-backed) in GiB: RssAnon is what it
    allocated (tensors, buffers), RssFile the pages of files it maps (a safetensors
    checkpoint read through mmap: the page cache, shared and reclaimable). None off Linux."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    kib = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            kib[name] = int(value.split()[0])
    if len(kib) != 2:
        return None
    return kib["RssAnon"] / 2**20, kib["RssFile"] / 2**20


@contextlib.contextmanager
def host_peak(out: dict[str, Any], every_s: float = 0.005) -> Iterator[None]:
    """The host memory the block adds: RssAnon and RssFile sampled every ``every_s`` in a
    thread, ``out["host_anon_before_gib"]``, ``["host_anon_peak_gib"]`` (the peak less what
    was there before), ``["host_file_peak_gib"]`` (likewise, the checkpoint's mapped pages)
    and ``["host_samples"]``. A sampler can miss a peak shorter than ``every_s``."""
    import threading

    first = rss_gib()
    if first is None:
        yield
        return
    peak = list(first)
    samples = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = rss_gib()
            if now is not None:
                peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
                samples[0] += 1
            stop.wait(every_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        out["host_anon_before_gib"] = first[0]
        out["host_anon_peak_gib"] = peak[0] - first[0]
        out["host_file_peak_gib"] = peak[1] - first[1]
        out["host_samples"] = samples[0]


CENSUS_TOP = 16
OUR_CODE = ("memtune", "transformers", "peft", "bitsandbytes", "deepspeed", "gpu_check")


@contextlib.contextmanager
def peak_census(device: Any, out: dict[str, Any]) -> Iterator[None]:
    """On CUDA, the allocator's history over the block, and ``out["census"]``: what was
    allocated at the block's peak, grouped by where. The long-context plan missed the measured
    peak by 7-13% on the H200 (2026-12-04): this names the tensors it missed. Only blocks
    allocated inside the window count (the weights before it are not in the history), so the
    census is what the step adds. On an OOM the peak is the last moment before the failure."""
    import torch

    if device.type != "cuda":
        yield
        return
    memory = torch.cuda.memory
    memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=2_000_000
    )
    try:
        yield
    finally:
        try:
            snap = memory._snapshot()
            out["census"] = census(snap["device_traces"][device.index or 0])
        except Exception as err:  # the census is a diagnosis; never lose the step's record
            out["census"] = {"error": repr(err)[-300:]}
        finally:
            memory._record_memory_history(enabled=None)


def census(trace: list[dict[str, Any]], top: int = CENSUS_TOP) -> dict[str, Any]:
    """The live blocks at the peak of ``trace`` (the allocator's alloc / free_completed
    events), summed by the innermost frame and the innermost frame of the code we run
    (memtune, transformers, peft, bitsandbytes, DeepSpeed), largest first."""

    def frames_key(frames: list[dict[str, Any]]) -> str:
        def name(f: dict[str, Any]) -> str:
            path = str(f.get("filename", "?"))
            short = "/".join(path.split("/")[-2:])
            return f"{f.get('name', '?')} ({short}:{f.get('line', '?')})"

        if frames and frames[0].get("name") == "<module>":  # outermost first: innermost first
            frames = frames[::-1]
        inner = name(frames[0]) if frames else "no Python frame (autograd's backward)"
        ours = next((f for f in frames if any(k in str(f.get("filename")) for k in OUR_CODE)), None)
        return inner if ours is None or ours is frames[0] else f"{inner} ← {name(ours)}"

    live: dict[int, int] = {}
    total = peak = peak_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])
    at_peak: dict[int, dict[str, Any]] = {}
    for ev in trace[: peak_at + 1]:
        if ev["action"] == "alloc":
            at_peak[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            at_peak.pop(ev["addr"], None)
    groups: dict[str, list[int]] = {}
    for ev in at_peak.values():
        g = groups.setdefault(frames_key(ev.get("frames") or []), [0, 0])
        g[0] += ev["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_gib": peak / GIB,
        "events": len(trace),
        "blocks": len(at_peak),
        "rows": [{"gib": b / GIB, "count": c, "where": w} for w, (b, c) in rows[:top]],
        "rest_gib": sum(b for _, (b, _) in rows[top:]) / GIB,
    }


def is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def is_oom_text(text: str) -> bool:
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def timing(starts_ends: list[float], warmup: int, tokens: int) -> dict[str, Any]:
    steps = [b - a for a, b in itertools.pairwise(starts_ends)]
    timed = steps[warmup:] or steps[-1:]
    median = statistics.median(timed)
    return {
        "step_s": [round(s, 4) for s in steps],
        "timed_steps": len(timed),
        "step_s_median": median,
        "tokens_per_s": tokens / median,
    }


def add_mfu(rec: dict[str, Any], flops: dict[str, float], device: Any) -> None:
    rec["flops_per_step"] = flops["lora"]
    rec["flops_per_step_6n"] = flops["six_n"]
    if device.type != "cuda":
        return
    rate = flops["lora"] / rec["step_s_median"]
    rec["achieved_tflops"] = rate / 1e12
    rec["mfu"] = rate / (PEAK_TFLOPS * 1e12)
    rec["mfu_6n"] = flops["six_n"] / rec["step_s_median"] / (PEAK_TFLOPS * 1e12)
    rec["of_measured_ceiling"] = rate / (MEASURED_TFLOPS * 1e12)


def add_plan_error(rec: dict[str, Any]) -> None:
    """Planned live bytes against peak allocated; planned total against what the device had
    in use at the peak (peak reserved + what lies outside the allocator)."""
    if "peak_allocated_gib" not in rec:
        return
    base = rec.get("leftover_gib", 0.0)
    rec["measured_gib"] = rec["peak_allocated_gib"] - base
    rec["plan_error_pct"] = 100 * (rec["plan"]["live_gib"] / rec["measured_gib"] - 1)
    used = rec["peak_reserved_gib"] - base + rec["outside_allocator_gib"]
    rec["device_used_gib"] = used
    add_fits_card(rec)
    rec["plan_total_error_pct"] = 100 * (rec["plan"]["total_gib"] / used - 1)


def matmul_tflops(device: Any, n: int = 8192, reps: int = 10) -> float:
    """This card's bf16 matmul rate now (KINDS.md's ceiling measurement, ~0.3 s)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def environment(device: Any) -> dict[str, Any]:
    import torch

    from memtune.machine import cpu_flags, versions

    env: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "python": platform.python_version(),
        "device": str(device),
        "cpu_count": os.cpu_count(),
    }
    env.update(versions())  # the same record as the planner's and make bench's
    env["cpu_flags"] = cpu_flags()
    env["torch_cuda"] = torch.version.cuda
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name, gpu_total_gib=props.total_memory / GIB, sms=props.multi_processor_count
        )
    return env
