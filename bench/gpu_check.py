"""One-shot GPU check of memtune on Qwen2.5-7B (issue #7): memory, speed, MFU, the plan's error.

    bash bench/gpu_check.sh                       # on the lent H200 (installs .whl/, see README)
    python bench/gpu_check.py --dry-run           # here, on CPU: the same code paths, tiny model

For LoRA r=16 on all linear layers over a bf16 base, and for QLoRA (NF4 base), at 4096 and
2048 tokens, one rank, it measures two sides on the same random-weight Qwen2.5-7B:

* **baseline** — the recipe users follow (``bench/baseline.py``'s ``training_args`` and
  ``CountingTrainer``): ``transformers.Trainer`` + peft LoRA, full gradient checkpointing, the
  model's own cross-entropy on full logits, no DeepSpeed; QLoRA with peft's
  ``prepare_model_for_kbit_training`` as its docs say;
* **memtune** — memtune's own pieces: ``memtune.rank.model.add_lora`` (``prepare_quantized``,
  selective checkpointing with ``checkpoint_layers=auto`` planned for a 24 GB card), the
  chunked loss (``CausalLMLoss``), ``build_optimizer``, ``build_ds_config`` and DeepSpeed
  ZeRO-3 at world size 1 through ``deepspeed.initialize``, and ``memtune.rank.loop.train``.

Each measurement records peak allocated memory, tokens/s over timed steps after warm-up, MFU
and the planner's prediction (``memtune.memory``) with its error. Then, for QLoRA with memtune,
the longest sequence whose step fits under a 24 GB cap (``set_per_process_memory_fraction``).

No checkpoint is read: the base is built from ``model.architecture`` (conf/model/*.yaml) with
random weights directly on the device. memtune's ``load_base_model`` (``from_pretrained``)
is the one piece bypassed: for LoRA the model is built with ``from_config`` while a
``HfDeepSpeedConfig`` is alive, so it is created under ``zero.Init`` exactly as
``from_pretrained`` creates it under ZeRO-3; for QLoRA every decoder ``nn.Linear`` becomes a
bitsandbytes ``Linear4bit`` quantized on the device with the settings of memtune's
``quantization_config`` (what ``from_pretrained`` does tensor by tensor), no ``zero.Init``
(memtune's quantized ZeRO-3 path does not use it either).

Then a mixture-of-experts block (phase ``moe-block``): one transformers
``Qwen3MoeSparseMoeBlock`` at Qwen3-30B-A3B's full width, bf16, random weights, forward and
backward on 4096 tokens, with memtune's LoRA on the routed experts (rank.experts: a Python loop
over the experts, each on its routed tokens, which a GPU may find launch-bound) against peft's
``target_parameters`` over transformers' one-kernel ``grouped_mm``, both frozen, and memtune
over NF4 and int8 stacks: step time, tokens/s and peak memory of each.

Last, Qwen3.5 (issue #30; phases ``qwen35-torch`` and ``qwen35-fla``): the random-weight
Qwen3.5-2B, hybrid (3 of 4 layers Gated DeltaNet), with the LoRA of the qwen3.5-9b experiment,
trained on packed rows of 4096 tokens (cu_seq_lens as the loader gives them) through memtune's
per-sample path, once on transformers' torch code (flash-linear-attention blocked in that
process) and once on flash-linear-attention's Triton kernels: step time, tokens/s, peak
memory against the plan, which kernels transformers calls, and packed = alone (each sample's
loss and logits in a packed row as alone, in bf16).

Every phase runs in its own process (a crash, hang or leak stays there); each writes its
measurements as soon as they exist and the outputs are rewritten after each, so a timeout
still returns data. Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # memtune is not installed on the device machine
sys.path.insert(0, str(ROOT / "bench"))

GIB = 1024**3
PEAK_TFLOPS = 989.0
"""H200 SXM dense bf16 by the datasheet (the H100's rate)."""
MEASURED_TFLOPS = 790.0
"""An 8192³ bf16 matmul through PyTorch on random data on this workplace's H200 (KINDS.md)."""
CAP_GIB = 23.99
"""A 24 GB card: RTX 4090D's 24,564 MiB, what the 4×4090 experiments plan against."""


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its CPU dry run."""

    dry_run: bool
    model: str
    lengths: tuple[int, ...]
    search: tuple[int, ...]
    warmup: int
    timed: int
    overrides: tuple[str, ...] = ()
    fake_oom_above: int | None = None
    budget_s: float = 420.0
    long_lengths: tuple[int, ...] = ()  # long-context phases: timed lengths
    long_search: tuple[int, ...] = ()  # ... and the lengths tried under the cap, ascending
    hybrid_model: str = "tiny-qwen3.5"  # the Qwen3.5 phases: a hybrid model ...
    hybrid_len: int = 256  # ... trained on packed rows of this many tokens
    moe_tokens: int = 256  # the MoE block phase: tokens a step (Qwen3-30B-A3B's width on a GPU)


GPU = Mode(
    dry_run=False,
    model="qwen2.5-7b",
    lengths=(4096, 2048),
    search=(8192, 12288, 16384, 20480, 24576, 28672, 32768),
    warmup=2,
    timed=3,
    long_lengths=(32768,),
    long_search=(49152, 65536, 81920, 98304, 114688, 131072),
    hybrid_model="qwen3.5-2b",
    hybrid_len=4096,
    moe_tokens=4096,
)


def lengths_from_env(mode: Mode) -> Mode:
    """``GPU_CHECK_LONG_TIMED`` / ``GPU_CHECK_LONG_SEARCH`` (comma-separated token counts, may
    be empty) replace the long phases' lengths: a short rerun for the census, say
    ``GPU_CHECK_LONG_TIMED= GPU_CHECK_LONG_SEARCH=49152``. Read in every phase's process."""
    import dataclasses

    def read(name: str) -> tuple[int, ...] | None:
        value = os.environ.get(name)
        return None if value is None else tuple(int(v) for v in value.split(",") if v.strip())

    timed, search = read("GPU_CHECK_LONG_TIMED"), read("GPU_CHECK_LONG_SEARCH")
    if timed is not None:
        mode = dataclasses.replace(mode, long_lengths=timed)
    if search is not None:
        mode = dataclasses.replace(mode, long_search=search)
    return mode


# The tiny model has 2 layers: checkpoint the first only, so the selective path runs; the
# search raises a simulated OOM above 256 tokens, so the OOM path runs too.
DRY = Mode(
    dry_run=True,
    model="tiny-qwen2",
    lengths=(128, 64),
    search=(128, 256, 512),
    warmup=1,
    timed=2,
    overrides=("trainer.checkpoint_layers=1",),
    fake_oom_above=256,
    budget_s=900.0,
    long_lengths=(256,),
    long_search=(384, 512),
)
# The long-context phases: one GPU (sp=1), every layer recomputed from an offloaded input,
# the MLP tiled (README "Long context"), planned for the same 24 GB card.
LONG_OVERRIDES = (
    "trainer.sequence_parallel=1",
    "trainer.tiled_mlp=on",
    "trainer.offload_activations=on",
    "trainer.checkpoint_layers=all",
)

METHODS = {
    "lora": ("qwen2.5-7b-4x4090-lora", "lora-all-linear"),
    "qlora": ("qwen2.5-7b-4x4090-qlora", "qlora-nf4"),
    "qwen35": ("qwen3.5-9b-4x4090-lora", "lora"),  # the Qwen3.5 phases: that experiment's LoRA
    # DPO with the lora phase's adapters, so its rows compare with SFT's at the same shapes
    "dpo": ("qwen2.5-7b-4x4090-dpo", "lora-all-linear"),
}
# In order of importance: a timeout loses the last ones. (phase, method, side, cap seconds)
PHASES = (
    ("lora-memtune", "lora", "memtune", 120),
    ("lora-baseline", "lora", "baseline", 90),
    ("qlora-baseline", "qlora", "baseline", 100),
    ("qlora-memtune", "qlora", "memtune", 200),  # ends with the 24 GB search
    ("long-qlora", "qlora", "long", 150),  # 32k timed, then longer under the 24 GB cap
    ("long-lora", "lora", "long", 120),
    # A DPO step on a row holding one pair (reference precomputed: the pass is timed too).
    ("dpo-memtune", "dpo", "memtune", 90),
    # One Qwen3-MoE sparse block at Qwen3-30B-A3B's width: memtune's loop over the routed
    # experts against transformers' grouped_mm (no experiment: run_phase dispatches on "moe").
    ("moe-block", "moe", "block", 60),
    # Qwen3.5 (hybrid) on packed rows, transformers' torch code for the Gated DeltaNet layers
    # (flash-linear-attention blocked in that process), then with flash-linear-attention
    # (its Triton kernels compile and autotune in the first step: a longer cap).
    ("qwen35-torch", "qwen35", "torch", 75),
    ("qwen35-fla", "qwen35", "fla", 100),
)
MIN_PHASE_S = 45  # kept for each later phase when a phase's deadline is set ...
LEFTOVER_PHASES = ("moe-block", "qwen35-torch", "qwen35-fla")
"""... except these: they run in what time the others leave (none is kept for them), so they
never shorten an earlier phase; alone: ``--phases moe-block`` or
``--phases qwen35-torch,qwen35-fla``."""


# ------------------------------------------------------------------ config and plan


def compose_cfg(
    mode: Mode, method: str, seq_len: int, extra: Sequence[str] = (), model: str | None = None
) -> Any:
    """memtune's RunConfig: the 4×4090 experiment of this method, on one rank, micro batch 1,
    global batch 1 (no accumulation), planned for a 24 GB card, never refused; ``model``:
    another model group than the mode's."""
    from memtune.config import compose, to_run_config

    experiment, peft = METHODS[method]
    overrides = [
        f"experiment={experiment}",
        f"model={model or mode.model}",
        f"peft={peft}",
        "launcher.num_ranks=1",
        "trainer.global_batch_size=1",
        f"data.max_seq_len={seq_len}",
        "logger=none",
        f"plan.device_gib={CAP_GIB}",
        "plan.enforce=false",
        *extra,
        *mode.overrides,
    ]
    return to_run_config(compose(overrides))


def at_length(cfg: Any, seq_len: int, counts: Any) -> Any:
    """``cfg`` at another sequence length, checkpoint_layers=auto resolved for it."""
    from memtune.memory.fit import resolve_checkpoint_layers

    cfg = copy.deepcopy(cfg)
    cfg.data.max_seq_len = seq_len
    return resolve_checkpoint_layers(cfg, counts)[0]


def plan_record(cfg: Any, counts: Any) -> dict[str, Any]:
    """The planner's rows; ``live_gib`` leaves out what torch's allocator never reports
    (fragmentation, the CUDA context), so it is what ``max_memory_allocated`` should read."""
    from memtune.memory.estimate import plan

    p = plan(cfg, counts)
    return {
        "total_gib": p.total_gib,
        "live_gib": sum(r.gib for r in p.rows if r.allocated and r.live),
        "fits": p.fits,
        "rows": [{"what": r.what, "gib": r.gib, "how": r.how} for r in p.rows],
    }


def baseline_plan(cfg: Any, counts: Any) -> dict[str, Any]:
    """The planner's nearest config to the baseline (it knows no run without DeepSpeed):
    ZeRO-2 on one rank, every layer checkpointed, the plain loss. Approximate by design."""
    cfg = copy.deepcopy(cfg)
    cfg.zero.stage = 2
    cfg.trainer.loss = "plain"
    cfg.trainer.checkpoint_layers = "all"
    return plan_record(cfg, counts)


# ------------------------------------------------------------------ the model


def torch_dtype(cfg: Any) -> Any:
    from memtune.rank.model import torch_dtype as dtype_of

    return dtype_of(cfg)


def build_base(cfg: Any, device: Any, attn: str) -> Any:
    """The architecture of ``cfg.model`` with random weights, built on ``device`` (or under
    ``zero.Init`` when a ``HfDeepSpeedConfig`` is alive: transformers checks that itself)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(cfg.model.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    config.use_cache = False
    torch.manual_seed(cfg.trainer.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype(cfg), attn_implementation=attn
        )
    model.config.use_cache = False  # as memtune.rank.model.load_base_model
    return model


def quantize_decoder(model: Any, quant: Any, device: Any) -> Any:
    """Every decoder ``nn.Linear`` → bitsandbytes ``Linear4bit`` quantized on ``device`` with
    ``quant``'s settings, as ``from_pretrained`` with that ``BitsAndBytesConfig`` leaves the
    model (the LM head stays unquantized there too)."""
    import bitsandbytes as bnb
    import torch

    settings = {
        "compress_statistics": quant.bnb_4bit_use_double_quant,
        "quant_type": quant.bnb_4bit_quant_type,
        "quant_storage": quant.bnb_4bit_quant_storage,
    }
    for layer in model.get_decoder().layers:
        for name, linear in list(layer.named_modules()):
            if not isinstance(linear, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=quant.bnb_4bit_compute_dtype,
                device="meta",
                **settings,
            )
            weight = bnb.nn.Params4bit(
                linear.weight.data, requires_grad=False, module=q, **settings
            )
            q.weight = weight.to(device)  # quantizes
            if linear.bias is not None:
                q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, attr, q)
    model.is_loaded_in_4bit = True  # what transformers' bnb quantizer sets; peft reads it
    model.config.quantization_config = quant
    gc.collect()
    empty_cache(device)
    return model


def user_qlora_config(cfg: Any) -> Any:
    """The BitsAndBytesConfig of the usual QLoRA recipe (default uint8 storage)."""
    from transformers import BitsAndBytesConfig

    p = cfg.peft
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=p.quant_type,
        bnb_4bit_use_double_quant=p.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(cfg),
    )


def flops_per_step(counts: Any, arch: dict[str, Any], tokens: int) -> dict[str, float]:
    """Model FLOPs of one training step (recompute not counted, as MFU never counts it).

    N = weights that multiply activations: the decoder's linear layers and the LM head (the
    embedding is a lookup). Forward 2N per token. Backward: the base is frozen, so only the
    input gradient (2N per token) is needed, not the weight gradient: 4N per token in all,
    where full training takes 6N. LoRA adds 6 per adapter weight per token. Attention (no
    weights, causal): forward 2·T²·h per layer (QKᵀ and AV, half of T² each), backward twice
    that: 6·L·T²·h. ``six_n`` is the usual 6N convention on the same N, for comparison.
    """
    n = counts.linear + (counts.head or counts.embedding)
    h, layers = int(arch["hidden_size"]), int(arch["num_hidden_layers"])
    attention = 6 * layers * tokens**2 * h
    return {
        "n_matmul": n,
        "n_lora": counts.lora,
        "lora": (4 * n + 6 * counts.lora) * tokens + attention,
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


def synthetic_batch(vocab: int, seq_len: int, seed: int) -> dict[str, Any]:
    """One row of ``seq_len`` random tokens, every one labelled; micro batch 1, so neither side
    pads (padding's cost depends on the data: ``make bench-data`` measures it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def pair_batch(
    engine: Any, cfg: Any, vocab: int, seq_len: int, device: Any, rec: dict[str, Any]
) -> dict[str, Any]:
    """One row holding one preference pair of ``seq_len`` tokens (each sequence a prompt of a
    quarter of the row, then a reply of a quarter), its reference log-probabilities computed
    by memtune's own precompute (rank.reference.compute), whose time is recorded."""
    import torch

    from memtune.data.batching import TokenizedDataset, collate_packed
    from memtune.data.encode import IGNORE_INDEX, Sample
    from memtune.rank.reference import References, compute

    g = torch.Generator().manual_seed(seq_len)
    half, prompt = seq_len // 2, seq_len // 4
    ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
    ids[half : half + prompt] = ids[:prompt]  # both sequences share the prompt
    labels = [IGNORE_INDEX] * prompt + ids[prompt:half]
    labels += [IGNORE_INDEX] * prompt + ids[half + prompt :]
    pair = Sample(ids, labels, split=half, index=0)
    sync(device)
    t0 = time.perf_counter()
    table = compute(engine, TokenizedDataset.from_samples([pair]), [0], cfg, 0, device)
    sync(device)
    rec["reference_pass_s"] = round(time.perf_counter() - t0, 4)
    return References({"train": table}).attach(collate_packed([[pair]], 0))


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
    rec["plan_total_error_pct"] = 100 * (rec["plan"]["total_gib"] / used - 1)


