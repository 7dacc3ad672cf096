"""Expert parallelism (trainer.expert_parallel=N): a mixture's routed experts split by expert
over groups of N ranks, tokens sent to the experts' ranks and back by all-to-all.

Why memtune's own dispatch and not DeepSpeed's AutoEP. DeepSpeed 0.19.8's AutoEP
(``deepspeed/module_inject/auto_ep*``) replaces the whole mixture block with its own
``AutoEPMoELayer``, whose experts are new bf16 ``w1 / w2 / w3`` parameters: memtune's grouped
forward, the experts' LoRA (``rank.experts``: A and B per expert, exported in peft's layout)
and the 4-bit stacks would be gone, and its presets match neither peft-wrapped names nor the
released Qwen3.5 class. What composes is DeepSpeed's bookkeeping for expert parameters under
ZeRO-1/2, which this module uses as is: a parameter with ``allreduce=False`` and a
``group_name`` is reduced over that name's expert-data-parallel group only (the ranks holding
the same experts), its optimizer group marked ``moe``, and broadcast at start within that group
only. That machinery switches on when the engine finds a ``deepspeed.moe.layer.MoE`` module;
:func:`deepspeed_sees_experts` puts a parameterless one on the module for
``deepspeed.initialize`` and takes it off again.

Under ZeRO-3 no MoE module may be seen (the engine's ``_validate_zero3_moe_compatibility``
asserts unless every one is AutoEP's), and none is needed: ZeRO-3 reads its placement from the
parameters themselves. :func:`partition_experts_over_groups` tags each expert parameter as
AutoEP tags its own (``auto_ep_layer.py``, "Mark expert params for EDP gradient reduction"):
family ``autoep_expert``, its group's name, and ``ds_zero_partition_process_group`` its
expert-data-parallel group, which ``Init._convert_to_deepspeed_param`` partitions it over
(``partition_parameters.py``: ``param.ds_process_group = getattr(param,
"ds_zero_partition_process_group", ...)``) when the engine converts the model; its broadcast
runs within that group too, so no rank's experts are overwritten by another's. ZeRO-3's
optimizer then keeps them in sub-groups of their own (``_get_trainable_parameter_groups``, by
process group), averages their gradients by the whole data-parallel world
(``_gradient_averaging_world_size``: what the sum over the group's tokens on the owner needs)
and adds their gradient norm over the expert-parallel group once each partition is summed over
its own group. The base must therefore not be built under ``zero.Init``, which would partition
every expert over all the ranks before the tags exist: rank.build loads it as a quantized base
is loaded (each rank reading only its experts, rank.experts.experts_as_loaded), the rest of it
whole in host memory per rank (memory.loading counts that), then converts it to ZeRO-3
parameters one at a time before the engine is built (:func:`partition_before_the_engine`).

The dispatch. Per layer, each token is sent once to each rank holding any of its top-k experts
(not once per expert), with the rows routed to that rank (local expert, token, weight); the
owner runs memtune's forward (grouped or loop, rank.experts) on its experts' rows, adds up each
received token's rows, and sends one vector per token back, where they are added into the
token's output. The exchanges are differentiable (:class:`_AllToAll`: its backward is the
reverse exchange), so the experts' gradients come from every rank's tokens, and the tokens'
gradients go back the same way. No capacity factor: every row is computed, none dropped.

The gradient scale: DeepSpeed divides every gradient by the data-parallel world size before
reducing; an expert's gradient on its owner is already the sum over its group's tokens, and
reducing it over the ranks that hold the same experts sums the other groups' — the same
average as at N=1 (tests/test_expert_parallel.py checks losses, gradient norms and the adapter).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memtune.expert_stacks import (
    EXPERT_PARAMETERS,
    QUANT_BLOCK,
    ExpertShard,
    QuantizedStack,
    expert_modules,
    experts_state,
    full_shape,
    quantized_stack,
    stack_adapter,
)
from memtune.rank.experts import _forward_routed


def shard_for(size: int, total: int) -> ExpertShard:
    """This rank's share of ``total`` experts a layer at expert-parallel size ``size``."""
    group, name = expert_parallel_group(size)
    return ExpertShard(size, dist.get_rank(group), total, group, name)


