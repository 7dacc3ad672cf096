"""What a rank holds while it loads a quantized mixture, before its first step: the plan's
``loading:`` line (device and host peak). A mixture whose routed-expert stacks are quantized as
they are read holds, at the peak, the quantized model read so far and one stack in the compute
dtype with what quantizing it takes (rank.experts.experts_as_loaded), on the rank's GPU under
ZeRO-2 and ZeRO-3 alike; one in the compute dtype split by expert under ZeRO-3 holds the rest
of the base on the host while it is read. A dense quantized base under ZeRO-3 is read whole
onto each rank too, before DeepSpeed shards it (:func:`dense_quantized_loading_peak`). Every
other base loads no more than it keeps. Pure functions of the config, the decisions and the
parameter counts (:mod:`memtune.memory.counts`), like :mod:`memtune.memory.estimate`, whose
:class:`~memtune.memory.estimate.Plan` carries the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtune.config import RunConfig, compute_bytes
from memtune.config.architecture import moe_layers
from memtune.config.decisions import Decisions
from memtune.expert_stacks import expert_stack_bytes, experts_per_chunk
from memtune.memory.counts import ParamCounts

GIB = 1024**3


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


QUANTIZE_TEMPORARY_BYTES = {
    ("cpu", "nf4"): 12,
    ("cpu", "fp4"): 12,
    ("cpu", "int8"): 6.5,
    ("cuda", "nf4"): 0,
    ("cuda", "fp4"): 0,
    ("cuda", "int8"): 2,
}
"""Bytes per weight of a chunk of experts that quantizing it holds besides its input and its
output (rank.experts._quantized, expert_stacks.QUANTIZED_CHUNK_BYTES of weights at a time).
On a CPU, bitsandbytes quantizes 4-bit through torch code: the weights in fp32, scaled, then
their bucket indices as int32 (3 × 4 bytes); int8 through a float16 copy and fp32 row
temporaries: fitted to the live heap measured while tiny mixtures load (7.6 and 5.4 stacks
above the quantized model, tests/test_quantized_loading.py). On a GPU its CUDA kernels write
the packed values and the scales straight from the input (4-bit: none), int8 from the float16
copy memtune makes (2 bytes): read from the kernels, not measured."""


@dataclass
class LoadingPeak:
    """What a rank holds at the peak of loading a quantized mixture (rank.experts.
    experts_as_loaded): the quantized model read so far and one routed-expert stack
    in the compute dtype with what quantizing it takes; or a mixture split by expert under
    ZeRO-3, read on the host (:func:`loading_peak`); per rank."""

    device_gib: float
    """On the rank's device (a GPU; the host for CPU ranks)."""
    host_gib: float
    """In host memory, besides the checkpoint's pages in the page cache (file-backed, shared
    by the node's ranks, reclaimable)."""
    how: str


