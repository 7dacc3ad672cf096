"""A mixture of experts' routed-expert stacks as memtune holds them: which modules they are,
the LoRA adapters added to them, and the 4-bit format of a quantized stack. Shared by the ranks
(rank.experts: their forward, quantization and export) and the planner (memory.counts adds
the same adapters on the meta device), so it imports torch only inside its functions.

transformers 5 keeps a layer's routed experts as two fused 3-D parameters of one module
(``mlp.experts.gate_up_proj``: experts × 2·intermediate × hidden, ``mlp.experts.down_proj``:
experts × hidden × intermediate), not as ``nn.Linear`` layers, so LoRA by module name never
reaches them; memtune adds per-expert ``A[e]`` (r × in) and ``B[e]`` (out × r) to that module
(see rank.experts for why not peft's ``target_parameters``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused stacks of a transformers experts module, in the order the module registers them
(peft nests its wrappers in that order: the first is the innermost)."""

QUANT_BLOCK = 64
"""Weights per 4-bit block (one fp32 absmax each): bitsandbytes' blocksize for the stacks."""
QUANTIZED_CHUNK_BYTES = 128 * 2**20
"""What rank.experts' grouped forward dequantizes of a quantized stack at a time: the experts
whose weights in the compute dtype fill at most this (one at least). A transient next to the
step's saved tensors, in the forward and again in the backward (memory.estimate counts it, at
:func:`dequantized_bytes_per_weight`: more than the chunk itself for int8)."""