def expert_parallel_group(size: int) -> tuple[Any, str]:
    """The expert-parallel process group of size ``size`` this rank belongs to, and its
    DeepSpeed name: DeepSpeed's own groups (``deepspeed.utils.groups``: consecutive ranks form
    an expert-parallel group, ranks with the same position in them an expert-data-parallel
    group), made on first use, so its ZeRO-2 optimizer reduces the experts over the same
    groups."""
    from deepspeed.utils import groups

    name = f"ep_size_{size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return groups._get_expert_parallel_group(name), name


def split_experts(model: nn.Module, size: int) -> int:
    """Keep this rank's share of every routed-expert stack of ``model`` (its expert-parallel
    group's rank i of ``size`` holds experts [i·E/size, (i+1)·E/size)), float or quantized,
    and of their adapters, and run the experts through :func:`_forward_dispatched`; the other
    experts' weights are dropped here, before the optimizer is built (where the loader did not
    drop them already: rank.model.load_base_model keeps only this rank's experts of each stack
    it reads). Every expert parameter is tagged for DeepSpeed (``allreduce=False``,
    ``group_name``). Returns the stacks split.

    The adapters were drawn whole (the same start as on one rank) and are cut like the
    stacks: a run at any expert-parallel size starts from the same adapter."""
    group, name = expert_parallel_group(size)
    rank = dist.get_rank(group)
    stacks = 0
    for _, experts in expert_modules(model):
        # loaded so already (rank.model.load_base_model: only this rank's experts read), or
        # split now
        shard = experts_state(experts).shard
        if shard is None:
            shard = ExpertShard(size, rank, int(experts.num_experts), group, name)
        first, end = shard.first, shard.first + shard.count
        for param_name, param in list(experts.named_parameters(recurse=False)):
            kept: Any = param  # this rank's already, when loaded so
            if full_shape(param)[0] != shard.count and quantized_stack(param) is not None:
                kept = _quantized_experts(param, first, end)
            elif full_shape(param)[0] != shard.count:
                kept = nn.Parameter(
                    param.data[first:end].clone(), requires_grad=param.requires_grad
                )
            kept.allreduce = False
            kept.group_name = name
            kept.memtune_shard = shard
            experts._parameters[param_name] = kept
            stacks += param_name in EXPERT_PARAMETERS
        experts.num_experts = shard.count
        experts_state(experts).shard = shard
        experts.forward = types.MethodType(_forward_dispatched, experts)
    return stacks


def partition_experts_over_groups(model: nn.Module) -> int:
    """ZeRO-3: tag every parameter of ``model``'s split experts (:func:`split_experts`) so that
    DeepSpeed partitions it over its expert-data-parallel group only (the module docstring),
    before ``deepspeed.initialize`` converts the model; returns the parameters tagged."""
    from deepspeed.utils import groups

    tagged = 0
    for _, experts in expert_modules(model):
        shard = experts_state(experts).shard
        if shard is None:
            continue
        group = groups._get_expert_data_parallel_group(shard.group_name)
        for param in experts.parameters(recurse=False):
            if hasattr(param, "ds_id"):  # built under zero.Init: over the world already
                raise RuntimeError(
                    "expert parallelism under ZeRO-3: the routed experts were partitioned "
                    "over every rank as the base was built (zero.Init); build it without"
                )
            param.ds_zero_placement_family = "autoep_expert"
            param.ds_zero_partition_group_name = shard.group_name
            param.ds_zero_partition_process_group = group
            tagged += 1
    return tagged


FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""What DeepSpeed's engine casts to the training dtype (``engine.CASTABLE_DTYPES``)."""