# ------------------------------------------------------------------ one phase (a child process)


class Phase:
    """What a child process measures; writes its fragment after every measurement."""

    def __init__(self, mode: Mode, name: str, method: str, side: str, frag: Path, out: Path):
        self.mode, self.name, self.method, self.side = mode, name, method, side
        self.frag, self.out = frag, out
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {
            "phase": name,
            "method": method,
            "side": side,
            "records": [],
            "search": [],
            "errors": [],
            "notes": [],
        }

    def save(self) -> None:
        with self.lock:
            tmp = self.frag.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(self.frag)
            write_outputs(self.mode, self.frag.parent, self.out)

    def error(self, where: str, err: BaseException) -> None:
        import traceback

        text = "".join(traceback.format_exception_only(type(err), err)).strip()
        print(f"gpu_check: {self.name}: {where}: {text}", flush=True)
        traceback.print_exc()
        self.data["errors"].append({"where": where, "error": text[-2000:]})
        self.save()

    def add(self, rec: dict[str, Any]) -> None:
        self.data["records"].append(rec)
        self.save()
        tps = rec.get("tokens_per_s")
        peak = rec.get("measured_gib")
        print(
            f"gpu_check: {self.name} {rec['seq_len']}: "
            + (f"{tps:,.0f} tokens/s" if tps else "no timing")
            + (f", peak {peak:.2f} GiB" if peak is not None else "")
            + (f", plan error {rec['plan_error_pct']:+.1f}%" if "plan_error_pct" in rec else ""),
            flush=True,
        )


