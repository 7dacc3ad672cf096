"""A rank's parts, built in one place: the base model with LoRA, and the DeepSpeed engine around
memtune's loss with the configured optimizer and schedule.

:func:`build_rank` is what ``memtune.worker`` runs on every rank: :func:`build_model`, then
the engine around it (:func:`build_engine`). The GPU check (``bench/gpu_check/``:
``memtune_runner.py``, ``hybrid.py``, ``zero_cost.py``) calls them too, with its own base
builder (real Qwen2.5-7B shapes, random weights, in memory), so the GPU check measures the
same parts a training run builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memtune.config import ConfigError, RunConfig, preference_loss_kind
from memtune.config.architecture import loaded_mismatches
from memtune.config.decisions import Decisions
from memtune.rank.attention import split_by_kv_head
from memtune.rank.expert_parallel import (
    deepspeed_sees_experts,
    expert_param_groups,
    partition_before_the_engine,
    partition_experts_over_groups,
    split_experts,
)
from memtune.rank.kernels import Wired, kernels_label, use_fused_kernels
from memtune.rank.layers import set_checkpointed_layers
from memtune.rank.linear_attention import keep_samples_apart, split_over_ranks
from memtune.rank.long_context import (
    keep_inputs_on_device,
    offload_checkpoints,
    tile_mlps,
    untile_mlps,
)
from memtune.rank.lora_dropout import regenerated_dropouts, use_lora_dropout
from memtune.rank.loss import CausalLMLoss, use_loss_kernel
from memtune.rank.model import (
    add_lora,
    compile_layers,
    count_parameters,
    load_base_model,
    use_attention,
)
from memtune.rank.optim import build_optimizer, param_groups, scheduler_factory, with_rates

LoadBase = Callable[[RunConfig, Decisions], Any]
"""(settings, decisions) -> the base model, before LoRA."""


@dataclass
class RankParts:
    model: Any  # the peft model (LoRA on the base)
    engine: Any  # deepspeed's engine around CausalLMLoss(model)
    attention: str
    loss_kind: str
    optimizer_note: str
    trainable: int
    total: int
    compiled_layers: int = 0  # trainer.compile
    mlp_tiles: int = 0  # trainer.tiled_mlp: tiles per MLP call (0: not tiled)
    offloaded_layers: int = 0  # trainer.offload_activations: layers whose input waits on the host
    linear_attention: str | None = None  # how packed rows pass linear-attention layers (Qwen3.5)
    kernels: str = ""  # the fused layer kernels reached (rank.kernels); "": transformers' own
    regenerated_dropouts: int = 0  # adapters whose dropout mask is regenerated (rank.lora_dropout)


def built_under_zero_init(d: Decisions) -> bool:
    """Whether the base is built under zero.Init (ZeRO-3): not under expert parallelism, where
    zero.Init would partition every expert over all the ranks; there each rank reads its own
    experts on the host, and :func:`build_model` converts the model to ZeRO-3 parameters, a
    parameter at a time, once the experts are tagged with their partition groups
    (rank.expert_parallel.partition_experts_over_groups, partition_before_the_engine). A
    quantized base is never built under it either: transformers reads it whole, whatever this
    says."""
    split = d.experts is not None and d.experts.parallel > 1
    return d.zero_stage == 3 and not split


@dataclass
class RankModel:
    """A rank's model before DeepSpeed wraps it (:func:`build_model`): the peft model with
    every decision applied, and what :func:`build_engine` and :class:`RankParts` need of it."""

    model: Any  # the peft model (LoRA on the base)
    attention: str
    mpu: Any  # the sequence-parallel groups (rank/sequence_parallel.py), or None
    trainable: int
    total: int
    compiled_layers: int
    mlp_tiles: int
    offloaded_layers: int
    linear_attention: str | None
    kernels: Wired
    regenerated_dropouts: int
    # DeepSpeed's HfDeepSpeedConfig while the base is built under zero.Init: held until the
    # engine is built (transformers and peft ask it whether ZeRO-3 partitions what they make)
    zero_init_config: Any = None


def build_model(
    cfg: RunConfig,
    d: Decisions,
    ds_config: dict[str, Any],
    device: torch.device,
    local_rank: int = 0,
    load_base: LoadBase | None = None,
    zero_init: bool | None = None,
) -> RankModel:
    """Base (``load_base``, default: from_pretrained of model.name_or_path on this rank's
    device) and LoRA, each as decided (``d``: decisions.json), before DeepSpeed: what
    :func:`build_rank` wraps in its engine, and what the GPU check's ``zero-cost`` phase also
    steps without one. ``zero_init`` (default: ZeRO-3) keeps DeepSpeed's HfDeepSpeedConfig
    alive while the base is built, so transformers creates it under zero.Init, partitioned as
    it is built. Under ZeRO-3 with expert parallelism the base is read without it and the model
    returned is made of ZeRO-3 parameters already (:func:`built_under_zero_init`)."""
    from transformers.integrations import HfDeepSpeedConfig

    attn = use_attention(d.attention, device.type)
    if load_base is None:
        gpu = local_rank if device.type == "cuda" else None

        def load_base(c: RunConfig, decided: Decisions) -> Any:
            return load_base_model(c, decided, gpu)

    use_zero_init = built_under_zero_init(d) if zero_init is None else zero_init
    hf_ds = HfDeepSpeedConfig(ds_config) if use_zero_init else None
    # Loading must not move the RNG the adapters are then drawn from: under zero.Init the
    # modules are built for real, and a Qwen3.5 linear-attention layer draws its A_log at
    # construction, so LoRA would start elsewhere under ZeRO-3 than under ZeRO-2 or one rank.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        base = load_base(cfg, d)
    wrong = loaded_mismatches(cfg, base.config)
    if wrong:
        raise ConfigError(
            f"{cfg.model.name_or_path} is not the model that was planned: "
            + "; ".join(wrong)
            + ". The memory plan does not hold for it; plan again (make plan / plan_only=true) "
            "with the checkpoint on disk."
        )
    model = add_lora(base, cfg, d)
    kernels = use_fused_kernels(model, d.kernels, device)
    regenerated = regenerated_dropouts(model)
    linear = keep_samples_apart(base)
    compiled = compile_layers(model, d.zero_stage == 3) if cfg.trainer.compile else 0
    tiles, offloaded = apply_layer_decisions(model, d, device)
    trainable, total = count_parameters(model)
    if d.experts is not None and d.experts.parallel > 1:
        split_experts(model, d.experts.parallel)  # counted whole above, as the plan counts
        if d.zero_stage == 3:
            partition_experts_over_groups(model)
    mpu = None
    if d.sequence_parallel > 1:
        from memtune.rank.sequence_parallel import register_attention

        sp, micro = d.sequence_parallel, d.batch.micro_batch
        mpu = register_attention(base, attn, sp, micro)
        if linear:
            group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
            split_over_ranks(base, group, sp, sp_rank)
    if d.zero_stage == 3 and d.experts is not None and d.experts.parallel > 1:
        # now, not in deepspeed.initialize: the engine would first move the whole of a model
        # read on the host onto the device (rank.expert_parallel.partition_before_the_engine)
        partition_before_the_engine(model, ds_config, device, mpu)
    return RankModel(
        model=model,
        attention=attn,
        mpu=mpu,
        trainable=trainable,
        total=total,
        compiled_layers=compiled,
        mlp_tiles=tiles,
        offloaded_layers=offloaded,
        linear_attention=linear,
        kernels=kernels,
        regenerated_dropouts=regenerated,
        zero_init_config=hf_ds,
    )


def build_rank(
    cfg: RunConfig,
    d: Decisions,
    ds_config: dict[str, Any],
    device: torch.device,
    local_rank: int = 0,
    load_base: LoadBase | None = None,
    zero_init: bool | None = None,
) -> RankParts:
    """The model as :func:`build_model` builds it (its arguments), in the DeepSpeed engine
    around memtune's loss with the configured optimizer and schedule."""
    built = build_model(cfg, d, ds_config, device, local_rank, load_base, zero_init)
    mpu = built.mpu
    engine, optimizer_note = build_engine(cfg, d, built.model, device, ds_config, mpu)
    if mpu is not None and cfg.trainer.objective != "sft":
        # A pair's sequence log-probabilities are summed over the group's shards.
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        engine.module.split_over(group, sp_rank)
    built.zero_init_config = None
    return RankParts(
        model=built.model,
        engine=engine,
        attention=built.attention,
        loss_kind=engine.module.kind,
        optimizer_note=optimizer_note,
        trainable=built.trainable,
        total=built.total,
        compiled_layers=built.compiled_layers,
        mlp_tiles=built.mlp_tiles,
        offloaded_layers=built.offloaded_layers,
        linear_attention=built.linear_attention,
        kernels=kernels_label(built.kernels, d.kernels),
        regenerated_dropouts=built.regenerated_dropouts,
    )