def partition_before_the_engine(
    model: nn.Module, ds_config: dict[str, Any], device: torch.device, mpu: Any = None
) -> int:
    """ZeRO-3 under expert parallelism: every parameter of ``model`` (its experts split and
    tagged, :func:`partition_experts_over_groups`) made a ZeRO-3 parameter here, one at a time,
    before ``deepspeed.initialize``; returns the parameters converted.

    The engine makes them so itself (``parameter_offload._convert_to_zero_parameters``: this
    same ``deepspeed.zero.Init(module=...)``), but only after it has moved a model that holds
    no ZeRO-3 parameter to the device whole (``engine._configure_distributed_model``:
    ``self.module.to(self.device)`` unless some parameter has a ``ds_id``). A base read on the
    host, not under zero.Init (the module docstring), would then land on every GPU unsharded:
    the rest of Qwen3-30B-A3B and half its experts, 29.9 GiB a card at N=2. Init moves one
    parameter at a time to the device, broadcasts it within its partition group (the
    expert-data-parallel group for the experts: ``ds_zero_partition_process_group``) and keeps
    this rank's partition of it there, the whole freed (on the host too, where it was read).

    What the engine leaves undone for a model of ZeRO-3 parameters is done here as it would
    have done it: every floating parameter cast to the training dtype first
    (``_cast_module_mixed_precision``, skipped then) and the buffers moved to the device (Init
    moves parameters only)."""
    import deepspeed

    precision = [k for k in ("bf16", "fp16") if ds_config.get(k, {}).get("enabled")]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision[0]] if precision else None
    params = [p for p in model.parameters() if not hasattr(p, "ds_id")]
    for param in params:
        if dtype is not None and param.dtype in FLOATING and param.dtype != dtype:
            param.data = param.data.to(dtype)
    group = None  # all the ranks, as the engine's own call (or the mpu's data-parallel group)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        group = mpu.get_data_parallel_group()
    deepspeed.zero.Init(
        module=model, config_dict_or_path=ds_config, data_parallel_group=group, mpu=mpu
    )
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    return len(params)