def experts_per_chunk(out: int, inp: int, itemsize: int) -> int:
    """Experts of an out × in stack that one dequantized chunk holds (QUANTIZED_CHUNK_BYTES)."""
    return max(1, QUANTIZED_CHUNK_BYTES // (out * inp * itemsize))


INT8_DEQUANT_SCALE = 7.874015718698502e-3
"""1/127 as bitsandbytes' int8_vectorwise_dequant multiplies by it (its default kernel's
constant, applied in fp32 after the row's absmax)."""


def int8_dequantized(values: Any, scales: Any, dtype: Any) -> Any:
    """int8 rows (``values``, rows × in) with their fp32 absmax (``scales``, one a row) as
    weights in ``dtype``: bit for bit ``bitsandbytes.functional.int8_vectorwise_dequant(values,
    scales).to(dtype)``, with fewer temporaries.

    bitsandbytes 0.50 registers no CUDA kernel for that op: its default, on every device, is
    ``A * stats.view(-1, 1) * 7.874015718698502e-3``, two fp32 copies alive at once and then
    the compute dtype's, 8 bytes a weight at the peak (bf16). Here one fp32 copy is scaled in
    place, the same two fp32 products in the same order (so the same roundings), then cast:
    :func:`dequantized_bytes_per_weight` counts it."""
    import torch

    out = values.to(torch.float32)
    out.mul_(scales.view(-1, 1))
    out.mul_(INT8_DEQUANT_SCALE)
    return out.to(dtype)


def dequantized_bytes_per_weight(kind: str, itemsize: int) -> int:
    """Bytes a weight that dequantizing a chunk of a ``kind`` stack (nf4, fp4, int8) into the
    compute dtype (``itemsize`` bytes) holds at its peak, the result included, besides the
    quantized stack it reads (rank.experts._dequantized_range; memory.estimate counts a chunk
    at this). int8 (:func:`int8_dequantized`): the fp32 copy (4 bytes) and the compute dtype's
    made from it (none in fp32: the cast returns the copy itself), 6 bytes in bf16 — measured
    on CPU tensors by torch's allocator events (tests/test_moe.py); torch ops alike on a GPU.
    4-bit: bitsandbytes' kernels (CUDA, and its CPU library's) write the compute dtype straight
    from the packed bytes."""
    if kind == "int8":
        return 4 if itemsize == 4 else 4 + itemsize
    return itemsize


EXPERT_NF4_BYTES = 0.5 + 4 / QUANT_BLOCK
"""Bytes per routed-expert weight when quantized: 4 bits and a block's fp32 scale (the scales
are not quantized again: peft.double_quant applies to the linear layers)."""


def expert_stack_bytes(kind: str, weights: int, rows: int) -> float:
    """Bytes of routed-expert stacks as rank.experts.quantize_experts stores them: ``weights``
    weights in ``rows`` rows (experts × out, every stack). nf4 / fp4: 4 bits a weight and an
    fp32 scale a block; int8: a byte a weight and an fp32 absmax a row."""
    if kind == "int8":
        return weights + rows * 4
    return weights * EXPERT_NF4_BYTES


@dataclass
class ExpertsState:
    """What memtune keeps on a routed-experts module, for rank.experts' forward: one attribute
    (:func:`experts_state`), not one per setting."""

    lora_scaling: float | None = None
    """The experts' adapters' scaling (:func:`add_expert_adapters`); None: no adapters, or
    switched off for the block (rank.experts.experts_off: a live reference's forward)."""
    grouped: bool = True
    """False runs the loop over the experts where torch's grouped_mm could run them all at
    once (benchmarks and tests compare the two)."""
    even_routing: bool = False
    """tools.step_trace: row j of the n × top-k routing goes to expert j mod experts, whatever
    the router chose (fake tensors cannot run the data-dependent split; rank.experts)."""
    shard: ExpertShard | None = None
    """Expert parallelism (rank.expert_parallel): the experts this rank holds of the layer's,
    and the ranks holding the others; None: every expert is here."""


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank of an expert-parallel group holds (rank.expert_parallel):
    experts ``first`` .. ``first + count - 1`` of ``total``, rank ``rank`` of ``size`` in
    ``group`` (a torch process group, which exchanges the tokens), every expert parameter
    tagged with DeepSpeed's expert group ``group_name``."""

    size: int
    rank: int
    total: int
    group: Any
    group_name: str

    @property
    def count(self) -> int:
        return self.total // self.size

    @property
    def first(self) -> int:
        return self.rank * self.count


def experts_state(experts: Any) -> ExpertsState:
    """The state of a routed-experts module, the one way to it: made on first use (by
    :func:`add_expert_adapters` or rank.experts.use_routed_forward, whichever comes first) and
    the same object after."""
    state = getattr(experts, "memtune_experts", None)
    if state is None:
        state = ExpertsState()
        experts.memtune_experts = state
    return state


@dataclass(frozen=True)
class QuantizedStack:
    """How rank.experts.quantize_experts stored a stack in its one frozen parameter (the
    parameter's ``memtune_quantized``, read through :func:`quantized_stack`)."""

    shape: tuple[int, ...]
    """The stack's full shape: experts × out × in."""
    kind: str
    """nf4, fp4 or int8."""
    scales_at: int
    """The byte where the fp32 scales start, after the quantized values."""
    code: Any = None
    """bitsandbytes' 4-bit code table (nf4 / fp4); None for int8."""


def quantized_stack(param: Any) -> QuantizedStack | None:
    """How ``param`` is quantized, when it is a stack quantize_experts made; else None."""
    return getattr(param, "memtune_quantized", None)


def expert_modules(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every module holding a fused routed-expert stack."""
    found = []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if all(p in own for p in EXPERT_PARAMETERS) and hasattr(module, "num_experts"):
            found.append((name, module))
    return found


def full_shape(param: Any) -> tuple[int, ...]:
    """A parameter's full shape, also of a ZeRO-3 partition, a 4-bit expert stack
    (rank.experts.quantize_experts) or a bitsandbytes 4-bit weight (stored packed)."""
    quantized = quantized_stack(param)
    if quantized is not None:
        return tuple(quantized.shape)
    state = getattr(param, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return tuple(state.shape)
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def full_numel(param: Any) -> int:
    """The weights a parameter holds in full (:func:`full_shape`)."""
    return math.prod(full_shape(param))


def stack_adapter(name: str) -> tuple[str, str, str] | None:
    """(experts module, stack, "A" or "B") of an expert adapter's parameter name
    (``…mlp.experts.gate_up_proj_lora_A``), None for any other name."""
    module, _, leaf = name.rpartition(".")
    stack, _, which = leaf.partition("_lora_")
    if stack in EXPERT_PARAMETERS and which in ("A", "B"):
        return module, stack, which
    return None


def add_expert_adapters(
    model: Any, r: int, scaling: float, init: str = "default", dtype: Any = None
) -> int:
    """Give every routed-expert stack of ``model`` a LoRA adapter of rank ``r`` per expert
    (``{stack}_lora_A``: experts × r × in, ``{stack}_lora_B``: experts × out × r; ``init``:
    ``default``, A uniform in ±1/√in and B = 0 as peft does, or ``gaussian``, A with std 1/r)
    scaled by ``scaling``; returns the number of adapter weights added."""
    import torch
    from torch import nn

    added = 0
    for _, experts in expert_modules(model):
        # experts loaded split over ranks (rank.expert_parallel): every expert's drawn, the
        # rank's kept, so a run starts from the same adapter at any split
        shard = experts_state(experts).shard
        for name in EXPERT_PARAMETERS:
            stack = getattr(experts, name)
            n, out, inp = full_shape(stack)
            whole = shard.total if shard is not None and n == shard.count else n
            kind = dtype or torch.float32
            a = torch.empty(whole, r, inp, device=stack.device, dtype=kind)
            b = torch.zeros(whole, out, r, device=stack.device, dtype=kind)
            if a.device.type != "meta":
                if init == "gaussian":
                    nn.init.normal_(a, std=1 / r)
                else:
                    bound = 1 / math.sqrt(inp)
                    nn.init.uniform_(a, -bound, bound)
            if whole != n:
                assert shard is not None
                a, b = (t[shard.first : shard.first + n].clone() for t in (a, b))
            experts.register_parameter(f"{name}_lora_A", nn.Parameter(a))
            experts.register_parameter(f"{name}_lora_B", nn.Parameter(b))
            added += a.numel() + b.numel()
        experts_state(experts).lora_scaling = scaling
    return added


ROUTER_MODULE = "mlp.gate"
"""Where a Qwen mixture keeps a layer's router (``...TopKRouter``, its ``weight`` experts ×
hidden): the name peft's ``modules_to_save`` takes for it (``mlp.shared_expert_gate``, the
shared expert's one-number gate, does not end with it)."""


def routers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every layer's router."""
    return [
        (name, m) for name, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")
    ]


def train_routers(model: Any) -> int:
    """peft.train_router: every router's weight trainable; returns the weights made so."""
    n = 0
    for _, router in routers(model):
        router.weight.requires_grad_(True)
        n += full_numel(router.weight)
    return n