def apply_layer_decisions(model: Any, d: Decisions, device: torch.device) -> tuple[int, int]:
    """Every per-layer decision of ``d`` on ``model`` (the peft model), whatever was applied
    before: which layers recompute (rank.layers), the MLP tiled for the rank's tokens per micro
    batch, the checkpointed layers' inputs offloaded (rank.long_context), attention as one
    call per KV head or one in all (rank.attention). build_rank applies a
    run's decisions through it; bench/gpu_check applies a new length's decided value through
    it to the engine it has. (With trainer.compile the layers are compiled for the decisions
    made at build: compile_layers.) Returns (tiles per MLP call, layers offloading)."""
    base = model.get_base_model()
    set_checkpointed_layers(model, d.checkpointing)
    split_by_kv_head(base, d.attention_by_kv_head)
    tiles = tile_mlps(base, d.batch.rank_tokens) if d.tiled_mlp else untile_mlps(base)
    if d.offload_activations:
        return tiles, offload_checkpoints(base, device)
    return tiles, keep_inputs_on_device(base)


def apply_kernel_decisions(module: CausalLMLoss, d: Decisions, device: torch.device) -> Wired:
    """The decided kernels on a built rank's loss module (``engine.module``: the loss and its
    peft model), whatever was applied before: the loss kernel, the layer kernels
    (rank.kernels) and LoRA's dropout (rank.lora_dropout). build_rank applies them as it
    builds; bench/gpu_check's kernels phase applies each variant's decisions through this to
    the engine it has."""
    from memtune.rank.preference import PreferenceLoss

    kind = use_loss_kernel(d.loss, device)
    module.kind = preference_loss_kind(kind) if isinstance(module, PreferenceLoss) else kind
    use_lora_dropout(module.model, d.kernels.lora_dropout)
    return use_fused_kernels(module.model, d.kernels, device)