def run_phase(args: argparse.Namespace) -> int:
    mode = lengths_from_env(DRY if args.dry_run else GPU)
    name = args.phase
    _, method, side, _ = next(p for p in PHASES if p[0] == name)
    phase = Phase(mode, name, method, side, Path(args.fragment), Path(args.out))
    deadline = args.deadline

    def expire() -> None:
        with contextlib.suppress(Exception):
            phase.data["errors"].append(
                {"where": "deadline", "error": "phase stopped: out of time"}
            )
            phase.save()
        print(f"gpu_check: {name}: out of time, stopping", flush=True)
        os._exit(124)

    watchdog = threading.Timer(max(1.0, deadline - time.time()), expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        if method == "moe":
            run_moe(phase, deadline)
        elif method == "qwen35":
            run_hybrid(phase, deadline, fla=side == "fla")
        elif side == "baseline":
            run_baseline(phase, deadline)
        else:
            run_memtune(phase, deadline, long=side == "long")
    except Exception as err:
        phase.error("phase", err)
        return 1
    finally:
        watchdog.cancel()
    return 0


def device_and_env(phase: Phase) -> Any:
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not phase.mode.dry_run:
        raise RuntimeError("no CUDA device: the GPU check needs one (--dry-run runs on CPU)")
    phase.data["env"] = environment(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        phase.data["env"]["matmul_tflops"] = matmul_tflops(device)
        gc.collect()
        empty_cache(device)
    phase.data["start_memory"] = memory_now(device)
    return device


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


def time_left(deadline: float, need_s: float) -> bool:
    return time.time() + need_s < deadline


def run_baseline(phase: Phase, deadline: float) -> None:
    """Trainer + peft, as ``bench/baseline.py`` sets them up, on a base built in memory."""
    from baseline import CountingTrainer, training_args
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import TrainerCallback, default_data_collator

    from memtune.memory.counts import count_params
    from memtune.rank.model import lora_config

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    cfg = compose_cfg(mode, method, mode.lengths[0])
    counts = count_params(cfg)
    leftover = memory_now(device).get("allocated_gib", 0.0)

    # The attention kernel is left to transformers' default, as users leave it (sdpa).
    base = build_base(cfg, device, "sdpa")
    if method == "qlora":
        base = quantize_decoder(base, user_qlora_config(cfg), device)
        # peft's recipe: freezes the base and upcasts every non-quantized weight to fp32.
        base = prepare_model_for_kbit_training(
            base,
            use_gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    model = get_peft_model(base, lora_config(cfg))
    phase.data["notes"].append(
        f"attention {model.config._attn_implementation}; base built in memory ({method})"
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not self.marks:
                sync(device)
                self.marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync(device)
            self.marks.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    for seq_len in mode.lengths:
        if not time_left(deadline, 20):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        rec: dict[str, Any] = {"side": "baseline", "method": method, "seq_len": seq_len}
        rec["leftover_gib"] = leftover
        try:
            steps = mode.warmup + mode.timed
            run_cfg = copy.deepcopy(cfg)
            run_cfg.data.max_seq_len = seq_len
            run_cfg.trainer.max_steps = steps
            batch = synthetic_batch(int(cfg.model.architecture["vocab_size"]), seq_len, seq_len)
            rows = [{k: v[0] for k, v in batch.items()} for _ in range(steps)]
            clock = StepClock()
            with tempfile.TemporaryDirectory() as tmp:
                trainer = CountingTrainer(
                    model=model,
                    args=training_args(run_cfg, Path(tmp)),
                    train_dataset=rows,
                    data_collator=default_data_collator,
                    callbacks=[clock],
                )
                with peak_window(device, rec):
                    trainer.train()
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            rec["real_tokens"] = trainer.counts["real_tokens"]
            rec["losses"] = clock.losses
            rec["checkpointed_layers"] = int(cfg.model.architecture["num_hidden_layers"])
            rec["loss_kind"] = "model's own (full logits)"
            rec["zero_stage"] = None
            add_mfu(rec, flops_per_step(counts, cfg.model.architecture, seq_len), device)
            rec["plan"] = baseline_plan(at_length(cfg, seq_len, counts), counts)
            rec["plan_note"] = "approximate: ZeRO-2, all layers checkpointed, plain loss"
            add_plan_error(rec)
            del trainer
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            phase.error(f"baseline {seq_len}", err)
        finally:
            gc.collect()
            empty_cache(device)
        phase.add(rec)
        if "error" in rec and is_oom_text(rec["error"]):
            break
    del model, base
    gc.collect()
    empty_cache(device)


def is_oom_text(text: str) -> bool:
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def init_one_rank(device: Any) -> None:
    """The environment ``deepspeed``/``torchrun`` give a rank, for a world of one."""
    from memtune.launcher.spawn import free_port, node_env
    from memtune.rank.worker import init_distributed

    world = {"RANK": "0", "LOCAL_RANK": "0", **node_env([0], free_port())}
    for key, value in world.items():
        if key != "CUDA_VISIBLE_DEVICES":  # the card the check was given stays its card
            os.environ.setdefault(key, value)

    init_distributed()


def run_memtune(phase: Phase, deadline: float, long: bool = False) -> None:
    """memtune's model, loss, optimizer, DeepSpeed engine and training loop, as
    ``memtune.rank.build.build_rank`` assembles them, on a base built in memory. ``long``:
    the long-context phase (LONG_OVERRIDES; the MLP re-tiled and the checkpointed layers'
    offload set again for every length)."""
    from memtune.config.deepspeed import build_ds_config
    from memtune.config.derive import checkpointed_layers
    from memtune.memory.counts import count_params
    from memtune.rank.build import build_rank
    from memtune.rank.layers import set_checkpointed_layers
    from memtune.rank.long_context import offload_checkpoints, tile_mlps
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.model import quantization_config
    from memtune.rank.telemetry import NullLogger

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    init_one_rank(device)
    lengths = mode.long_lengths if long else mode.lengths
    extra = LONG_OVERRIDES if long else ()
    if method == "dpo":  # a preference objective trains without LoRA dropout
        extra = ("peft.dropout=0.0",)
    first = (lengths or mode.long_search)[0]  # built for the first length it will run
    cfg0 = compose_cfg(mode, method, first, extra)
    counts = count_params(cfg0)
    cfg = at_length(cfg0, first, counts)
    ds_config = build_ds_config(cfg)
    leftover = memory_now(device).get("allocated_gib", 0.0)

    quant = quantization_config(cfg)

    built: dict[str, bool] = {}

    def load_base(c: Any, attn: str) -> Any:
        """The real architecture with random weights, in memory (nothing to download)."""
        base = build_base(c, device, attn)
        built["zero_init"] = any(hasattr(q, "ds_id") for q in base.parameters())
        return base if quant is None else quantize_decoder(base, quant, device)

    # The rank's parts exactly as memtune.worker builds them; only the base differs. A 4-bit
    # base is quantized here in memory, outside zero.Init (from_pretrained does that itself).
    parts = build_rank(
        cfg, ds_config, device, load_base=load_base, zero_init=quant is None and cfg.zero.stage == 3
    )
    engine, attn, loss_kind = parts.engine, parts.attention, parts.loss_kind
    model = parts.model
    zero_init = built["zero_init"]
    params = [q for q in model.parameters() if q.requires_grad]
    phase.data["notes"].append(
        f"attention {attn}; loss {loss_kind}; ZeRO-{cfg.zero.stage} on 1 rank; "
        f"{parts.optimizer_note}; base built under zero.Init: {zero_init}; LoRA weights "
        f"{params[0].dtype} after deepspeed.initialize; {len(params)} trainable tensors"
    )

    censused: list[bool] = []  # truthy once a census is taken

    def steps_at(seq_len: int, n_steps: int, rec: dict[str, Any]) -> Any:
        run_cfg = at_length(cfg0, seq_len, counts)
        k = checkpointed_layers(run_cfg)  # "all" under LONG_OVERRIDES
        set_checkpointed_layers(engine.module.model, k)  # as add_lora does
        if long:
            base = engine.module.model.get_base_model()
            rec["mlp_tiles"] = tile_mlps(base, seq_len)
            rec["offloaded_layers"] = offload_checkpoints(base, device)
        run_cfg.trainer.max_steps = n_steps
        rec["checkpointed_layers"] = k
        rec["plan"] = plan_record(run_cfg, counts)
        vocab = int(cfg.model.architecture["vocab_size"])
        if method == "dpo":
            batches = itertools.repeat(pair_batch(engine, run_cfg, vocab, seq_len, device, rec))
        else:
            batches = itertools.repeat(synthetic_batch(vocab, seq_len, seq_len))
        if mode.fake_oom_above is not None and seq_len > mode.fake_oom_above and rec.get("cap"):
            import torch

            raise torch.OutOfMemoryError(f"simulated OOM at {seq_len} tokens (dry run)")
        clock = step_clock(device)
        # the first one-step run of a long phase (its first length past the timed one) also
        # takes the allocator's census at its peak
        look = long and n_steps == 1 and not any(censused)
        censused.append(look)
        with (
            peak_window(device, rec),
            peak_census(device, rec) if look else contextlib.nullcontext(),
        ):
            result = train(engine, batches, run_cfg, device, NullLogger(), TrainResult(), clock)
        rec["losses"] = result.losses
        rec["real_tokens"] = result.input_tokens
        return clock

    for seq_len in lengths:
        if not time_left(deadline, 20):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        rec: dict[str, Any] = {"side": "memtune", "method": method, "seq_len": seq_len}
        rec.update(leftover_gib=leftover, loss_kind=loss_kind, zero_stage=cfg.zero.stage)
        try:
            clock = steps_at(seq_len, mode.warmup + mode.timed, rec)
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            add_mfu(rec, flops_per_step(counts, cfg.model.architecture, seq_len), device)
            add_plan_error(rec)
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            phase.error(f"memtune {seq_len}", err)
        finally:
            gc.collect()
            empty_cache(device)
        phase.add(rec)

    if long:
        search_cap(phase, deadline, device, steps_at, cfg0, counts, long=True)
    elif method == "qlora":
        search_cap(phase, deadline, device, steps_at, cfg0, counts)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


def search_cap(
    phase: Phase,
    deadline: float,
    device: Any,
    steps_at: Any,
    cfg0: Any,
    counts: Any,
    long: bool = False,
) -> None:
    """Longer and longer sequences under a 24 GB cap, one step each, until one fails.

    Ascending, stopping at the first OOM: an OOM inside a ZeRO-3 step can leave the engine's
    parameter state inconsistent, so nothing runs on it after one. The cap is applied to the
    allocator (``set_per_process_memory_fraction``) after the engine exists, and is 23.99 GiB
    less what lies outside the allocator (CUDA context, kernels), so the whole device use
    stays under a 24 GB card's memory.
    """
    import torch

    mode = phase.mode
    info: dict[str, Any] = {"cap_gib": CAP_GIB}
    if device.type == "cuda":
        gc.collect()
        empty_cache(device)
        now = memory_now(device)
        allocator_cap = CAP_GIB - now["outside_allocator_gib"]
        info.update(allocator_cap_gib=allocator_cap, before=now)
        torch.cuda.set_per_process_memory_fraction(allocator_cap / now["total_gib"], device)
    # What the planner says fits, for every length tried and beyond.
    planned = []
    lengths = mode.long_search if long else mode.search
    key = "long_" if long else ""
    for seq_len in lengths:
        p = plan_record(at_length(cfg0, seq_len, counts), counts)
        planned.append({"seq_len": seq_len, "total_gib": p["total_gib"], "fits": p["fits"]})
    info["planned"] = planned
    if long:
        from memtune.memory.fit import longest_sequence

        one = copy.deepcopy(cfg0)
        one.trainer.sequence_parallel = "1"
        n, how = longest_sequence(one, counts)
        info["planned_longest"], info["planned_longest_how"] = n, how
    phase.data[f"{key}search_info"] = info
    phase.data[f"{key}search"] = []
    phase.save()
    for seq_len in lengths:
        if not time_left(deadline, 15):
            phase.data["errors"].append({"where": f"search {seq_len}", "error": "out of time"})
            phase.save()
            break
        rec: dict[str, Any] = {"seq_len": seq_len, "cap": True}
        try:
            clock = steps_at(seq_len, 1, rec)
            rec["ok"] = True
            rec["step_s"] = clock.marks[-1] - clock.marks[0]
            rec.pop("plan", None)
        except Exception as err:
            rec.pop("plan", None)
            rec["ok"] = False
            rec["error"] = repr(err)[-500:]
            rec["oom"] = is_oom(err)
            print(f"gpu_check: search {seq_len}: {'OOM' if rec['oom'] else 'error'}", flush=True)
        phase.data[f"{key}search"].append(rec)
        phase.save()
        if not rec["ok"]:
            break
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)


# ------------------------------------------------------------------ Qwen3.5 (hybrid) phases

SAMPLE_SHARES = (0.33, 0.25, 0.2, 0.13)
"""A timed packed row of the Qwen3.5 phases: samples taking these shares of the row and one more
with the rest (4096 tokens: 1352, 1024, 819, 532 and 369), so four samples start mid-chunk of
the recurrence's 64-token chunks."""
CHECK_LENGTHS = (300, 77, 450, 190)
"""The packed = alone check: one row of these samples against each sample alone (boundaries
inside chunks, a sample shorter than a chunk, 1,017 tokens: quick even on the torch path)."""
LOSS_TOL = 0.01
LOGIT_TOL = 0.5
"""packed = alone holds when every sample's mean token loss (nats) in the packed row is within
LOSS_TOL of the same sample's alone and no logit is further than LOGIT_TOL from it. bf16 calls
of other shapes differ by rounding only; a leak from the previous sample shows in the logits
most (random weights leave the loss near ln(vocab) either way). Measured on CPU in bf16 on
the torch path: the tiny Qwen3.5 0.001 nats and 0.11, the random Qwen3.5-2B (24 layers)
0.0014 and 0.16; the same rows without their boundaries 0.040 and 7.4, 0.028 and 6.5 (the
check runs that control too and reports it: what a leak looks like on the model at hand)."""
NOT_INSTALLED_HERE = ("fla", "causal_conv1d")
"""The torch phase's process: transformers falls back to its own torch code for the conv and
the recurrence (it resolves these packages when its Qwen3.5 module is imported)."""


def block_imports(names: Sequence[str]) -> None:
    """Make ``names`` look not installed in this process: a ``None`` entry in ``sys.modules``
    makes ``import name`` (and of any submodule) raise ModuleNotFoundError and
    ``importlib.util.find_spec(name)`` return None, which is what transformers (at import) and
    ``memtune.linear_kernels.kernels`` reads. Must run before transformers is imported."""
    import importlib.util

    if "transformers" in sys.modules:
        raise RuntimeError("block_imports after transformers was imported: too late")
    for name in names:
        if any(m == name or m.startswith(f"{name}.") for m in sys.modules):
            raise RuntimeError(f"{name} is already imported")
        sys.modules[name] = None  # type: ignore[assignment]
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise RuntimeError(f"import {name} still works")
        assert importlib.util.find_spec(name) is None, name


def kernel_packages(blocked: bool) -> dict[str, Any]:
    """The Gated DeltaNet kernel packages' versions, and whether ``fla`` imports here (before
    transformers does it: an error in flash-linear-attention's own imports is recorded instead of
    being swallowed by transformers' fallback)."""
    import importlib.metadata as md

    info: dict[str, Any] = {}
    for dist in ("flash-linear-attention", "fla-core", "causal-conv1d", "triton"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    if blocked:
        info["fla_import"] = "blocked in this process"
        return info
    try:
        t0 = time.time()
        import fla.ops.gated_delta_rule  # noqa: F401  (fla, then its layers and models)

        info["fla_import"] = "ok"
        info["fla_import_s"] = round(time.time() - t0, 2)
    except ModuleNotFoundError as err:
        info["fla_import"] = f"not installed ({err})"
    except Exception as err:
        info["fla_import"] = f"failed: {type(err).__name__}: {err}"[:500]
    return info


def resolved_kernels(model: Any) -> dict[str, str]:
    """What transformers' Qwen3.5 module resolved its ``causal_conv1d_fn`` and
    ``torch_chunk_gated_delta_rule`` to at import (the ``implementation`` its fallback wrapper
    closes over): the package's function or its own torch code, by full name (the start-up
    line's ``memtune.linear_kernels.kernels`` names only the package)."""
    from memtune.linear_kernels import KERNEL_FUNCTIONS, resolved
    from memtune.rank.linear_attention import linear_attention_layers

    layers = linear_attention_layers(model)
    if not layers:
        return {"conv": "no linear-attention layer", "recurrence": "no linear-attention layer"}
    hf = sys.modules[type(layers[0]).__module__]
    out = {}
    for what, name in KERNEL_FUNCTIONS:
        impl = resolved(getattr(hf, name))
        out[what] = f"{impl.__module__}.{impl.__qualname__}"
    return out


def short_kernel(path: str) -> str:
    return "torch" if path.startswith("transformers.") else path.split(".")[0]


def random_samples(vocab: int, lengths: Sequence[int], seed: int) -> list[Any]:
    """Samples of random tokens, every one labelled (the collate unlabels each first token)."""
    import torch

    from memtune.data.encode import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        out.append(Sample(ids, list(ids)))
    return out


def packed_batch(vocab: int, seq_len: int, seed: int) -> tuple[dict[str, Any], list[int]]:
    """One packed row of ``seq_len`` tokens (:data:`SAMPLE_SHARES`), as the training loader
    gives it: ``PackedDataset`` over the samples, then ``collate_packed`` (``cu_seq_lens``,
    ``max_length``, restarting ``position_ids``, ``real_tokens``)."""
    from memtune.data.batching import PackedDataset, TokenizedDataset, collate_packed

    lengths = [round(seq_len * s) for s in SAMPLE_SHARES]
    lengths.append(seq_len - sum(lengths))
    rows = PackedDataset(
        TokenizedDataset.from_samples(random_samples(vocab, lengths, seed)), seq_len
    )
    assert len(rows) == 1, rows.bins
    return collate_packed([rows[0]], pad_token_id=0), [len(s.input_ids) for s in rows[0]]


def packed_equals_alone(model: Any, device: Any, vocab: int, seed: int = 7) -> dict[str, Any]:
    """tests/test_linear_attention.py's check, at the phase's precision and kernels: a row of
    :data:`CHECK_LENGTHS` samples packed as the loader packs them gives each sample the mean
    token loss and logits it has alone (within :data:`LOSS_TOL`, :data:`LOGIT_TOL`); and the
    same row without its boundaries
    (positions restarting only: what a leak looks like on this model), for comparison.
    Forward only, no dropout (eval mode)."""
    import torch

    from memtune.data.batching import collate_packed
    from memtune.rank.loss import model_inputs, token_loss_sum

    batch = collate_packed([random_samples(vocab, CHECK_LENGTHS, seed)], pad_token_id=0)
    ids = batch["input_ids"].to(device)
    positions = batch["position_ids"].to(device)
    cu = batch["cu_seq_lens"].to(device)
    spans = list(itertools.pairwise(batch["cu_seq_lens"].tolist()))

    def mean_loss(logits: Any, a: int, b: int) -> float:
        """Sample ``ids[a:b]``'s mean next-token loss from its ``b - a`` logits."""
        return float(token_loss_sum(logits, ids[:, a:b])) / (b - a - 1)

    def max_diff(x: Any, y: Any) -> float:
        return float((x.float() - y.float()).abs().max())

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = model_inputs(ids, None, positions, cu, batch["max_length"].to(device))
            packed = model(**inputs).logits
            leak = model(**model_inputs(ids, None, positions)).logits
            samples = []
            for a, b in spans:
                alone = model(**model_inputs(ids[:, a:b], None, positions[:, a:b])).logits
                samples.append(
                    {
                        "tokens": b - a,
                        "alone": mean_loss(alone, a, b),
                        "packed": mean_loss(packed[:, a:b], a, b),
                        "no_bounds": mean_loss(leak[:, a:b], a, b),
                        "packed_max_logit_diff": max_diff(packed[:, a:b], alone),
                        "no_bounds_max_logit_diff": max_diff(leak[:, a:b], alone),
                    }
                )
                del alone
    finally:
        model.train(training)
    worst = max(abs(s["packed"] - s["alone"]) for s in samples)
    worst_logit = max(s["packed_max_logit_diff"] for s in samples)
    control = max(abs(s["no_bounds"] - s["alone"]) for s in samples[1:])
    control_logit = max(s["no_bounds_max_logit_diff"] for s in samples[1:])
    ok = worst <= LOSS_TOL and worst_logit <= LOGIT_TOL
    return {
        "ok": ok,
        "lengths": list(CHECK_LENGTHS),
        "tolerance": {"loss": LOSS_TOL, "logit": LOGIT_TOL},
        "max_loss_diff": worst,
        "max_logit_diff": worst_logit,
        "no_bounds_max_loss_diff": control,
        "no_bounds_max_logit_diff": control_logit,
        "control_sees_leak": control_logit > LOGIT_TOL,
        "samples": samples,
        "dtype": str(packed.dtype),
        "summary": (
            f"packed = alone {'holds' if ok else 'FAILS'}: max |Δ mean loss| {worst:.4f} nats, "
            f"max |Δ logit| {worst_logit:.3f} (tolerances {LOSS_TOL}, {LOGIT_TOL}); without the "
            f"boundaries {control:.4f} and {control_logit:.3f}"
        ),
    }


def run_hybrid(phase: Phase, deadline: float, fla: bool) -> None:
    """Qwen3.5 (``mode.hybrid_model``, random weights) with the LoRA of the qwen3.5-9b
    experiment, trained by memtune's own parts (``build_rank``, ``train``) on packed rows with
    ``cu_seq_lens`` as the loader gives them, through memtune's per-sample path for the Gated
    DeltaNet layers (memtune.rank.linear_attention). ``fla``: with flash-linear-attention's
    kernels, else with transformers' torch code (flash-linear-attention blocked here)."""
    mode = phase.mode
    rec: dict[str, Any] = {
        "phase": phase.name,
        "model": mode.hybrid_model,
        "seq_len": mode.hybrid_len,
        "wanted": "flash-linear-attention" if fla else "torch (fla blocked)",
    }
    phase.data["hybrid"] = rec
    if not fla:
        block_imports(NOT_INSTALLED_HERE)
    rec["packages"] = kernel_packages(blocked=not fla)
    phase.save()
    if fla and rec["packages"]["fla_import"] != "ok":
        note = f"flash-linear-attention: {rec['packages']['fla_import']}"
        rec["skipped"] = note
        phase.data["notes"].append(note)
        if not mode.dry_run:
            phase.save()
            print(f"gpu_check: {phase.name}: {note}; nothing to measure", flush=True)
            return
        phase.data["notes"].append("dry run: the torch path runs in its place (code paths only)")

    from memtune.config.deepspeed import build_ds_config
    from memtune.linear_kernels import kernels
    from memtune.memory.counts import count_params
    from memtune.rank.build import build_rank
    from memtune.rank.linear_attention import linear_attention_layers
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    t0 = time.time()
    device = device_and_env(phase)
    init_one_rank(device)
    seq_len = mode.hybrid_len
    cfg0 = compose_cfg(mode, "qwen35", seq_len, model=mode.hybrid_model)
    counts = count_params(cfg0)
    cfg = at_length(cfg0, seq_len, counts)
    leftover = memory_now(device).get("allocated_gib", 0.0)
    parts = build_rank(
        cfg,
        build_ds_config(cfg),
        device,
        load_base=lambda c, attn: build_base(c, device, attn),
        zero_init=cfg.zero.stage == 3,
    )
    engine, model = parts.engine, parts.model
    rec.update(
        kernels=kernels(linear_attention_layers(model)[0]),
        linear_attention=parts.linear_attention,
        resolved=resolved_kernels(model),
        attention=parts.attention,
        loss_kind=parts.loss_kind,
        zero_stage=cfg.zero.stage,
        checkpointed_layers=int(cfg.trainer.checkpoint_layers),
        leftover_gib=leftover,
        lora=f"r={cfg.peft.r} on {cfg.peft.target}; {parts.trainable:,} trainable",
        seconds={"build": round(time.time() - t0, 1)},
    )
    phase.data["notes"].append(
        f"{mode.hybrid_model}: {parts.linear_attention}; transformers calls "
        f"{rec['resolved']['recurrence']} and {rec['resolved']['conv']}; attention "
        f"{parts.attention}; ZeRO-{cfg.zero.stage}; {rec['lora']}"
    )
    phase.save()
    print(f"gpu_check: {phase.name}: {rec['kernels']}; {rec['resolved']}", flush=True)
    uses_fla = short_kernel(rec["resolved"]["recurrence"]) == "fla"
    if fla and not mode.dry_run and not uses_fla:
        raise RuntimeError(f"fla imports but transformers did not pick it up: {rec['resolved']}")
    if not fla and uses_fla:
        raise RuntimeError(f"fla was blocked but transformers calls {rec['resolved']}")

    vocab = int(cfg.model.architecture["vocab_size"])
    t0 = time.time()
    try:
        rec["check"] = packed_equals_alone(model, device, vocab)
        print(f"gpu_check: {phase.name}: {rec['check']['summary']}", flush=True)
        if not rec["check"]["ok"]:
            phase.data["errors"].append(
                {"where": "packed = alone", "error": rec["check"]["summary"]}
            )
    except Exception as err:
        rec["check"] = {"error": repr(err)[-2000:]}
        phase.error("packed = alone", err)
    finally:
        gc.collect()
        empty_cache(device)
    rec["seconds"]["check"] = round(time.time() - t0, 1)
    phase.save()

    if not time_left(deadline, 15):
        phase.data["errors"].append({"where": "steps", "error": "skipped: out of time"})
        phase.save()
        return

    def save_steps(marks: list[float]) -> None:
        """Each step's time saved as it ends (a timeout keeps the first ones, the first with
        Triton's compile and autotune when fla runs)."""
        rec["step_s"] = [round(b - a, 4) for a, b in itertools.pairwise(marks)]
        phase.save()

    try:
        batch, rec["samples"] = packed_batch(vocab, seq_len, seed=seq_len)
        run_cfg = copy.deepcopy(cfg)
        run_cfg.trainer.max_steps = mode.warmup + mode.timed
        rec["plan"] = plan_record(run_cfg, counts)
        t0 = time.time()
        clock = step_clock(device, save_steps)
        with peak_window(device, rec):
            result = train(
                engine, itertools.repeat(batch), run_cfg, device, NullLogger(), TrainResult(), clock
            )
        rec["seconds"]["steps"] = round(time.time() - t0, 1)
        rec["losses"] = result.losses
        rec["real_tokens"] = result.input_tokens
        rec.update(timing(clock.marks, mode.warmup, int(batch["real_tokens"])))
        rec["first_step_s"] = rec["step_s"][0]
        add_plan_error(rec)
    except Exception as err:
        rec["error"] = repr(err)[-2000:]
        phase.error(f"steps {seq_len}", err)
    finally:
        gc.collect()
        empty_cache(device)
    phase.save()
    tps, peak = rec.get("tokens_per_s"), rec.get("measured_gib")
    print(
        f"gpu_check: {phase.name} {seq_len}: "
        + (f"{tps:,.0f} tokens/s" if tps else "no timing")
        + (f", peak {peak:.2f} GiB" if peak is not None else "")
        + (f", plan error {rec['plan_error_pct']:+.1f}%" if "plan_error_pct" in rec else ""),
        flush=True,
    )
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


# ------------------------------------------------------------------ the MoE block phase

MOE_SHAPE = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
)
"""Qwen3-30B-A3B's sparse block at its full width (conf/model/qwen3-30b-a3b.yaml); the dry run
takes bench/moe_bench.py's reduced SHAPE (half the width, 64 experts), which a CPU can step."""
MOE_VARIANTS = (
    "memtune",
    "peft-grouped_mm",
    "frozen-memtune",
    "frozen-grouped_mm",
    "memtune-nf4",
    "memtune-int8",
    "memtune-loop",
)
"""In order of importance (a deadline loses the last ones): memtune's LoRA on the experts
against peft's over transformers' one-kernel grouped_mm, then the same without adapters (what
``peft.target=all-linear-but-experts`` runs), then memtune over quantized stacks, then
memtune's loop over the experts (the forward where torch has no grouped_mm)."""
MOE_R, MOE_SCALING = 16, 2.0  # LoRA r=16, alpha 32, as bench/moe_bench.py
MOE_TIMED = 5
"""Timed steps a variant on the GPU (after ``mode.warmup``): a step is tens of milliseconds
there, so more than the model phases' 3 for a steadier median; the dry run times one (a step
of the reduced block takes seconds on a CPU, and its numbers mean nothing)."""
MOE_VARIANT_S = 8.0
"""Time a variant needs at the least (build, quantize, warm-up, steps); a variant starts only
with that (or 1.5× the slowest so far) left before the phase's deadline."""
MIB = 1024**2


def moe_block(shape: dict[str, int], impl: str, device: Any, dtype: Any) -> Any:
    """transformers' ``Qwen3MoeSparseMoeBlock`` (router + fused expert stacks) of ``shape``,
    built on ``device`` in ``dtype`` (no fp32 copy on the way: 2.4 GB at full width), random
    weights (normal, std 0.02), frozen; ``impl``: its experts implementation."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config: Any = AutoConfig.for_model(
        "qwen3_moe",
        **shape,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=3072,
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            block = Qwen3MoeSparseMoeBlock(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.02)
    return block.requires_grad_(False)


def moe_variant(variant: str, shape: dict[str, int], device: Any, dtype: Any) -> tuple[Any, str]:
    """The block of one :data:`MOE_VARIANTS` entry, ready to step, and a note on what it holds.

    memtune's adapters are made in the block's dtype (DeepSpeed's bf16 leaves them so), peft's
    too (``autocast_adapter_dtype=False``; its default would keep them fp32): the variants
    differ in how the experts compute, not in the adapters' precision."""
    import torch

    from memtune.expert_stacks import EXPERT_PARAMETERS, experts_state
    from memtune.rank.experts import add_expert_lora, quantize_experts, use_routed_forward

    frozen = variant.startswith("frozen-")
    impl = "grouped_mm" if variant.endswith("grouped_mm") else "eager"  # memtune: its own forward
    block = moe_block(shape, impl, device, dtype)
    notes = []
    if "memtune" in variant:
        quant = variant.split("-")[1] if variant.startswith("memtune-") else None
        quant = quant if quant in ("nf4", "fp4", "int8") else None
        if quant:
            stacks = quantize_experts(block, quant, dtype)
            if stacks != len(EXPERT_PARAMETERS):
                raise RuntimeError(f"quantize_experts found {stacks} stacks in the block")
            for name in EXPERT_PARAMETERS:  # a stack left off the device would be a bug
                param = getattr(block.experts, name)
                if param.device != device:
                    notes.append(f"{name} left on {param.device}")
                    param.data = param.data.to(device)  # the same Parameter: its layout stays
            if notes:
                notes = [f"quantize_experts: {', '.join(notes)}; moved to {device}"]
        if frozen:
            use_routed_forward(block)
        else:
            add_expert_lora(block, MOE_R, MOE_SCALING, dtype=dtype)
        if variant == "memtune-loop":
            experts_state(block.experts).grouped = False
    elif not frozen:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=MOE_R,
            lora_alpha=int(MOE_R * MOE_SCALING),
            target_modules=[],
            target_parameters=[f"mlp.experts.{p}" for p in EXPERT_PARAMETERS],
            lora_dropout=0.0,
        )
        wrapper = torch.nn.ModuleDict({"mlp": block})  # peft's names: mlp.experts.<stack>
        peft_model: Any = get_peft_model(wrapper, lora, autocast_adapter_dtype=False)
        block = peft_model.base_model.model["mlp"]
    weights = sum(p.numel() * p.element_size() for p in block.parameters()) / MIB
    notes.append(f"weights {weights:,.0f} MiB")
    return block, "; ".join(notes)


def time_moe(block: Any, x: Any, steps: int, device: Any) -> list[float]:
    """``steps`` forward + backward passes (the input's gradient and the adapters'), each timed
    between device syncs."""
    marks = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        sync(device)
        marks.append(time.perf_counter() - t0)
    return marks


def run_moe(phase: Phase, deadline: float) -> None:
    """One Qwen3-MoE sparse block, forward + backward on 1 × ``mode.moe_tokens`` tokens, for
    each of :data:`MOE_VARIANTS` in turn in this process (each built, timed and freed before
    the next, so the phase stays short): memtune runs a Python loop over the experts, each on
    its routed tokens, which on a GPU may be bound by kernel launches where grouped_mm is one
    kernel; this is where that shows. A variant that fails is recorded and the next runs;
    the fragment is saved after each (what survives a timeout)."""
    import torch

    mode = phase.mode
    device = device_and_env(phase)
    if mode.dry_run:
        from moe_bench import SHAPE

        shape = dict(SHAPE)
    else:
        shape = dict(MOE_SHAPE)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens = mode.moe_tokens
    timed = 1 if mode.dry_run else MOE_TIMED  # the dry run: code paths, on a shared CPU
    info: dict[str, Any] = {
        "shape": dict(shape),
        "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "warmup": mode.warmup,
        "timed": timed,
        "lora": f"r={MOE_R}, scaling {MOE_SCALING}",
        "rows": [],
    }
    phase.data["moe"] = info
    phase.save()
    slowest = 0.0
    for variant in MOE_VARIANTS:
        row: dict[str, Any] = {
            "variant": variant,
            "tokens": tokens,
            "step_ms": None,
            "tokens_per_s": None,
            "peak_mib": None,
            "trainable": None,
            "error": None,
        }
        if not time_left(deadline, max(MOE_VARIANT_S, 1.5 * slowest)):
            row["error"] = "skipped: out of time"
            info["rows"].append(row)
            phase.data["errors"].append({"where": f"moe {variant}", "error": row["error"]})
            phase.save()
            continue
        t0 = time.time()
        block = x = None
        try:
            block, row["note"] = moe_variant(variant, shape, device, dtype)
            row["trainable"] = sum(p.numel() for p in block.parameters() if p.requires_grad)
            torch.manual_seed(1)
            x = torch.randn(1, tokens, shape["hidden_size"], device=device, dtype=dtype)
            x.requires_grad_(True)  # the layers below need the input's gradient
            before = 0
            if device.type == "cuda":
                sync(device)
                gc.collect()
                empty_cache(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            steps = time_moe(block, x, mode.warmup + timed, device)
            if device.type == "cuda":
                row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / MIB
            median = statistics.median(steps[mode.warmup :] or steps[-1:])
            row.update(
                step_ms=1000 * median,
                tokens_per_s=tokens / median,
                steps_ms=[round(1000 * s, 2) for s in steps],
            )
        except Exception as err:
            row["error"] = repr(err)[-2000:]
            row["oom"] = is_oom(err)
            info["rows"].append(row)
            phase.error(f"moe {variant}", err)
        else:
            info["rows"].append(row)
        finally:
            del block, x
            gc.collect()
            empty_cache(device)
        row["seconds"] = round(time.time() - t0, 1)
        slowest = max(slowest, row["seconds"])
        phase.save()
        tps, peak = row["tokens_per_s"], row["peak_mib"]
        print(
            f"gpu_check: {phase.name} {variant}: "
            + (f"{tps:,.0f} tokens/s, {row['step_ms']:.1f} ms" if tps else "no timing")
            + (f", peak {peak:,.0f} MiB" if peak is not None else "")
            + f" ({row['seconds']:.1f} s)",
            flush=True,
        )


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


# ------------------------------------------------------------------ outputs


def load_fragments(work: Path) -> list[dict[str, Any]]:
    frags = []
    for name, *_ in PHASES:
        path = work / f"{name}.json"
        if path.is_file():
            with contextlib.suppress(json.JSONDecodeError):
                frags.append(json.loads(path.read_text()))
    return frags


def write_outputs(mode: Mode, work: Path, out: Path) -> dict[str, Any]:
    result = collect(mode, work)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("gpu_check.json", json.dumps(result, indent=2, default=str) + "\n"),
        ("gpu_check.md", markdown(result)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    return result


def collect(mode: Mode, work: Path) -> dict[str, Any]:
    frags = load_fragments(work)
    status_path = work / "status.json"
    status = json.loads(status_path.read_text()) if status_path.is_file() else {}
    env = next((f["env"] for f in frags if "env" in f), {})
    records = [r for f in frags for r in f["records"]]
    search = next((f for f in frags if f.get("search_info")), None)
    result = {
        "mode": asdict(mode),
        "env": env,
        "status": status,
        "constants": {
            "peak_tflops": PEAK_TFLOPS,
            "measured_ceiling_tflops": MEASURED_TFLOPS,
            "cap_gib": CAP_GIB,
        },
        "records": records,
        "comparison": compare(records),
        "search": search["search"] if search else [],
        "search_info": search.get("search_info") if search else None,
        "long": [
            {
                "phase": f["phase"],
                "method": f["method"],
                "info": f["long_search_info"],
                "search": f.get("long_search", []),
                "records": f["records"],
            }
            for f in frags
            if f.get("long_search_info")
        ],
        "hybrid": [f["hybrid"] for f in frags if f.get("hybrid")],
        "moe": next((f["moe"] for f in frags if f.get("moe")), None),
        "errors": [{"phase": f["phase"], **e} for f in frags for e in f["errors"]],
        "notes": {f["phase"]: f["notes"] for f in frags},
    }
    return result


def format_check(mode: Mode, work: Path) -> Path:
    """Dry run: fill the records with made-up GPU readings and render them, so the accounting
    and table branches only a CUDA device reaches run here too (never in the real outputs)."""
    from types import SimpleNamespace

    result = collect(mode, work)
    fake_gpu = SimpleNamespace(type="cuda")
    for i, r in enumerate(result["records"]):
        r.update(peak_allocated_gib=10.0 + i, peak_reserved_gib=11.0 + i)
        r.update(outside_allocator_gib=0.6, leftover_gib=0.1)
        add_mfu(r, {"lora": 1e15, "six_n": 1.4e15}, fake_gpu)
        add_plan_error(r)
        assert r["mfu"] > 0 and "plan_error_pct" in r, r
    for i, r in enumerate(result["hybrid"]):
        if "plan" in r:
            r.update(peak_allocated_gib=15.0 + i, peak_reserved_gib=16.0 + i)
            r.update(outside_allocator_gib=0.6, leftover_gib=0.1)
            add_plan_error(r)
            assert "plan_error_pct" in r, r
        r["resolved"] = {"conv": "transformers.x.causal_conv1d_fn", "recurrence": "fla.ops.x.f"}
    if result["moe"]:
        result["moe"].update(device="cuda:0", dtype="bfloat16")
        for i, r in enumerate(result["moe"]["rows"]):
            if r.get("step_ms"):
                r["peak_mib"] = 1000.0 + 100 * i
        result["moe"]["rows"].append(
            {"variant": "made-up", "tokens": 1, "error": "RuntimeError('made up (format check)')"}
        )
    for s in result["search"]:
        s.update(peak_allocated_gib=20.0, checkpointed_layers=28)
    made_up = [  # the allocator's history as _snapshot gives it: a census of its peak
        {
            "action": "alloc",
            "addr": 1,
            "size": 3 * GIB,
            "frames": [
                {"filename": "torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/x/memtune/rank/long_context.py", "line": 90, "name": "backward"},
            ],
        },
        {"action": "alloc", "addr": 2, "size": GIB, "frames": []},
        {"action": "free_completed", "addr": 2, "size": GIB},
        {"action": "alloc", "addr": 3, "size": GIB // 2, "frames": []},
    ]
    for lc in result["long"]:
        if lc["search"]:
            lc["search"][0]["census"] = census(made_up)
            assert abs(lc["search"][0]["census"]["peak_gib"] - 4.0) < 1e-9
            assert lc["search"][0]["census"]["rows"][0]["gib"] == 3.0
    if result["search_info"]:
        result["search_info"]["allocator_cap_gib"] = 23.4
    result["comparison"] = compare(result["records"])
    result["env"].update(gpu="FAKE GPU (format check)", gpu_total_gib=139.8, matmul_tflops=777.0)
    assert all("speedup" in c and "memory_ratio" in c for c in result["comparison"])
    text = markdown(result)
    assert not result["moe"] or "| memtune | " in text, "the MoE table did not render"
    path = work / "format_check.md"
    path.write_text(text)
    return path


def census_markdown(lc: dict[str, Any]) -> list[str]:
    """The allocator's census at the peak of the long phase's first one-step run."""
    rec = next((r for r in lc.get("search", []) if r.get("census")), None)
    if rec is None:
        return []
    c = rec["census"]
    if "error" in c:
        return ["", f"Census at {rec['seq_len']} tokens failed: {c['error']}"]
    lines = [
        "",
        f"What the step at {rec['seq_len']} tokens had allocated at its peak "
        f"({c['peak_gib']:.2f} GiB above what existed before it; {c['blocks']:,} blocks, "
        f"{c['events']:,} allocator events; the allocator's history, grouped by the innermost "
        "frame ← the innermost frame of memtune, transformers, peft, bitsandbytes or DeepSpeed):",
        "",
        "| GiB | blocks | allocated in |",
        "|---:|---:|---|",
    ]
    for r in c["rows"]:
        lines.append(f"| {r['gib']:.3f} | {r['count']} | {r['where'].replace('|', '/')} |")
    lines.append(f"| {c['rest_gib']:.3f} | | the rest |")
    return lines


def _search_row(tried: dict[str, Any], planned: dict[str, Any], middle: str) -> str:
    """One row of a search under the cap: measured (if tried) next to planned."""
    ok = {True: "yes", False: "OOM" if tried.get("oom") else "error"}.get(tried.get("ok"), "—")
    return (
        f"| {planned['seq_len']} | {ok} | {_f(tried.get('peak_allocated_gib'), '.2f')} "
        f"| {_f(tried.get('step_s'), '.2f')} | {middle} | {planned['total_gib']:.2f} "
        f"| {'yes' if planned['fits'] else 'no'} |"
    )


def compare(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    by = {(r["method"], r["seq_len"], r["side"]): r for r in records}
    for (method, seq_len, side), m in by.items():
        b = by.get((method, seq_len, "baseline"))
        if side != "memtune" or b is None:
            continue
        row: dict[str, Any] = {"method": method, "seq_len": seq_len}
        if m.get("tokens_per_s") and b.get("tokens_per_s"):
            row["speedup"] = m["tokens_per_s"] / b["tokens_per_s"]
        if m.get("measured_gib") and b.get("measured_gib"):
            row["memory_ratio"] = m["measured_gib"] / b["measured_gib"]
        rows.append(row)
    return rows


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _pct(x: Any) -> str:
    return "—" if x is None else f"{x:+.1f}%"


def markdown(result: dict[str, Any]) -> str:
    env, mode = result["env"], result["mode"]
    gpu = env.get("gpu", "no GPU (dry run on CPU)")
    lines = [
        f"### GPU check, {env.get('date', dt.date.today().isoformat())}, {gpu}",
        "",
        (
            "**Dry run on CPU with the tiny model: checks that every code path runs; "
            "no number below means anything.**\n"
            if mode["dry_run"]
            else ""
        ),
        f"Model `{mode['model']}` (random weights), one rank, micro batch 1, every token "
        f"labelled; {mode['warmup']} warm-up + {mode['timed']} timed steps (median). "
        + ", ".join(
            f"{k} {env[k]}"
            for k in ("python", "torch", "torch_cuda", "transformers", "peft", "deepspeed")
            if k in env
        )
        + (f", bitsandbytes {env['bitsandbytes']}" if "bitsandbytes" in env else "")
        + (f"; {env['gpu_total_gib']:.1f} GiB" if "gpu_total_gib" in env else "")
        + (
            f"; bf16 matmul 8192³ {env['matmul_tflops']:.0f} TFLOP/s at the start"
            if "matmul_tflops" in env
            else ""
        )
        + ".",
        "",
        "| method | tokens | side | tokens/s | step s | peak GiB | plan GiB | plan err | "
        "MFU | MFU 6N | ckpt layers | loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(result["records"], key=lambda r: (r["method"], -r["seq_len"], r["side"])):
        plan = r.get("plan", {})
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else r.get("error", "—")[:60]
        lines.append(
            f"| {r['method']} | {r['seq_len']} | {r['side']} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_s_median'), '.3f')} | {_f(r.get('measured_gib'), '.2f')} "
            f"| {_f(plan.get('live_gib'), '.2f')} | {_pct(r.get('plan_error_pct'))} "
            f"| {_f(r.get('mfu'), '.1%')} | {_f(r.get('mfu_6n'), '.1%')} "
            f"| {_f(r.get('checkpointed_layers'), 'd')} | {loss} |"
        )
    # The first length's first loss is ln 2 (0.6931): the adapter has not moved yet.
    for r in result["records"]:
        if r.get("reference_pass_s") is not None:
            step = r.get("step_s_median")
            lines += [
                "",
                f"DPO at {r['seq_len']} tokens (one pair per row): the reference pass took "
                f"{r['reference_pass_s']:.3f} s for the row (memtune's precompute, once per pair "
                "before training; at the first length the first loss is ln 2 = 0.6931)"
                + (f"; a training step {step:.3f} s" if step else "")
                + (f"; first loss {r['losses'][0]:.4f}" if r.get("losses") else "")
                + ".",
            ]
    if result["comparison"]:
        lines += ["", "| method | tokens | memtune / baseline tokens/s | memtune / baseline peak |"]
        lines.append("|---|---:|---:|---:|")
        for c in result["comparison"]:
            lines.append(
                f"| {c['method']} | {c['seq_len']} | {_f(c.get('speedup'), '.2f')}× "
                f"| {_f(c.get('memory_ratio'), '.2f')}× |"
            )
    info = result.get("search_info")
    if info:
        cap = info.get("allocator_cap_gib")
        lines += [
            "",
            f"Longest QLoRA sequence with memtune under a {info['cap_gib']} GiB card"
            + (f" (allocator capped at {cap:.2f} GiB: the rest is the CUDA context)" if cap else "")
            + ", one step each, ascending, stopping at the first failure:",
            "",
            "| tokens | fits | peak GiB | step s | ckpt layers | plan total GiB | plan fits |",
            "|---:|:---:|---:|---:|---:|---:|:---:|",
        ]
        planned = {p["seq_len"]: p for p in info.get("planned", [])}
        tried = {s["seq_len"]: s for s in result["search"]}
        for seq_len, p in planned.items():
            s = tried.get(seq_len, {})
            lines.append(_search_row(s, p, _f(s.get("checkpointed_layers"), "d")))
        fits = [s["seq_len"] for s in result["search"] if s.get("ok")]
        plan_fits = [p["seq_len"] for p in info.get("planned", []) if p["fits"]]
        lines += [
            "",
            f"Measured: longest that fits {max(fits) if fits else 'none of those tried'}; "
            f"planner: {max(plan_fits) if plan_fits else 'none'}.",
        ]
    for lc in result.get("long", []):
        info = lc["info"]
        lines += [
            "",
            f"Long context, {lc['method']} on one GPU under a {info['cap_gib']} GiB card "
            "(sp=1, MLP tiled, every layer recomputed from an input offloaded to pinned host "
            "memory), one step each, ascending, stopping at the first failure:",
            "",
            "| tokens | fits | peak GiB | step s | tokens/s | plan total GiB | plan fits |",
            "|---:|:---:|---:|---:|---:|---:|:---:|",
        ]
        for r in lc["records"]:
            lines.append(
                f"| {r['seq_len']} (timed) | {'error' if r.get('error') else 'yes'} "
                f"| {_f(r.get('measured_gib'), '.2f')} | {_f(r.get('step_s_median'), '.2f')} "
                f"| {_f(r.get('tokens_per_s'), ',.0f')} "
                f"| {_f((r.get('plan') or {}).get('total_gib'), '.2f')} | — |"
            )
        tried = {s["seq_len"]: s for s in lc["search"]}
        for p in info.get("planned", []):
            lines.append(_search_row(tried.get(p["seq_len"], {}), p, "—"))
        fits = [s["seq_len"] for s in lc["search"] if s.get("ok")]
        lines += [
            "",
            f"Measured: longest that fits {max(fits) if fits else 'none of those tried'}; "
            f"planner's longest: {info.get('planned_longest', 0):,} tokens "
            f"({info.get('planned_longest_how', '')}).",
        ]
        lines += census_markdown(lc)
    lines += moe_markdown(result.get("moe"))
    lines += hybrid_markdown(result["hybrid"], mode)
    lines += [
        "",
        "*peak GiB*: `torch.cuda.max_memory_allocated` over the steps (reset before them), less "
        "what was allocated before the model was built. *plan GiB*: the planner's rows less "
        "fragmentation and the CUDA context (what the allocator can see); *plan err* = plan / "
        "peak − 1 (baseline rows: the planner's nearest config, ZeRO-2 + plain loss, "
        "approximate). *MFU*: model FLOPs / step time / 989 TFLOP/s (H200 SXM dense bf16; "
        "~790 measured for a bf16 matmul, KINDS.md): (4·N + 6·N_lora)·T + 6·L·T²·h, N the "
        "decoder's linear weights and the LM head (frozen: forward 2N, input gradient 2N, no "
        "weight gradient), attention causal; recompute not counted. *MFU 6N*: the usual "
        "6·N·T + attention, for comparison.",
    ]
    status = result.get("status") or {}
    if status:
        lines += ["", "Phases: " + "; ".join(f"{k} {v}" for k, v in status.items()) + "."]
    if result["errors"]:
        lines += ["", "Errors:"]
        lines += [f"- {e['phase']} / {e['where']}: {e['error'][:300]}" for e in result["errors"]]
    return "\n".join(line for line in lines) + "\n"


def moe_markdown(moe: dict[str, Any] | None) -> list[str]:
    """The MoE block phase: one row a variant, then memtune's loop against grouped_mm."""
    if not moe:
        return []
    shape = moe["shape"]
    lines = [
        "",
        "#### Mixture-of-experts block",
        "",
        f"One `Qwen3MoeSparseMoeBlock` (transformers' class: router + fused expert stacks), not "
        f"a model: hidden {shape['hidden_size']}, {shape['num_experts']} experts of "
        f"{shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']}"
        + (" (Qwen3-30B-A3B's full width)" if shape == MOE_SHAPE else " (reduced)")
        + f", random weights (normal, std 0.02), {moe['dtype']} on {moe['device']}; "
        f"1 × {moe['tokens']} tokens a step, forward + backward (the input's gradient and the "
        f"adapters'); LoRA {moe['lora']} on every routed expert; {moe['warmup']} warm-up + "
        f"{moe['timed']} timed steps (median); the variants built and freed in turn in one "
        "process:",
        "",
        "| variant | tokens/s | step ms | peak MiB | note |",
        "|---|---:|---:|---:|---|",
    ]
    rows = {r["variant"]: r for r in moe["rows"]}
    for r in moe["rows"]:
        note = f"error: {r['error'][:120]}" if r.get("error") else r.get("note", "")
        if r.get("trainable"):
            note = f"{r['trainable']:,} trainable; {note}"
        lines.append(
            f"| {r['variant']} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_ms'), '.1f')} | {_f(r.get('peak_mib'), ',.0f')} | {note} |"
        )
    ratios = []
    for ours, theirs in (
        ("memtune", "peft-grouped_mm"),
        ("frozen-memtune", "frozen-grouped_mm"),
        ("memtune-nf4", "memtune"),
        ("memtune", "memtune-loop"),
    ):
        a, b = rows.get(ours, {}).get("tokens_per_s"), rows.get(theirs, {}).get("tokens_per_s")
        if a and b:
            ratios.append(f"{ours} / {theirs} {a / b:.2f}×")
    if ratios:
        lines += ["", "tokens/s: " + "; ".join(ratios) + "."]
    lines += [
        "",
        "*memtune*: rank.experts' forward, every expert on its routed rows in one grouped_mm "
        "a projection (adapters as x·Aᵀ·Bᵀ, grouped too; *memtune-loop*: the same as a Python "
        "loop over the experts); *peft-grouped_mm*: peft's `target_parameters` adapters "
        "(W + s·B·A built at every forward) over transformers' `grouped_mm` experts; "
        "*frozen-*: no adapters; *memtune-nf4 / -int8*: `quantize_experts` on the stacks, then "
        "memtune's adapters. *peak MiB*: `max_memory_allocated` over the steps less what was "
        "allocated before them (the block and the input): what the steps add.",
    ]
    return lines


def hybrid_markdown(recs: list[dict[str, Any]], mode: dict[str, Any]) -> list[str]:
    """The Qwen3.5 phases: one row each, then each one's packed = alone check."""
    if not recs:
        return []
    r0 = recs[0]
    samples = next((r["samples"] for r in recs if r.get("samples")), None)
    lines = [
        "",
        f"Qwen3.5 (hybrid: 3 of 4 layers Gated DeltaNet), `{r0['model']}` (random weights), "
        f"LoRA of `qwen3.5-9b-4x4090-lora` ({r0.get('lora', '?')}), "
        f"ZeRO-{r0.get('zero_stage', '?')} on one rank, loss {r0.get('loss_kind', '?')}, "
        f"attention {r0.get('attention', '?')}; one packed row of {r0['seq_len']} tokens a step"
        + (f" ({len(samples)} samples: {', '.join(map(str, samples))})" if samples else "")
        + f", cu_seq_lens as the loader gives them; {mode['warmup']} warm-up + {mode['timed']} "
        "timed steps (median); with flash-linear-attention the first step includes Triton "
        "compiling and autotuning what the packed = alone check before it did not run:",
        "",
        "| phase | recurrence / conv | tokens/s | step s | first step s | peak GiB | plan GiB "
        "| plan err | ckpt layers | packed = alone | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for r in recs:
        res = r.get("resolved")
        kernels = f"{short_kernel(res['recurrence'])} / {short_kernel(res['conv'])}" if res else "—"
        check = r.get("check") or {}
        ok = {True: "yes", False: "**NO**"}.get(check.get("ok"), "error" if check else "—")
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else r.get("error", "—")[:60]
        if r.get("skipped") and not r.get("resolved"):
            loss = r["skipped"][:80]
        lines.append(
            f"| {r['phase']} | {kernels} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_s_median'), '.3f')} | {_f(r.get('first_step_s'), '.2f')} "
            f"| {_f(r.get('measured_gib'), '.2f')} "
            f"| {_f((r.get('plan') or {}).get('live_gib'), '.2f')} "
            f"| {_pct(r.get('plan_error_pct'))} "
            f"| {_f(r.get('checkpointed_layers'), 'd')} | {ok} | {loss} |"
        )
    lines.append("")
    for r in recs:
        packages = dict(r.get("packages") or {})
        fla = packages.pop("fla_import", "?")
        took = packages.pop("fla_import_s", None)
        have = ", ".join(f"{k} {v}" for k, v in packages.items() if v)
        ran = "; the torch path ran in its place" if r.get("skipped") and r.get("resolved") else ""
        lines.append(
            f"- {r['phase']}: {r.get('kernels', '—')} (import fla: {fla}"
            + (f" in {took:.1f} s" if took is not None else "")
            + (f"; {have}" if have else "")
            + f"{ran}). {_check_line(r.get('check') or {})}"
            + (
                " Seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()) + "."
                if r.get("seconds")
                else ""
            )
        )
    lines += [""]
    lines.append(
        "*plan GiB* for these rows: the planner's live rows, which measure the Gated DeltaNet "
        "mixer on transformers' torch code (memory.counts.linear_mixer_bytes), so the fla row "
        "shows how far its kernels are below that."
    )
    return lines


def _check_line(check: dict[str, Any]) -> str:
    if "max_loss_diff" not in check:
        return f"Packed = alone: {check.get('error', 'not run')[:200]}."
    lengths = ", ".join(map(str, check["lengths"]))
    return (
        f"Packed = alone over samples of {lengths} tokens ({check['dtype']}): max |Δ mean loss| "
        f"{check['max_loss_diff']:.4f} nats, max |Δ logit| {check['max_logit_diff']:.3f} "
        f"(tolerances {check['tolerance']['loss']}, {check['tolerance']['logit']}); the same "
        "row without its boundaries: "
        f"{check['no_bounds_max_loss_diff']:.4f} and {check['no_bounds_max_logit_diff']:.3f}"
        + ("" if check["control_sees_leak"] else " (a leak would not show on this model)")
        + "."
    )


# ------------------------------------------------------------------ orchestration


def orchestrate(args: argparse.Namespace) -> int:
    mode = lengths_from_env(DRY if args.dry_run else GPU)
    start = time.time()
    deadline = start + (args.budget_s or mode.budget_s)
    out = Path(args.out)
    # Outside OUT: the device returns at most 8 files from there.
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "gpu_check_parts"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*.json"):
        old.unlink()
    phases = [p for p in PHASES if not args.phases or p[0] in args.phases.split(",")]
    status: dict[str, str] = {}
    write_outputs(mode, work, out)
    for i, (name, _method, _side, cap) in enumerate(phases):
        now = time.time()
        later = sum(1 for p in phases[i + 1 :] if p[0] not in LEFTOVER_PHASES)
        phase_deadline = min(
            now + (cap if not mode.dry_run else 600), deadline - MIN_PHASE_S * later
        )
        if phase_deadline - now < 20:
            status[name] = "skipped (out of time)"
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--phase",
            name,
            "--fragment",
            str(work / f"{name}.json"),
            "--out",
            str(out),
            "--deadline",
            str(phase_deadline),
            *(["--dry-run"] if mode.dry_run else []),
        ]
        print(f"gpu_check: {name}: starting ({phase_deadline - now:.0f} s at most)", flush=True)
        t0 = time.time()
        with subprocess.Popen(cmd, start_new_session=True) as child:
            try:
                code = child.wait(timeout=phase_deadline - now + 20)
                status[name] = f"exit {code} in {time.time() - t0:.0f} s"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.wait()
                status[name] = f"killed after {time.time() - t0:.0f} s"
        print(f"gpu_check: {name}: {status[name]}", flush=True)
        (work / "status.json").write_text(json.dumps(status))
        write_outputs(mode, work, out)
    status["total"] = f"{time.time() - start:.0f} s"
    (work / "status.json").write_text(json.dumps(status))
    result = write_outputs(mode, work, out)
    print((out / "gpu_check.md").read_text(), flush=True)
    if mode.dry_run:
        checked = format_check(mode, work)
        print(f"gpu_check: GPU-only branches rendered with made-up readings: {checked}")
    moe_rows = (result["moe"] or {}).get("rows", [])
    searched = [s for lc in result["long"] for s in lc["search"] if s.get("ok")]
    measured = (
        result["records"]
        or result["hybrid"]
        or any(r.get("step_ms") for r in moe_rows)
        or searched  # a long phase run for its census alone (GPU_CHECK_LONG_TIMED=)
    )
    return 0 if measured and not result["errors"] else 1


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: code paths only")
    default_out = os.environ.get("OUT") or str(Path(tempfile.gettempdir()) / "gpu_check_out")
    ap.add_argument("--out", default=default_out, help="default $OUT, else /tmp/gpu_check_out")
    ap.add_argument("--work", default=None, help="per-phase fragments (/tmp/gpu_check_parts)")
    ap.add_argument("--budget-s", type=float, default=None, help="all phases together")
    ap.add_argument("--phases", default=None, help="comma-separated subset, in PHASES order")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    # Deprecations raised inside DeepSpeed, peft and transformers on every step.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*is deprecated")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # the phases too
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the device machine has no network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.phase:
        return run_phase(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
