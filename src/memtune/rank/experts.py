"""LoRA on the routed experts of a mixture-of-experts model (Qwen3-MoE, Qwen3.5-MoE).

transformers 5 keeps a layer's routed experts as two fused 3-D parameters of one module
(``mlp.experts.gate_up_proj``: experts × 2·intermediate × hidden, ``mlp.experts.down_proj``:
experts × hidden × intermediate), not as ``nn.Linear`` layers, so LoRA by module name never
reaches them. peft 0.21 can adapt them (``target_parameters``), by re-parametrizing the stack as
``W + scaling · B·A`` for every expert at each forward: a temporary the size of the whole stack
per layer (1.1 GB for Qwen3.5-35B-A3B's gate_up in bf16), built again in the recompute, and a
parametrization that ZeRO-3's gather hooks do not see (the stack moves into a module created
during the forward).

memtune adds the adapters to the experts module itself instead: per expert e and projection,
``A[e]`` (r × in) and ``B[e]`` (out × r) as ordinary parameters of that module (ZeRO-3 gathers
them with the stack, DeepSpeed's optimizer sees them like any LoRA weight), and a forward that
runs each expert on the tokens routed to it as ``x·W[e]ᵀ + scaling · (x·A[e]ᵀ)·B[e]ᵀ``: all
experts at once through torch's ``grouped_mm`` where it can (_forward_grouped), else a loop
over the experts (_forward_with_lora). The
result is the model peft's adapter describes; :func:`to_peft_names` and :func:`from_peft_names`
convert to and from peft's layout, so an exported adapter loads in plain peft
(``target_parameters``) on the released model class.

Dropout is not applied on the experts' adapters (peft's expert adapters refuse one, so an
adapter trained with it would not be the one peft loads): config.validate asks for
``peft.dropout=0`` when the routed experts are adapted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from memtune.expert_stacks import (
    EXPERT_PARAMETERS,
    QUANT_BLOCK,
    QUANTIZED_CHUNK_BYTES,
    ROUTER_MODULE,
    ExpertShard,
    QuantizedStack,
    add_expert_adapters,
    expert_modules,
    experts_per_chunk,
    experts_state,
    full_numel,
    full_shape,
    int8_dequantized,
    quantized_stack,
    stack_adapter,
)


def quantize_experts(model: nn.Module, quant_type: str, storage: torch.dtype) -> int:
    """Quantize every routed-expert stack of ``model`` still in a floating dtype in place, to 4
    bits (``quant_type`` nf4 / fp4) or 8 (``int8``); returns the number of stacks quantized
    here (none when :func:`experts_as_loaded` quantized them as they were read).

    bitsandbytes' 4-bit and 8-bit loading replaces ``nn.Linear`` layers only, and leaves the
    fused stacks in the compute dtype (93% of Qwen3.5-35B-A3B's weights). Each stack becomes
    ONE frozen parameter (:func:`quantized_parameter`). Under ZeRO-3 each stack is gathered
    whole to be quantized, and its replacement sharded at once (collective: every rank calls
    this)."""
    stacks = 0
    for _, experts in expert_modules(model):
        for name in EXPERT_PARAMETERS:
            param = getattr(experts, name)
            if quantized_stack(param) is not None:
                continue
            with gathered(param):
                quantized = quantized_parameter(param.data, quant_type, storage)
            if hasattr(param, "ds_id"):
                # sharded at once, like the stack it replaces: left whole until
                # deepspeed.initialize, every rank would hold all the 4-bit stacks at start-up
                # (18 GB for Qwen3.5-35B-A3B)
                param.convert_to_zero_parameters([quantized])
            del experts._parameters[name]
            experts.register_parameter(name, quantized)
            stacks += 1
    return stacks


def quantized_parameter(weight: torch.Tensor, quant_type: str, storage: torch.dtype) -> Any:
    """A stack (experts × out × in) as memtune stores it quantized: quantized in one call —
    4-bit: blocks of QUANT_BLOCK along each expert's weight; int8: each weight row scaled by
    its absmax (bitsandbytes' vectorwise int8, the weights only) — so that one expert
    dequantizes alone, and kept as ONE frozen parameter of the training dtype (``storage``):
    the quantized bytes then the fp32 scales, viewed as that dtype, so ZeRO-3 shards and
    gathers it with the rest of the layer (as QLoRA's ``bnb_4bit_quant_storage`` does for the
    linear layers). On ``weight``'s device."""
    shape = tuple(weight.shape)
    values, scales, code = _quantized(weight, quant_type)
    at = -(-values.numel() // 4) * 4  # the scales 4-byte aligned
    size = storage.itemsize
    total = at + scales.numel() * 4
    raw = torch.zeros(total + (-total % size), dtype=torch.uint8, device=values.device)
    raw[: values.numel()] = values.flatten().view(torch.uint8)
    raw[at:total] = scales.float().contiguous().view(torch.uint8)
    quantized = nn.Parameter(raw.view(storage), requires_grad=False)
    quantized.memtune_quantized = QuantizedStack(shape, quant_type, at, code)  # type: ignore[attr-defined]
    return quantized


@dataclass
class LoadedStacks:
    """What :func:`experts_as_loaded` quantized while a base was read."""

    stacks: int = 0
    """Stacks quantized as they were read."""
    largest_bytes: int = 0
    """The largest stack in the dtype it was read in: what one stack adds while it is quantized
    (memory.loading.loading_peak counts the copies of it that loading holds at once)."""


@contextlib.contextmanager
def experts_as_loaded(
    quant_type: str | None, storage: torch.dtype, shard: ExpertShard | None = None
) -> Iterator[LoadedStacks]:
    """While transformers' ``from_pretrained`` reads a mixture (rank.model.load_base_model):
    each routed-expert stack quantized (:func:`quantized_parameter`; ``quant_type`` None: kept
    in its dtype) the moment the loader puts it on its module, so no rank ever holds the whole
    base in the compute dtype — only the quantized model and the one stack being read. With
    expert parallelism (``shard``), only this rank's experts of each stack are kept
    (rank.expert_parallel), quantized or not: the others are freed with the stack read.

    transformers 5 builds a quantized model on the meta device and reads the checkpoint one
    target tensor at a time (``safe_open`` slices, no thread pool when it quantizes on the
    fly): an expert stack is gathered from its checkpoint tensors (one fused tensor, or each
    expert's gate / up / down merged), cast, moved to the rank's device and set on the experts
    module as a ``Parameter``. torch's global parameter-registration hook sees that
    ``Parameter`` and returns the quantized one in its place; the stack in the compute dtype
    is freed as the loader moves on. The result is bit for bit :func:`quantize_experts` after a
    full load (tests/test_quantized_loading.py)."""
    loaded = LoadedStacks()

    def quantize(module: nn.Module, name: str, param: Any) -> Any:
        if (
            name not in EXPERT_PARAMETERS
            or not hasattr(module, "num_experts")
            or param is None
            or param.device.type == "meta"  # the model being built, before any weight is read
            or param.dim() != 3
            or not param.dtype.is_floating_point
            or quantized_stack(param) is not None
            or getattr(param, "memtune_as_loaded", False)
        ):
            return None
        data = param.data
        if shard is not None:  # of the experts this module has (the checkpoint's)
            mine = dataclasses.replace(shard, total=int(data.shape[0]))
            experts_state(module).shard = mine
            data = data[mine.first : mine.first + mine.count].clone()
        kept: Any
        if quant_type is None:
            kept = nn.Parameter(data, requires_grad=param.requires_grad)
        else:
            loaded.stacks += 1
            loaded.largest_bytes = max(loaded.largest_bytes, param.numel() * param.element_size())
            kept = quantized_parameter(data, quant_type, storage)
        kept.memtune_as_loaded = True  # the hook sees its own replacement registered
        # loaded, not missing: transformers would draw it again from its initializer
        kept._is_hf_initialized = True
        return kept

    handle = nn.modules.module.register_module_parameter_registration_hook(quantize)
    try:
        with _loaded_in_order(), _no_allocator_warmup():
            yield loaded
    finally:
        handle.remove()


@contextlib.contextmanager
def _no_allocator_warmup() -> Iterator[None]:
    """transformers' ``from_pretrained`` reserves, before it reads a tensor, what it expects the
    model to take on each GPU (``caching_allocator_warmup``: one ``torch.empty`` of up to the
    card less 1.2 GiB). It counts a routed-expert stack at its checkpoint dtype — 2 bytes a
    weight, as it cannot know the stack is quantized as it is read (or only this rank's experts
    kept): ~61 GB asked for Qwen3-30B-A3B's QLoRA on one card, ~15 GB for a 12-layer one,
    where the plan's loading peak is the quantized model and one stack. On a card capped to
    24 GB that is an out-of-memory inside transformers; uncapped, a peak that is not the
    load's. The warm-up only saves cudaMalloc calls, so it is off while the hook is in place."""
    from transformers import modeling_utils

    original = modeling_utils.caching_allocator_warmup

    def no_warmup(*args: Any, **kwargs: Any) -> None:
        return None

    modeling_utils.caching_allocator_warmup = no_warmup
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = original


ASYNC_LOAD_OFF = "HF_DEACTIVATE_ASYNC_LOAD"


@contextlib.contextmanager
def _loaded_in_order() -> Iterator[None]:
    """transformers 5 reads a checkpoint through a pool of threads that copy every tensor to
    its device as fast as they can, ahead of the thread that sets them on their modules; it
    turns the pool off itself only when it quantizes on the fly, for the spike this would
    cause (core_model_loading). :func:`experts_as_loaded` frees what a rank does not keep only
    when a stack is set, so with the pool on (a bf16 mixture split by expert: no quantizer) the
    readers could hold every rank's experts in bf16 at once — the whole base this hook exists
    to avoid. The pool is off while the hook is in place (transformers' own switch)."""
    before = os.environ.get(ASYNC_LOAD_OFF)
    os.environ[ASYNC_LOAD_OFF] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ASYNC_LOAD_OFF, None)
        else:
            os.environ[ASYNC_LOAD_OFF] = before


def _quantized(
    weight: torch.Tensor, kind: str, chunk_bytes: int = QUANTIZED_CHUNK_BYTES
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A stack (experts × out × in) quantized: (its values, their fp32 scales, the 4-bit code
    table or None), a chunk of experts at a time (their weights in ``weight``'s dtype at most
    ``chunk_bytes``, one expert at least).

    bitsandbytes' CPU code quantizes through fp32 temporaries several times the input (its
    CUDA kernel through none), so a whole stack at once would add ~6 copies of it to the
    loading peak on a CPU rank (Qwen3-30B-A3B's gate_up: 0.8 GB in bf16). In chunks the bytes
    are the same: a 4-bit block never straddles two experts when an expert's weights are a
    whole number of blocks (every released shape), and int8 scales a row at a time."""
    n, out, inp = weight.shape
    step = max(1, chunk_bytes // (out * inp * weight.element_size()))
    if n <= step or (kind != "int8" and (out * inp) % QUANT_BLOCK):
        return _quantized_at_once(weight, kind)
    parts = [_quantized_at_once(weight[i : i + step], kind) for i in range(0, n, step)]
    values = torch.cat([v for v, _, _ in parts])  # packed bytes (k × 1) / int8 rows
    scales = torch.cat([s for _, s, _ in parts])
    return values, scales, parts[0][2]


def _quantized_at_once(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """:func:`_quantized` in one call of bitsandbytes."""
    import bitsandbytes.functional as bnbf

    if kind == "int8":  # an fp32 absmax a row
        rows = weight.reshape(-1, weight.shape[-1])
        # bitsandbytes' CUDA kernel takes float16 alone (its CPU code any float): from
        # float16 on every device, so a stack quantizes alike everywhere. A weight is far
        # inside float16's range; bfloat16's mantissa fits in it, fp32's rounding is far
        # below the int8 step
        values, scales, _ = bnbf.int8_vectorwise_quant(rows.to(torch.float16))
        return values, scales, None
    # Flat, as every dequantization below reads it: blocks run over the flattened stack, and
    # bitsandbytes' AVX-512 CPU kernel mis-blocks 2-D rows whose width is not a multiple of
    # the block (0.50.2), where a flat tensor is one row
    packed, state = bnbf.quantize_4bit(
        weight.reshape(-1), blocksize=QUANT_BLOCK, quant_type=kind, quant_storage=torch.uint8
    )
    return packed, state.absmax, state.code


def round_trip_experts(model: nn.Module, quant_type: str, dtype: torch.dtype) -> int:
    """Replace every routed-expert stack of ``model`` by its quantization's round trip
    (``quant_type``: nf4, fp4 or int8), as training saw it: quantized from ``dtype`` (the
    training dtype) as quantize_experts does, then dequantized (memtune merge's default, and
    what an adapter trained over a quantized mixture corrects). Returns the number of
    stacks."""
    import bitsandbytes.functional as bnbf

    stacks = 0
    for _, experts in expert_modules(model):
        for name in EXPERT_PARAMETERS:
            param = getattr(experts, name)
            weight = param.data.to(dtype)
            values, scales, _ = _quantized(weight, quant_type)
            if quant_type == "int8":
                back = int8_dequantized(values, scales, param.dtype)
            else:
                packed, state = bnbf.quantize_4bit(
                    weight.reshape(-1), blocksize=QUANT_BLOCK, quant_type=quant_type
                )
                back = bnbf.dequantize_4bit(packed, state)  # flat: see _quantized
            param.data = back.reshape(param.shape).to(param.dtype)
            stacks += 1
    return stacks


class gathered:
    """ZeRO-3: the whole parameter for the block (every rank enters together; with
    ``modifier_rank``, what that rank writes into it is partitioned back); else nothing."""

    def __init__(self, param: nn.Parameter, modifier_rank: int | None = None):
        self.param = param
        self.modifier_rank = modifier_rank
        self.context: Any = None

    def __enter__(self) -> None:
        if hasattr(self.param, "ds_id"):
            import deepspeed

            self.context = deepspeed.zero.GatheredParameters(
                [self.param], modifier_rank=self.modifier_rank
            )
            self.context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def _dequantized(param: nn.Parameter, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight (out × in) of a stack quantize_experts made, in ``dtype``."""
    return _dequantized_range(param, e, e + 1, dtype)[0]


def _dequantized_range(
    param: nn.Parameter, first: int, end: int, dtype: torch.dtype
) -> torch.Tensor:
    """Experts ``first`` .. ``end - 1`` of a stack quantize_experts made ((end - first) × out
    × in), in ``dtype``: one dequantization over their contiguous bytes."""
    import bitsandbytes.functional as bnbf

    stack = quantized_stack(param)
    assert stack is not None
    (_, out, inp), kind, at = stack.shape, stack.kind, stack.scales_at
    raw = param.data.view(torch.uint8)
    count = end - first
    if kind == "int8":
        values = raw[first * out * inp : end * out * inp].view(torch.int8).view(-1, inp)
        scales = raw[at:].view(torch.float32)[first * out : end * out]
        return int8_dequantized(values, scales, dtype).view(count, out, inp)
    per, blocks = out * inp // 2, out * inp // QUANT_BLOCK
    scales = raw[at:].view(torch.float32)[first * blocks : end * blocks]
    state = bnbf.QuantState(
        absmax=scales,
        shape=torch.Size([count * out * inp]),  # flat: see _quantized
        dtype=dtype,
        blocksize=QUANT_BLOCK,
        quant_type=kind,
        code=stack.code,
    )
    packed = raw[first * per : end * per].view(-1, 1)
    return bnbf.dequantize_4bit(packed, state).view(count, out, inp)


class _QuantizedLinear(torch.autograd.Function):
    """``x · W[e]ᵀ`` for a 4-bit stack: W[e] is dequantized for the product and again in the
    backward (for x's gradient), never kept: what autograd holds is the packed stack it
    already has."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, param: nn.Parameter, e: int) -> Any:
        ctx.param, ctx.e = param, e
        return F.linear(x, _dequantized(param, e, x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        weight = _dequantized(ctx.param, ctx.e, grad.dtype)
        return grad @ weight, None, None


class _StackLinear(torch.autograd.Function):
    """``x · W[e]ᵀ`` for a frozen float stack, keeping the parameter for the backward and not
    the view ``W[e]``: under ZeRO-3 a view would hold the whole gathered stack alive until the
    backward (1.2 GB a layer for Qwen3-30B-A3B in bf16) after ZeRO-3 released it; the
    parameter is gathered again for the layer's backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, param: nn.Parameter, e: int) -> Any:
        ctx.param, ctx.e = param, e
        return F.linear(x, param[e])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad @ ctx.param[ctx.e].to(grad.dtype), None, None


def _expert_linear(experts: Any, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """``x · W[e]ᵀ`` for stack ``name`` of ``experts``, float or 4-bit."""
    param = getattr(experts, name)
    if quantized_stack(param) is None:
        return _StackLinear.apply(x, param, e)
    return _QuantizedLinear.apply(x, param, e)


def grouped_available(dtype: torch.dtype, r: int | None, cpu: bool = True) -> bool:
    """Whether torch's ``grouped_mm`` (torch >= 2.10) can run the experts: it wants every
    stride a multiple of 16 bytes, which the adapters' rank ``r`` decides (hidden and
    intermediate sizes of the released models are), and off the CPU (``cpu`` False: a GPU, or
    the fake tensors of tools.step_trace, whose meta kernel mirrors CUDA's) bfloat16."""
    if not hasattr(F, "grouped_mm") or (not cpu and dtype != torch.bfloat16):
        return False
    return r is None or (r * dtype.itemsize) % 16 == 0


def _grouped_stack(
    x: torch.Tensor,
    param: nn.Parameter,
    ends: list[int] | None,
    offs: torch.Tensor,
    transposed: bool,
) -> torch.Tensor:
    """``x`` (rows sorted by expert, ``offs`` their cumulative counts) through the stack, row
    block e times ``W[e]ᵀ`` (``transposed``: the forward) or ``W[e]`` (the input's gradient).
    A float stack is one grouped product; a quantized one is dequantized as many experts at a
    time as expert_stacks.QUANTIZED_CHUNK_BYTES holds (``ends``: offs read on the host)."""
    n, rows_out, cols_in = full_shape(param)
    width = rows_out if transposed else cols_in

    def oriented(weight: torch.Tensor) -> torch.Tensor:
        return weight.transpose(-2, -1) if transposed else weight

    if quantized_stack(param) is None:
        return F.grouped_mm(x, oriented(param.to(x.dtype)), offs=offs)
    assert ends is not None
    out = x.new_empty(x.shape[0], width)
    step = experts_per_chunk(rows_out, cols_in, x.dtype.itemsize)
    for first in range(0, n, step):
        end = min(n, first + step)
        lo, hi = (ends[first - 1] if first else 0), ends[end - 1]
        if hi == lo:
            continue
        weight = _dequantized_range(param, first, end, x.dtype)
        out[lo:hi] = F.grouped_mm(
            x[lo:hi], oriented(weight), offs=(offs[first:end] - lo).to(torch.int32)
        )
    return out


class _GroupedStack(torch.autograd.Function):
    """``x · W[e]ᵀ`` for every expert's rows at once (torch's grouped_mm) over a frozen stack,
    float or quantized: autograd keeps the parameter, not a view or a dequantized copy (the
    reasons of _StackLinear and _QuantizedLinear), and the backward runs the same grouped
    product with the weights untransposed."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, param: nn.Parameter, ends: Any, offs: torch.Tensor
    ) -> Any:
        ctx.param, ctx.ends = param, ends
        ctx.save_for_backward(offs)
        return _grouped_stack(x, param, ends, offs, transposed=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (offs,) = ctx.saved_tensors
        dx = _grouped_stack(grad.contiguous(), ctx.param, ctx.ends, offs, False)
        return dx, None, None, None


class _Grouped(torch.autograd.Function):
    """torch's grouped_mm for the adapters (``x`` rows by expert, ``w`` experts × in × out),
    with the incoming gradient made contiguous: grouped_mm's backward refuses the expanded
    gradients autograd can hand it (a sum's, for one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> Any:
        ctx.save_for_backward(x, w, offs)
        return F.grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        dx = F.grouped_mm(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = F.grouped_mm(x.transpose(-2, -1), grad, offs=offs)
        return dx, dw, None


def _sorted_rows(
    experts: Any, top_k_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n × top-k routed rows sorted by expert: (their flat index into top_k_index, their
    token, the cumulative row count per expert, int32). Under the state's ``even_routing``
    row j goes to expert j mod experts (see _routed_rows), computed without reading the data."""
    n, k = top_k_index.shape
    count = experts.num_experts
    device = top_k_index.device
    if experts_state(experts).even_routing:
        rows = torch.cat([torch.arange(e, n * k, count, device=device) for e in range(count)])
        sizes = [len(range(e, n * k, count)) for e in range(count)]
        offs = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)
        return rows, rows // k, offs
    with torch.no_grad():
        _, rows = torch.sort(top_k_index.reshape(-1), stable=True)
        per = torch.bincount(top_k_index.reshape(-1), minlength=count)
        offs = torch.cumsum(per, 0).to(torch.int32)
    return rows, rows // k, offs


def _forward_grouped(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The same experts forward as _forward_with_lora — each expert, adapters included, on its
    routed rows — as a handful of grouped products over all experts at once, where the loop
    launches a few small matmuls per expert (on an H200, one Qwen3-30B-A3B block ran 0.05× the
    speed of grouped_mm that way, 2026-12-04)."""
    s = experts_state(self).lora_scaling
    rows, tokens, offs = _sorted_rows(self, top_k_index)
    quantized = quantized_stack(self.gate_up_proj) is not None
    ends = offs.tolist() if quantized else None  # one read of the counts, for the chunks

    def projected(name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` through stack ``name``, plus its adapter (x·Aᵀ·Bᵀ, grouped too) if any."""
        y = _GroupedStack.apply(x, getattr(self, name), ends, offs)
        if s is None:
            return y
        a, b = (getattr(self, f"{name}_lora_{m}").to(x.dtype) for m in "AB")
        mid = _Grouped.apply(x, a.transpose(-2, -1), offs)
        return y + s * _Grouped.apply(mid, b.transpose(-2, -1), offs)

    gate, up = projected("gate_up_proj", hidden_states[tokens]).chunk(2, dim=-1)
    y = projected("down_proj", self.act_fn(gate) * up)
    y = y * top_k_weights.reshape(-1)[rows, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, tokens, y.to(out.dtype))


@contextlib.contextmanager
def experts_off(model: nn.Module) -> Iterator[None]:
    """The routed experts' adapters switched off for the block (peft's ``disable_adapter``
    does not know them): a live reference's forward."""
    states = [experts_state(m) for _, m in expert_modules(model)]
    states = [state for state in states if state.lora_scaling is not None]
    scalings = [state.lora_scaling for state in states]
    for state in states:
        state.lora_scaling = None
    try:
        yield
    finally:
        for state, scaling in zip(states, scalings, strict=True):
            state.lora_scaling = scaling


def full_precision_weights(model: Any, smallest: int) -> list[str]:
    """Weights of ``smallest`` or more elements that a quantized base left in a floating
    dtype, by name: every decoder weight that large should be 4-bit (bitsandbytes' layers,
    rank.experts' stacks); the embedding and the LM head are meant to stay."""
    keep = set()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            keep.add(id(module.weight))
    found = []
    for name, param in model.named_parameters():
        if id(param) in keep or param.requires_grad:
            continue
        if quantized_stack(param) is not None:
            continue
        if hasattr(param, "quant_state") or not param.dtype.is_floating_point:
            continue  # bitsandbytes' Params4bit (stored as the training dtype) / Int8Params
        if full_numel(param) >= smallest:
            found.append(name)
    return found


def add_expert_lora(
    model: nn.Module, r: int, scaling: float, init: str = "default", dtype: Any = None
) -> int:
    """memtune.expert_stacks.add_expert_adapters, and the forward that applies them (what
    rank.model.add_lora does in two steps, the forward for frozen experts too); returns the
    number of adapter weights added."""
    added = add_expert_adapters(model, r, scaling, init, dtype)
    use_routed_forward(model)
    return added


def use_routed_forward(model: nn.Module) -> int:
    """Run every routed-expert stack of ``model`` with memtune's forward (adapters or not: one
    code path, whose saved tensors memory.estimate.moe_block_bytes counts); returns how many
    stacks."""
    stacks = expert_modules(model)
    for _, experts in stacks:
        experts_state(experts)  # the adapters' scaling when they came first, else no adapters
        experts.forward = types.MethodType(_forward_routed, experts)
    return len(stacks)


def _forward_routed(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The grouped forward where torch has grouped_mm for these shapes, else the loop (the
    state's ``grouped`` False forces the loop: benchmarks, tests)."""
    state = experts_state(self)
    lora_a = getattr(self, "gate_up_proj_lora_A", None)
    r = None if lora_a is None or state.lora_scaling is None else int(lora_a.shape[1])
    # tools.step_trace (even routing) takes the path a GPU would, on real and fake tensors alike
    traced = state.even_routing
    cpu = hidden_states.device.type == "cpu" and not is_fake(hidden_states) and not traced
    if state.grouped and grouped_available(hidden_states.dtype, r, cpu):
        return _forward_grouped(self, hidden_states, top_k_index, top_k_weights)
    return _forward_with_lora(self, hidden_states, top_k_index, top_k_weights)


def _forward_with_lora(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts forward with each expert's adapter (when it has one)
    added to its two projections, on the tokens routed to it only."""
    s = experts_state(self).lora_scaling
    out = torch.zeros_like(hidden_states)
    for e, slot, tokens in _routed_rows(self, top_k_index):
        x = hidden_states[tokens]
        gate_up = _expert_linear(self, "gate_up_proj", e, x)
        if s is not None:
            a, b = self.gate_up_proj_lora_A[e], self.gate_up_proj_lora_B[e]
            gate_up = gate_up + s * F.linear(F.linear(x, a), b)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        y = _expert_linear(self, "down_proj", e, h)
        if s is not None:
            y = y + s * F.linear(F.linear(h, self.down_proj_lora_A[e]), self.down_proj_lora_B[e])
        y = y * top_k_weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _routed_rows(
    experts: Any, top_k_index: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, top-k slot, token) of each row routed to each expert that has rows.

    With the state's ``even_routing`` set (tools.step_trace), row j of the n × top-k
    routing goes to expert j mod experts whatever the router chose: the router's output is
    still computed (and kept for backward), but which tokens an expert gets is decided by the
    data, a nonzero that fake tensors cannot run. Evenly spread rows are what the planner
    assumes (n × top-k rows over all experts), each token on top-k different experts."""
    if experts_state(experts).even_routing:
        n, k = top_k_index.shape
        for e in range(min(experts.num_experts, n * k)):
            rows = torch.arange(e, n * k, experts.num_experts, device=top_k_index.device)
            yield e, rows % k, rows // k
        return
    with torch.no_grad():
        routed = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
        hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        slot, tokens = torch.where(routed[e])
        yield e, slot, tokens


def _peft_prefix(module_name: str, param: str) -> str:
    """peft's name for the wrapper of ``param`` of the experts module ``module_name``: the
    wrappers nest in EXPERT_PARAMETERS order, the first innermost (``experts.base_layer``)."""
    depth = len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(param)
    return module_name + ".base_layer" * depth


def to_peft_names(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split a trainable state dict (named as this model's parameters) into (the other
    tensors, the expert adapters in peft's layout under the names of peft's adapter file):
    ``…experts[.base_layer].lora_A.weight`` as (experts·r) × in, ``lora_B`` as
    out × (r·experts), experts fastest. peft's own save drops tensors of modules it did not
    make, so the second part is written into the file after it (checkpoint.export_adapter)."""
    rest, experts = {}, {}
    for name, t in state.items():
        if name.endswith(f".{ROUTER_MODULE}.weight"):  # peft.train_router: modules_to_save
            experts[name] = t.contiguous()
            continue
        parsed = stack_adapter(name)
        if parsed is None:
            rest[name] = t
            continue
        module, param, which = parsed
        prefix = _peft_prefix(module, param)
        if which == "A":  # (E, r, in) -> (E·r, in)
            experts[f"{prefix}.lora_A.weight"] = t.reshape(-1, t.shape[-1]).contiguous()
        else:  # (E, out, r) -> (out, r·E): peft reads column j·E + e as expert e's j-th
            experts[f"{prefix}.lora_B.weight"] = (
                t.permute(1, 2, 0).reshape(t.shape[1], -1).contiguous()
            )
    return rest, experts


def from_peft_names(
    state: dict[str, torch.Tensor], experts: dict[str, int]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft_names` for an adapter's state (keys without
    ``.default``): ``experts`` maps each experts module's name (as in the adapter) to its
    number of experts."""
    wrappers = {
        f"{_peft_prefix(module, param)}.lora_{which}.weight": (module, param, which)
        for module in experts
        for param in EXPERT_PARAMETERS
        for which in "AB"
    }
    out = {}
    for name, t in state.items():
        if name not in wrappers:
            out[name] = t
            continue
        module, param, which = wrappers[name]
        n = experts[module]
        if which == "A":
            out[f"{module}.{param}_lora_A"] = t.reshape(n, -1, t.shape[-1])
        else:
            out[f"{module}.{param}_lora_B"] = t.reshape(t.shape[0], -1, n).permute(2, 0, 1)
    return {k: v.contiguous() for k, v in out.items()}


def peft_target_parameters() -> list[str]:
    """What an exported adapter's config names in ``target_parameters``."""
    return [f"mlp.experts.{p}" for p in EXPERT_PARAMETERS]


def expert_adapter_names(names: Any) -> list[str]:
    """The parameter names among ``names`` that are routed-expert adapters (rank.experts')."""
    return [name for name in names if stack_adapter(name) is not None]


def write_expert_adapters(out_dir: Any, experts: dict[str, torch.Tensor]) -> None:
    """Complete an adapter peft has just saved (its own modules' tensors) with the routed
    experts' (:func:`to_peft_names`): the tensors into ``adapter_model.safetensors``, and
    ``target_parameters`` (with ``lora_dropout`` 0, which peft requires of them) into
    ``adapter_config.json``; each file written to a temporary name and renamed into place."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from memtune.filesystem import write_atomic

    out = Path(out_dir)
    path = out / "adapter_model.safetensors"
    state = {**load_file(path), **experts}
    tmp = path.with_name(f".tmp-{path.name}")
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.replace(path)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if any(".lora_" in name for name in experts):
        config["target_parameters"] = peft_target_parameters()
        config["lora_dropout"] = 0.0
    if any(name.endswith(f".{ROUTER_MODULE}.weight") for name in experts):
        # the routers, trained in full: peft puts a trained copy of each in place on load
        config["modules_to_save"] = sorted({*(config.get("modules_to_save") or []), ROUTER_MODULE})
    write_atomic(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")


class RouterStats:
    """A mixture's routing, accumulated between two logging steps on every rank: how many of
    the routed slots (tokens × num_experts_per_tok) each layer's router sent to each expert,
    and its mean probability per expert. From them :meth:`metrics` reports, per layer, the
    experts' shares of the load and the busiest expert's over the mean (1.0: even; a
    collapsing router climbs towards num_experts / num_experts_per_tok), and the
    load-balancing loss of transformers' ``load_balancing_loss_func``
    (E · Σₑ slotsₑ / tokens · mean probₑ: num_experts_per_tok when even), over all layers'
    tokens as the model's own aux loss takes it, and per layer. Counted in training forwards
    only: not in evaluation, nor in the recompute of a checkpointed layer (inside the
    backward, where it would count that layer's tokens twice).

    ``mask`` (set by the loop before each forward): the micro batch's real tokens, flattened,
    when its batch says which they are (padded batches: the attention mask); padding is then
    left out, as the model's own aux loss leaves it out given the attention mask. Packed rows
    carry no mask: their tail padding (the rows' fill, printed at start-up) is counted."""

    def __init__(self, model: nn.Module, device: Any = None, capture: bool = False):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.capture = capture  # trainer.router_aux_loss_coef: keep the logits, with grad
        self.captured: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (logits, mask)
        self.mask: torch.Tensor | None = None
        experts = max((int(getattr(m, "num_experts", 0)) for m in self.routers), default=0)
        shape = (len(self.routers), experts)
        self.slots = torch.zeros(shape, dtype=torch.float64, device=device)
        self.probs = torch.zeros_like(self.slots)
        self.tokens = torch.zeros(shape[0], dtype=torch.float64, device=device)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def __bool__(self) -> bool:
        return bool(self.routers)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return  # evaluation, a reference's forward without grad
            if torch._C._current_graph_task_id() != -1:
                return  # a checkpointed layer's recompute, inside the backward
            logits, _, chosen = output
            mask = self.mask
            if mask is None or mask.numel() != logits.shape[0]:
                mask = None
            if self.capture:
                # masked in take_aux_loss, outside the layer: an index taken here with grad,
                # inside a checkpointed layer's forward, would save a tensor its recompute
                # (which skips this hook) does not, and torch's checkpoint refuses the backward
                self.captured.append((logits, mask))
            with torch.no_grad():
                if mask is not None:
                    logits, chosen = logits[mask], chosen[mask]
                experts = logits.shape[-1]
                slots = torch.bincount(chosen.flatten(), minlength=experts).double()
                self.slots[index] += slots.to(self.slots.device)
                probs = logits.float().softmax(-1).sum(0).double()
                self.probs[index] += probs.to(self.probs.device)
                self.tokens[index] += logits.shape[0]

        return hook

    def take_aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the forwards since the last call, differentiable
        (transformers' load_balancing_loss_func over every layer's logits, as the model's own
        aux_loss: num_experts_per_tok when the load is even); then forgets those logits."""
        logits = torch.cat([(x if m is None else x[m]).float() for x, m in self.captured])
        self.captured = []
        first: Any = self.routers[0]
        probs = logits.softmax(-1)  # rows × experts, the differentiable part
        experts = probs.shape[-1]
        with torch.no_grad():  # counts, not a one-hot of rows × top-k × experts
            chosen = probs.topk(int(first.top_k), dim=-1).indices
            slots = torch.bincount(chosen.flatten(), minlength=experts).float() / probs.shape[0]
        return experts * (slots * probs.mean(0)).sum()

    def metrics(self, reduce: Any = None) -> dict[str, Any]:
        """The window's metrics (empty when no routed forward ran on any rank), then a new
        window. ``reduce``: sums a tensor over the ranks in place; every rank calls this
        together, whatever it routed (the counters have the same shape on all)."""
        packed = torch.cat([self.slots.flatten(), self.probs.flatten(), self.tokens])
        if reduce is not None:
            reduce(packed)
        layers, experts = self.slots.shape
        slots = packed[: layers * experts].view(layers, experts)
        probs = packed[layers * experts : 2 * layers * experts].view(layers, experts)
        tokens = packed[2 * layers * experts :]
        self.slots.zero_()
        self.probs.zero_()
        self.tokens.zero_()
        if not float(tokens.sum()):
            return {}
        tokens = tokens.clamp(min=1)
        share = slots / slots.sum(-1, keepdim=True).clamp(min=1)
        busiest = share.max(-1).values * experts
        balance = experts * (slots / tokens[:, None] * probs / tokens[:, None]).sum(-1)
        everywhere = tokens.sum()
        overall = experts * (slots.sum(0) / everywhere * probs.sum(0) / everywhere).sum()
        return {
            "moe/aux_loss": float(overall),
            "moe/load_max_over_mean": float(busiest.max()),
            "moe/layers": {
                f"layer{i}": {"load_max_over_mean": float(busiest[i]), "aux_loss": float(b)}
                for i, b in enumerate(balance.tolist())
            },
            "moe/expert_load": [[round(x, 5) for x in row] for row in share.tolist()],
        }