def loading_peak(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, whole: float, held: float
) -> LoadingPeak | None:
    """The loading peak of a mixture whose expert stacks are quantized as they are read, of
    one in the compute dtype split by expert under ZeRO-3, or of a dense quantized base under
    ZeRO-3 (:func:`dense_quantized_loading_peak`); None for anything else (a base in the
    compute dtype loads no more than it keeps). ``whole``: the base's bytes as
    this rank reads it (its own experts alone under expert parallelism); ``held``: a rank's
    share of them once DeepSpeed has them (the plan's base-weights row).

    One stack (gate_up, the larger: experts × 2·moe_intermediate × hidden) is in the compute
    dtype at a time: twice over while transformers merges a checkpoint that stores each expert
    apart (the stacked gate and up halves, then their concatenation; Qwen3-MoE's layout), then
    once while memtune quantizes it a chunk at a time, next to the chunk's temporaries
    (QUANTIZE_TEMPORARY_BYTES) and its quantized bytes, built then stored (2 copies).

    A quantized base is read onto the rank's device, replicated, the host holding one checkpoint
    tensor at a time: under ZeRO-2 (and on CPU ranks), and under ZeRO-3 too, where transformers
    cannot build it under zero.Init and bitsandbytes' quantizer gives a load without a
    ``device_map`` (rank.model.load_base_model passes none under ZeRO-3) the rank's GPU
    (transformers 5.24 ``quantizer_bnb_4bit`` / ``_8bit`` ``update_device_map``: ``{"":
    torch.cuda.current_device()}``); DeepSpeed shards it from there. Read on the host instead
    (``device_map={"": "cpu"}``) it would be quantized by bitsandbytes' CPU code, slower and
    with the temporaries above, and still reach each GPU whole: the engine moves a model that
    holds no ZeRO-3 parameter to the device before partitioning it, and converting it on the
    host first moves parameters' data only, not bitsandbytes' quantization state.

    Under ZeRO-3 with expert parallelism a base in the compute dtype is read into each rank's
    host memory (not under zero.Init, which would shard every expert over all the ranks:
    rank.expert_parallel): the rest of the base whole and its own 1/N of the experts
    (``whole`` counts them so), plus the one stack being read, whole, before its other experts
    are dropped: the merged halves of a per-expert checkpoint and their concatenation still
    there while this rank's experts are copied out of it (2 + 1/N stacks; measured 2.4 at N=2,
    tests/test_expert_parallel_matrix.py). rank.expert_parallel.partition_before_the_engine
    then makes it ZeRO-3's a parameter at a time: each moved to the GPU whole, this rank's
    partition kept, so the device holds ``held`` and the largest parameter (the embedding, the
    head or this rank's share of a gate_up stack) at most."""
    experts = d.experts
    if experts is None or not counts.experts:
        return dense_quantized_loading_peak(cfg, d, counts, whole)
    split_zero3 = experts.parallel > 1 and d.zero_stage == 3
    if experts.storage == "compute" and not split_zero3:
        return None
    layers = sum(moe_layers(dict(cfg.model.architecture))) or 1
    b = compute_bytes(cfg)
    weights = counts.experts * 2 / (3 * layers)  # gate_up: 2 of a layer's 3 projections
    stack = weights * b
    rows = counts.expert_rows * 2 / (3 * layers)
    quantized = expert_stack_bytes(experts.storage, round(weights), round(rows))
    cuda = cfg.plan.device_gib is not None
    out, inp = (
        2 * int(cfg.model.architecture["moe_intermediate_size"]),
        int(cfg.model.architecture["hidden_size"]),
    )
    per_expert = out * inp
    chunk = min(weights, experts_per_chunk(out, inp, b) * per_expert)
    temporaries = QUANTIZE_TEMPORARY_BYTES.get(("cuda" if cuda else "cpu", experts.storage), 0)
    temporaries *= chunk
    transient = max(2 * stack, stack + temporaries + 2 * quantized)
    zero3 = d.zero_stage == 3
    how = (
        f"the quantized base + one {_size(stack)} expert stack in {cfg.trainer.precision} "
        f"being merged and quantized ({_size(transient)} at most)"
    )
    if experts.storage == "compute":  # ZeRO-3 with expert parallelism (docstring)
        transient = (2 + 1 / experts.parallel) * stack
        how = (
            f"the base but the other ranks' experts + one {_size(stack)} expert stack "
            f"being merged and cut ({_size(transient)} at most)"
        )
    largest_read = max(counts.embedding, counts.head, weights) * b
    if cuda and zero3 and experts.storage == "compute":  # read on the host, then partitioned
        largest = max(counts.embedding, counts.head, weights / experts.parallel) * b
        how += ", on the host; on the device ZeRO-3's share, a parameter at a time"
        return LoadingPeak((held + largest) / GIB, (whole + transient) / GIB, how)
    if cuda:  # read onto the GPU, a checkpoint tensor at a time through the host (docstring)
        return LoadingPeak((whole + transient) / GIB, largest_read / GIB, how)
    return LoadingPeak((whole + transient) / GIB, (whole + transient) / GIB, how)


def dense_quantized_loading_peak(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, whole: float
) -> LoadingPeak | None:
    """A dense QLoRA or LLM.int8 base under ZeRO-3: transformers does not build a quantized
    model under zero.Init (modeling_utils: ``is_deepspeed_zero3_enabled() and not
    is_quantized``), so each rank reads the whole quantized base, onto its GPU (bitsandbytes'
    quantizer sets the device map to the current card) or, on CPU ranks, into its memory, and
    DeepSpeed's engine shards it afterwards: the plan's base-weights row is a rank's share, and
    loading holds all of it. On top: the linear weight being quantized (the largest, e.g.
    Qwen2.5-7B's 18,944 × 3,584 gate_proj) in the compute dtype, with bitsandbytes'
    temporaries (QUANTIZE_TEMPORARY_BYTES), the host holding one checkpoint tensor at a time
    on a GPU machine. None under ZeRO-2 (the base is kept whole anyway; one weight's
    transient is noise beside a step) and for a base in the compute dtype."""
    if d.zero_stage != 3 or d.peft_method == "lora":  # a base in the compute dtype
        return None
    kind = cfg.peft.quant_type if d.peft_method == "qlora" else "int8"
    cuda = cfg.plan.device_gib is not None
    b = compute_bytes(cfg)
    largest = max((i * o for _, i, o in counts.linear_shapes), default=0)
    temporaries = QUANTIZE_TEMPORARY_BYTES.get(("cuda" if cuda else "cpu", kind), 0)
    transient = largest * (b + temporaries)
    where = "each GPU" if cuda else "each rank"
    how = (
        f"the whole {kind} base on {where}, read outside zero.Init and then sharded by "
        f"ZeRO-3, + one {_size(largest * b)} linear weight in {cfg.trainer.precision} being "
        "quantized" + (f" ({_size(transient)} with its temporaries)" if temporaries else "")
    )
    read = max(counts.embedding, counts.head, largest) * b
    device = (whole + transient) / GIB
    return LoadingPeak(device, read / GIB if cuda else device, how)
