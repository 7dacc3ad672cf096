"""What a rank holds while it loads a quantized mixture, before its first step: the plan's
``loading:`` line (device and host peak). A mixture whose routed-expert stacks are quantized as
they are read holds, at the peak, the quantized model read so far and one stack in the compute
dtype with what quantizing it takes (rank.experts.experts_as_loaded); every other base
loads no more than it keeps. Pure functions of the config, the decisions and the parameter
counts (:mod:`memtune.memory.counts`), like :mod:`memtune.memory.estimate`, whose
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
    in the compute dtype with what quantizing it takes; per rank."""

    device_gib: float
    """On the rank's device (a GPU; the host for CPU ranks)."""
    host_gib: float
    """In host memory, besides the checkpoint's pages in the page cache (file-backed, shared
    by the node's ranks, reclaimable)."""
    how: str


def loading_peak(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, whole: float, held: float
) -> LoadingPeak | None:
    """The loading peak of a mixture whose expert stacks are quantized as they are read; None
    for anything else (a bf16 or dense base loads no more than it keeps). ``whole``: the
    quantized base's bytes, all of it; ``held``: a rank's share of them once DeepSpeed has
    them (the plan's base-weights row).

    One stack (gate_up, the larger: experts × 2·moe_intermediate × hidden) is in the compute
    dtype at a time: twice over while transformers merges a checkpoint that stores each expert
    apart (the stacked gate and up halves, then their concatenation; Qwen3-MoE's layout), then
    once while memtune quantizes it a chunk at a time, next to the chunk's temporaries
    (QUANTIZE_TEMPORARY_BYTES) and its quantized bytes, built then stored (2 copies).

    Under ZeRO-2 (and on CPU ranks) the base is read onto the rank's device, replicated. Under
    ZeRO-3 transformers reads a quantized base whole into each rank's host memory (it cannot
    build one under zero.Init) and DeepSpeed moves it to the devices in shards afterwards.

    Under ZeRO-3 with expert parallelism a base in the compute dtype loads that way too (not
    under zero.Init, which would shard every expert over all the ranks: rank.expert_parallel):
    each rank's host holds the rest of the base whole and its own 1/N of the experts (``whole``
    counts them so), plus the one stack being read, whole, before its other experts are
    dropped: the merged halves of a per-expert checkpoint and their concatenation still there
    while this rank's experts are copied out of it (2 + 1/N stacks; measured 2.4 at N=2,
    tests/test_expert_parallel_matrix.py)."""
    experts = d.experts
    if experts is None or not counts.experts:
        return None
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
    if cuda and not zero3:  # read onto the GPU, a checkpoint tensor at a time through the host
        return LoadingPeak((whole + transient) / GIB, largest_read / GIB, how)
    if cuda:  # ZeRO-3 on GPUs: whole on the host, then sharded onto the devices
        return LoadingPeak(held / GIB, (whole + transient) / GIB, how + ", on the host")
    return LoadingPeak((whole + transient) / GIB, (whole + transient) / GIB, how)