def loss_module(cfg: RunConfig, d: Decisions, model: Any, device: torch.device) -> torch.nn.Module:
    """What DeepSpeed wraps: the model and the objective's loss (SFT's token loss, or a
    preference objective's pair loss, rank.preference), with the decided loss kernel."""
    loss_kind = use_loss_kernel(d.loss, device)
    chunk = cfg.trainer.loss_chunk_tokens
    if cfg.trainer.objective == "sft":
        return CausalLMLoss(model, loss_kind, chunk)
    from memtune.config.derive import beta_of
    from memtune.rank.preference import PreferenceLoss

    p = cfg.preference
    kind = preference_loss_kind(loss_kind)
    beta = beta_of(cfg)
    assert beta is not None  # every preference objective has one
    return PreferenceLoss(
        model,
        kind,
        chunk,
        cfg.trainer.objective,
        beta,
        p.label_smoothing,
        p.simpo_gamma,
        reference_adapter=cfg.peft.init_from is not None,
    )


def build_engine(
    cfg: RunConfig,
    d: Decisions,
    model: Any,
    device: torch.device,
    ds_config: dict[str, Any],
    mpu: Any = None,
) -> tuple[Any, str]:
    """The DeepSpeed engine around memtune's loss module, with the configured optimizer and
    schedule; returns it and a line naming the optimizer. ``mpu``: the sequence-parallel
    groups (rank/sequence_parallel.py), when sequences are split."""
    import deepspeed

    groups = expert_param_groups(param_groups(cfg, model))
    optimizer, optimizer_note = build_optimizer(cfg, d.optimizer, groups, device)
    if cfg.peft.loraplus_lr_ratio is not None:
        optimizer_note += f" · LoRA+: B at {cfg.peft.loraplus_lr_ratio:g}× the rate of A"
    module = loss_module(cfg, d, model, device)
    with deepspeed_sees_experts(module, model):
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            model_parameters=with_rates(groups, cfg.trainer.lr) if optimizer is None else None,
            lr_scheduler=scheduler_factory(cfg),
            config=ds_config,
            mpu=mpu,
        )
    return engine, optimizer_note