def _quantized_experts(param: nn.Parameter, first: int, end: int) -> nn.Parameter:
    """Experts ``first`` .. ``end - 1`` of a stack rank.experts.quantize_experts made, in the
    same format: their values' bytes, then their scales, as one frozen parameter."""
    stack = quantized_stack(param)
    assert stack is not None
    _, out, inp = stack.shape
    raw = param.data.view(torch.uint8)
    if stack.kind == "int8":  # a byte a weight, an fp32 scale a row
        per, scales = out * inp, out
    elif (out * inp) % QUANT_BLOCK:
        raise ValueError(
            f"a 4-bit expert stack of {out} × {inp} weights an expert: its blocks of "
            f"{QUANT_BLOCK} straddle two experts, so it cannot be split by expert"
        )
    else:  # 4 bits a weight, an fp32 scale a block
        per, scales = out * inp // 2, out * inp // QUANT_BLOCK
    values = raw[first * per : end * per]
    scale = raw[stack.scales_at :].view(torch.float32)[first * scales : end * scales]
    at = -(-values.numel() // 4) * 4
    size = param.dtype.itemsize
    total = at + scale.numel() * 4
    kept = torch.zeros(total + (-total % size), dtype=torch.uint8, device=raw.device)
    kept[: values.numel()] = values
    kept[at:total] = scale.contiguous().view(torch.uint8)
    out_param = nn.Parameter(kept.view(param.dtype), requires_grad=False)
    shape = (end - first, out, inp)
    out_param.memtune_quantized = QuantizedStack(shape, stack.kind, at, stack.code)  # type: ignore[attr-defined]
    return out_param


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as gloo and NCCL both exchange it: bfloat16 viewed as float16, the same bytes
    (gloo's all-to-all and all-gather have no bfloat16 nor int16; they copy, never add)."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """All-to-all of ``x``'s rows: ``send[j]`` rows to rank j of ``group`` (in order), and
    ``recv[j]`` rows from it."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(_wire(out), _wire(x.contiguous()), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange`, differentiable: the gradient of what was received goes back to the
    rank it came from (the same exchange with the counts swapped). ``kind`` names what moves,
    for :data:`COUNTER`."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any, kind: str
    ) -> Any:
        ctx.send, ctx.recv, ctx.group, ctx.kind = send, recv, group, kind
        COUNTER.add(kind, x, send, group)
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        COUNTER.add(ctx.kind, grad, ctx.recv, ctx.group)
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


class ExchangeCounter:
    """Bytes this rank's dispatch and combine sent to the other ranks, by what moved
    (``tokens``: the hidden vectors, there and back, in forwards, recomputes and backwards
    alike; ``weights``: the routing weights of the rows), while :func:`counting` is on: what
    the planner's all-to-all bytes are checked against (issue #48 item 3)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.on = False

    def add(self, kind: str, x: torch.Tensor, send: list[int], group: Any) -> None:
        if not self.on:
            return
        rows = sum(send) - send[dist.get_rank(group)]
        row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
        self.sent[kind] = self.sent.get(kind, 0) + rows * row_bytes


COUNTER = ExchangeCounter()


@contextlib.contextmanager
def counting() -> Iterator[ExchangeCounter]:
    COUNTER.sent, COUNTER.on = {}, True
    try:
        yield COUNTER
    finally:
        COUNTER.on = False


def _forward_dispatched(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under expert parallelism (the module docstring): the same
    sum over each token's top-k experts as rank.experts' forward on one rank."""
    shard = experts_state(self).shard
    assert shard is not None
    size, group, local = shard.size, shard.group, shard.count
    tokens = top_k_index.shape[0]
    device = hidden_states.device
    with torch.no_grad():
        dest = torch.div(top_k_index, local, rounding_mode="floor")  # tokens × k
        hit = torch.zeros(tokens, size, dtype=torch.bool, device=device)
        hit.scatter_(1, dest, True)
        # the (token, rank) pairs sent, by rank then token: each token once per rank
        pair_rank, pair_token = hit.t().nonzero(as_tuple=True)
        pairs_to = torch.bincount(pair_rank, minlength=size)
        start = torch.cumsum(pairs_to, 0) - pairs_to
        pair_of = torch.full((tokens, size), -1, dtype=torch.long, device=device)
        pair_of[pair_token, pair_rank] = torch.arange(pair_token.numel(), device=device)
        # each routed row: its pair (numbered within the pairs for that rank), local expert
        slot_pair = pair_of.gather(1, dest).flatten()
        order = torch.argsort(slot_pair, stable=True)  # rows by rank, as the pairs are
        row_rank = dest.flatten()[order]
        rows_to = torch.bincount(row_rank, minlength=size)
        meta = torch.stack(
            [
                slot_pair[order] - start[row_rank],
                top_k_index.flatten()[order] - row_rank * local,
            ],
            dim=1,
        )
        counts = torch.stack([pairs_to, rows_to], dim=1)
        got = _exchange(counts, [1] * size, [1] * size, group)
        send_pairs, send_rows = pairs_to.tolist(), rows_to.tolist()
        recv_pairs, recv_rows = got[:, 0].tolist(), got[:, 1].tolist()
        their = _exchange(meta, send_rows, recv_rows, group)
        # a received row's pair, numbered over everything received (ranks in order)
        offsets = torch.tensor([0, *recv_pairs[:-1]], device=device).cumsum(0)
        from_rank = torch.repeat_interleave(
            torch.arange(size, device=device), torch.tensor(recv_rows, device=device)
        )
        row_pair = their[:, 0] + offsets[from_rank]
        row_expert = their[:, 1]
    x = _AllToAll.apply(hidden_states[pair_token], send_pairs, recv_pairs, group, "tokens")
    weights = _AllToAll.apply(
        top_k_weights.reshape(-1)[order], send_rows, recv_rows, group, "weights"
    )
    # this rank's experts on the rows routed to them: rank.experts' forward, a row a "token"
    rows = _forward_routed(self, x[row_pair], row_expert[:, None], weights[:, None])
    summed = x.new_zeros(x.shape).index_add_(0, row_pair, rows.to(x.dtype))
    if not row_pair.numel():
        # no row came here: the adapters still take part (a zero gradient, as one rank's
        # grouped product gives an expert without rows), or ZeRO would reduce none for them
        for param in self.parameters():
            if param.requires_grad:
                summed = summed + 0 * param.reshape(-1)[:1].sum().to(summed.dtype)
    back = _AllToAll.apply(summed, recv_pairs, send_pairs, group, "tokens")
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, pair_token, back.to(out.dtype))


def expert_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's groups (rank.optim.param_groups) with the expert parameters in groups
    of their own, marked as DeepSpeed's ZeRO-1/2 wants them (``moe``, and ``name``: the expert
    group they are reduced over), each keeping its rate; the other groups first (the first
    group's rate is the one the logs show)."""
    dense, experts = [], []
    for g in groups:
        tagged = [p for p in g["params"] if getattr(p, "allreduce", True) is False]
        rest = [p for p in g["params"] if getattr(p, "allreduce", True) is not False]
        if rest:
            dense.append({**g, "params": rest})
        names = sorted({p.group_name for p in tagged})
        for name in names:
            mine = [p for p in tagged if p.group_name == name]
            experts.append({**g, "params": mine, "moe": True, "name": name})
    return dense + experts


@contextlib.contextmanager
def deepspeed_sees_experts(module: nn.Module, model: nn.Module) -> Iterator[None]:
    """While ``deepspeed.initialize`` builds the engine around ``module``: a parameterless
    ``deepspeed.moe.layer.MoE`` on it when ``model`` holds split experts that train, so the
    engine builds its ZeRO-1/2 optimizer with the expert groups (the module docstring); taken
    off after, so nothing else (checkpoints, state dicts) ever meets it."""
    shards = [experts_state(m).shard for _, m in expert_modules(model)]
    found = [s for s in shards if s is not None]
    trained = any(p.requires_grad and hasattr(p, "memtune_shard") for p in model.parameters())
    zero3 = any(hasattr(p, "ds_zero_placement_family") for p in model.parameters())
    if not found or not trained or zero3:
        # frozen experts (peft.target=all-linear-but-experts): no gradient to keep apart, and
        # DeepSpeed's MoE mode would want an expert optimizer group; ZeRO-3 reads the tags
        # (partition_experts_over_groups) and asserts on any MoE module but AutoEP's
        yield
        return
    shard = found[0]
    from deepspeed.moe.layer import MoE

    class ExpertParallelMark(MoE):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.num_experts = shard.total
            self.ep_size = shard.size
            self.num_local_experts = shard.count
            self.expert_group_name = shard.group_name
            self.enable_expert_tensor_parallelism = False

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            pass  # the groups exist: expert_parallel_group

    name = "memtune_expert_parallel"
    module.add_module(name, ExpertParallelMark())
    try:
        yield
    finally:
        del module._modules[name]


def gathered_expert_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each split expert adapter of ``model`` whole (every rank's share, in expert order), on
    the host, by its name among ``model``'s parameters; empty without expert parallelism. A
    collective: every rank of the run calls it."""
    out = {}
    for module_name, experts in expert_modules(model):
        shard = experts_state(experts).shard
        if shard is None:
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, param in experts.named_parameters(recurse=False):
            if not param.requires_grad or stack_adapter(prefix + name) is None:
                continue
            out[prefix + name] = whole_experts(param, param.detach()).cpu()
    return out


def whole_experts(param: Any, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a value of ``param``: its weight, gradient or optimizer moment) for every
    expert of the layer, gathered from the ranks of ``param``'s expert-parallel group when
    :func:`split_experts` split it (a collective over that group), else as it is."""
    shard = getattr(param, "memtune_shard", None)
    if shard is None:
        return tensor
    mine = tensor.contiguous()
    parts = [torch.empty_like(mine) for _ in range(shard.size)]
    dist.all_gather([_wire(p) for p in parts], _wire(mine), group=shard.group)
    return torch.cat(parts)


def own_experts(param: Any, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`whole_experts`: this rank's experts of a whole layer's
    ``tensor``, when ``param`` is split."""
    shard = getattr(param, "memtune_shard", None)
    if shard is None:
        return tensor
    return tensor[shard.first : shard.first + shard.count]
