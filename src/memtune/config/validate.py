"""What a type cannot express (ranges, divisibility, choices, files that must exist), checked
before anything starts; every error names the offending field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

from memtune.adapter_check import adapter_problem
from memtune.config import schema as schema_module
from memtune.config.architecture import linear_attention_layers, routed_experts
from memtune.config.decisions import (
    LEAN_KERNELS,
    SPLITTING_KERNELS,
    dropout_regeneration_unbuilt,
    fused_kernel,
    kernels_unwired,
    lean_kernel,
    lean_unbuilt,
)
from memtune.config.logger_check import check_logger
from memtune.config.mixture_checks import check_experts, check_experts_split
from memtune.config.schema import (
    FORMATS,
    ConfigError,
    DataConfig,
    ModelConfig,
    PreferenceConfig,
    RunConfig,
    cache_dir,
    choices_of,
)
from memtune.paths import hub_dataset, is_local_source


def _choice_fields(schema: type = RunConfig, prefix: str = "") -> dict[str, tuple[Any, ...]]:
    """Every ``Choice[...]`` field of the schema, dotted, with the values its Literal allows."""
    found: dict[str, tuple[Any, ...]] = {}
    hints = typing.get_type_hints(schema, include_extras=False)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            found.update(_choice_fields(hints[f.name], f"{prefix}{f.name}."))
            continue
        match = re.fullmatch(r"Choice\[(\w+)\]", str(f.type))
        if match:
            found[prefix + f.name] = choices_of(getattr(schema_module, match.group(1)))
    return found


_CHOICES = _choice_fields()
"""``{"peft.method": ("lora", "qlora", "lora-int8"), ...}``: from the schema's Literals."""


def get_field(cfg: RunConfig, dotted: str) -> Any:
    """``get_field(cfg, "peft.r")`` → cfg.peft.r."""
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_finite(value: Any, key: str = "") -> None:
    """Every number of the settings is finite: nan passes every range check (each comparison
    is False), so trainer.lr=nan trained on NaN and plan.device_gib=nan planned "nan GiB";
    inf (null is the setting for "none") made lr=inf or plan.device_gib=inf run unchecked."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number (got {value})")


def validate(cfg: RunConfig, inputs: bool = True) -> None:
    """Check what types cannot; raise :class:`ConfigError` naming the first bad field.
    ``inputs=False`` leaves out the model and data paths (a memory plan needs neither)."""
    _check_finite(cfg)
    for key, choices in _CHOICES.items():
        if get_field(cfg, key) not in choices:
            allowed = " | ".join(str(c) for c in choices)
            raise ConfigError(f"{key}={get_field(cfg, key)!r} is not supported; choose {allowed}")

    _preference_settings(cfg)
    _lora_variants(cfg)
    t, p = cfg.trainer, cfg.peft
    positive = {
        "peft.r": p.r,
        "peft.alpha": p.alpha,
        "trainer.micro_batch_size": t.micro_batch_size,
        "trainer.global_batch_size": t.global_batch_size,
        "trainer.max_steps": t.max_steps,
        "trainer.lr": t.lr,
        "trainer.log_every": t.log_every,
        "trainer.loss_chunk_tokens": t.loss_chunk_tokens,
        "trainer.keep_last": t.keep_last,
        "trainer.max_skipped_steps": t.max_skipped_steps,
        "launcher.num_ranks": cfg.launcher.num_ranks,
        "launcher.nnodes": cfg.launcher.nnodes,
        "data.max_seq_len": cfg.data.max_seq_len,
        "plan.image_width": cfg.plan.image_width,
        "plan.image_height": cfg.plan.image_height,
        "plan.host_link_gb_s": cfg.plan.host_link_gb_s,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    for key, rate in {
        "plan.device_gib": cfg.plan.device_gib,
        "plan.host_gib": cfg.plan.host_gib,
        "launcher.omp_threads": cfg.launcher.omp_threads,
        "plan.device_tflops": cfg.plan.device_tflops,
        "plan.link_gb_s": cfg.plan.link_gb_s,
        "plan.device_gb_s": cfg.plan.device_gb_s,
    }.items():
        if rate is not None and rate <= 0:
            raise ConfigError(f"{key} must be > 0 or null (got {rate})")
    if not 0.0 < cfg.plan.mfu <= 1.0:
        raise ConfigError(f"plan.mfu must be in (0, 1] (got {cfg.plan.mfu})")
    for key, count in {
        "plan.images": cfg.plan.images,
        "trainer.weight_decay": t.weight_decay,
        "trainer.optim_8bit_min_size": t.optim_8bit_min_size,
        "data.num_workers": cfg.data.num_workers,
    }.items():
        if count < 0:
            raise ConfigError(f"{key} must be >= 0 (got {count})")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"trainer.seed must be in [0, 2**32) (got {t.seed}; numpy's seeds)")
    if cfg.trainer.compile and cfg.peft.method != "lora":
        raise ConfigError(
            f"trainer.compile=true is only built and tested for peft.method=lora (a "
            f"{cfg.peft.method} base runs bitsandbytes kernels inside each layer); "
            "set trainer.compile=false"
        )
    if t.offload_activations == "on" and not t.activation_checkpointing:
        raise ConfigError(
            "trainer.offload_activations=on moves checkpointed layers' inputs to the host: it "
            "needs trainer.activation_checkpointing=true"
        )
    if t.compile and "on" in (t.tiled_mlp, t.offload_activations):
        raise ConfigError(
            "trainer.compile=true is not built together with trainer.tiled_mlp / "
            "offload_activations=on (with compile, auto leaves both off); turn one off"
        )
    if not 0.0 <= p.dropout < 1.0:
        raise ConfigError(f"peft.dropout must be in [0, 1) (got {p.dropout})")
    unbuilt = dropout_regeneration_unbuilt(cfg)
    if t.lora_dropout_kernel == "regenerate" and p.dropout == 0:
        raise ConfigError(
            "trainer.lora_dropout_kernel=regenerate with peft.dropout=0: nothing is dropped, so "
            "there is no mask to regenerate; set peft.dropout > 0, or leave the kernel on auto"
        )
    if t.lora_dropout_kernel == "regenerate" and unbuilt:
        raise ConfigError(
            f"trainer.lora_dropout_kernel=regenerate is not built with {unbuilt}; use "
            "trainer.lora_dropout_kernel=auto (peft's dropout there)"
        )
    if t.warmup_steps < 0:
        raise ConfigError(f"trainer.warmup_steps must be >= 0 (got {t.warmup_steps})")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"trainer.min_lr_ratio must be in [0, 1] (got {t.min_lr_ratio})")
    ckpt = str(t.checkpoint_layers)
    if ckpt not in ("all", "auto") and not (ckpt.isdigit() and int(ckpt) >= 0):
        raise ConfigError(
            f"trainer.checkpoint_layers={ckpt!r} is not supported; choose all | auto | a number "
            "of layers >= 0"
        )
    if not t.activation_checkpointing and (ckpt not in ("auto", "0") or t.checkpointing_reentrant):
        # Both were dropped without a word: the run checkpointed nothing.
        asked = (
            f"trainer.checkpoint_layers={ckpt}"
            if ckpt not in ("auto", "0")
            else "trainer.checkpointing_reentrant=true"
        )
        raise ConfigError(
            f"{asked} with trainer.activation_checkpointing=false: nothing is checkpointed "
            "then; set trainer.activation_checkpointing=true to checkpoint, or leave "
            "trainer.checkpoint_layers=auto and trainer.checkpointing_reentrant=false"
        )
    _check_selective(cfg)
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every must be >= 0 (got {t.eval_every})")
    if t.save_every < 0:
        raise ConfigError(
            f"trainer.save_every must be >= 0, 0 saves at the end only (got {t.save_every})"
        )
    if t.max_grad_norm < 0:
        raise ConfigError(f"trainer.max_grad_norm must be >= 0, 0 disables (got {t.max_grad_norm})")
    port = cfg.launcher.master_port
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"launcher.master_port={port} is not a port: choose one in 1-65535, or leave it "
            "unset (null) for memtune's default"
        )
    if cfg.launcher.num_ranks % cfg.launcher.nnodes:
        raise ConfigError(
            f"launcher.num_ranks={cfg.launcher.num_ranks} (all ranks) is not a multiple of "
            f"launcher.nnodes={cfg.launcher.nnodes}: every node runs the same number of ranks"
        )
    sp = str(t.sequence_parallel)
    if sp != "auto" and not (sp.isdigit() and int(sp) >= 1):
        raise ConfigError(
            f"trainer.sequence_parallel={sp!r} is not supported; choose auto | 1 | 2 | 4 ... "
            "(ranks each sequence is split over)"
        )
    # auto: the batch must divide evenly at 1, the split the planner starts from
    requested_sp = int(sp) if sp.isdigit() else 1
    _check_split_ranks(cfg, requested_sp)
    if t.loss == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "trainer.loss=liger needs the liger-kernel package (CUDA only); "
            "use trainer.loss=auto to fall back to memtune's chunked loss"
        )
    _check_kernels(cfg)
    attn = cfg.model.attn_implementation
    if attn in ("torch_varlen", "flash_attention_2") and t.precision == "fp32":
        kernel = "FlashAttention-2" if attn == "flash_attention_2" else "torch's varlen kernel"
        raise ConfigError(
            f"model.attn_implementation={attn} with trainer.precision=fp32: {kernel} runs "
            "bf16 and fp16 only; use trainer.precision=bf16, or model.attn_implementation=auto"
        )
    splitting = (*SPLITTING_KERNELS, "auto")
    if t.attention_by_kv_head == "on" and cfg.model.attn_implementation not in splitting:
        raise ConfigError(
            f"trainer.attention_by_kv_head=on with model.attn_implementation="
            f"{cfg.model.attn_implementation}: one call per KV head is built into "
            f"{', '.join(SPLITTING_KERNELS)} only; choose one of them (or auto), or "
            "trainer.attention_by_kv_head=auto"
        )
    for key in ("zero.reduce_bucket_size", "zero.prefetch_bucket_size"):
        value = get_field(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be > 0 when set (got {value})")
    if (
        cfg.zero.param_persistence_threshold is not None
        and cfg.zero.param_persistence_threshold < 0
    ):
        raise ConfigError("zero.param_persistence_threshold must be >= 0 when set")
    arch = cfg.model.architecture
    if not arch.get("hidden_size"):
        raise ConfigError(
            f"model.architecture is empty and {cfg.model.name_or_path!r} has no config.json on "
            "disk to read it from: download the checkpoint first (hf download NAME), or use a "
            "model group that carries its config.json fields (see conf/model/qwen2.5-7b.yaml)"
        )
    if cfg.model.name_or_path in ("", "???"):
        raise ConfigError("model.name_or_path is not set: give a hub name or a local directory")
    _check_synthesized_path(cfg.model)
    _check_layer_counts(cfg)
    check_experts(cfg)
    _check_ulysses(cfg, requested_sp)
    _check_positions(cfg)
    # a plan too: its LoRA is the adapter's shape (a plan of another r counted other weights)
    _check_init_from(cfg)
    if inputs:
        _check_model_path(cfg.model)
        _check_data(cfg.data)
        _check_objective(cfg)
        _check_attention_here(cfg.model)
        _check_kernels_here(cfg)
        check_logger(cfg.logger)


KERNELS = ("rms_norm", "swiglu", "rope")
"""trainer's layer-kernel settings, trainer.{name}_kernel (auto | torch | liger, and lean for
RMSNorm and SwiGLU; rank.kernels)."""


def liger_kernels(cfg: RunConfig) -> list[str]:
    """The layer kernels asked for as liger (``["rope"]``: trainer.rope_kernel=liger)."""
    return [k for k in KERNELS if getattr(cfg.trainer, f"{k}_kernel") == "liger"]


def _check_kernels(cfg: RunConfig) -> None:
    """Liger's layer kernels are wired for the dense Qwen2 / Qwen3 layers (rank.kernels): a
    mixture of experts, Qwen3.5's hybrid layers (gated attention, partial rotary, its own
    norms) and compiled layers are refused by name."""
    lean = [k for k in LEAN_KERNELS if getattr(cfg.trainer, f"{k}_kernel") == "lean"]
    if lean and (why := lean_unbuilt(cfg)):
        raise ConfigError(
            f"trainer.{lean[0]}_kernel=lean is wired for the dense Qwen2 / Qwen2.5 / Qwen3 "
            f"layers without trainer.compile; {cfg.model.name_or_path} runs with {why}: use "
            f"trainer.{lean[0]}_kernel=auto"
        )
    asked = liger_kernels(cfg)
    if not asked:
        return
    name = asked[0]
    if why := kernels_unwired(cfg):
        raise ConfigError(
            f"trainer.{name}_kernel=liger is wired for the dense Qwen2 / Qwen2.5 / Qwen3 layers "
            f"only; {cfg.model.name_or_path} is {why}: use trainer.{name}_kernel=auto (torch)"
        )
    if cfg.trainer.compile:
        raise ConfigError(
            f"trainer.{name}_kernel=liger is not built together with trainer.compile=true "
            "(Liger's Triton kernels inside compiled layers are untested); turn one off"
        )


def _check_kernels_here(cfg: RunConfig) -> None:
    """A layer kernel asked for as liger on a machine that cannot run it: refused here, before
    any rank starts (a rank that finds otherwise refuses too: rank.kernels). Not for a memory
    plan (``inputs=False``): planning a GPU run on a laptop is fine."""
    asked = liger_kernels(cfg)
    if not asked:
        return
    name = asked[0]
    from memtune.machine import cuda_available

    if not cuda_available():
        why = "this machine has no CUDA GPU (Liger's kernels are Triton, GPU only)"
    elif importlib.util.find_spec("liger_kernel") is None:
        why = "the liger-kernel package is not installed (pip install -e '.[liger]')"
    else:
        return
    # What auto runs instead: the lean RMSNorm / SwiGLU where they are wired (the dense Qwen2 /
    # Qwen3 layers), transformers' own code elsewhere and for the rotary embedding.
    auto = lean_kernel(cfg, "auto") if name in LEAN_KERNELS else fused_kernel("auto")
    raise ConfigError(
        f"trainer.{name}_kernel=liger cannot run here: {why}; use trainer.{name}_kernel=auto "
        f"({auto} here)"
    )


def _check_attention_here(model: ModelConfig) -> None:
    """FlashAttention-2 or torch_varlen asked for by name on a machine that cannot run it:
    refused here, on the machine the ranks start from, rather than by every rank once it has
    loaded the model (rank.model.use_attention). Not for a memory plan (``inputs=False``):
    planning a GPU run on a laptop is fine."""
    attn = model.attn_implementation
    if attn not in ("flash_attention_2", "torch_varlen"):
        return
    from memtune.machine import cuda_available

    if not cuda_available():
        kernel = (
            "torch's variable-length attention is FlashAttention's CUDA kernel"
            if attn == "torch_varlen"
            else "FlashAttention-2 has no CPU kernel"
        )
        why = f"this machine has no CUDA GPU ({kernel})"
    elif attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        why = (
            "the flash-attn package is not installed (pip install -c constraints.txt -e "
            "'.[flash]', needs nvcc)"
        )
    else:
        return
    raise ConfigError(
        f"model.attn_implementation={attn} cannot run here: {why}; use "
        "model.attn_implementation=auto (FlashAttention-2 where it runs, else sdpa_varlen) "
        "or sdpa"
    )


def selective_unbuilt(cfg: RunConfig) -> str | None:
    """What keeps selective recompute (trainer.selective_layers) from this run's settings, in
    words; None when it is built for them. The long-context switches are the decider's to
    weigh (a tiled MLP or offloaded inputs leave no selective layer)."""
    t = cfg.trainer
    if not t.activation_checkpointing:
        return "trainer.activation_checkpointing=false"
    if t.checkpointing_reentrant:
        return "trainer.checkpointing_reentrant=true (torch runs it non-reentrant only)"
    if t.compile:
        return "trainer.compile=true"
    if "on" in (t.tiled_mlp, t.offload_activations):
        return "trainer.tiled_mlp / offload_activations=on"
    if cfg.model.attn_implementation == "eager":
        return "model.attn_implementation=eager (its n × n scores would be kept)"
    if cfg.peft.dora:
        return "peft.dora=true (its weight products would be kept)"
    arch = dict(cfg.model.architecture)
    if routed_experts(arch):
        return "a mixture of experts"
    if linear_attention_layers(arch):
        return "linear-attention layers (Qwen3.5)"
    return None


def _check_selective(cfg: RunConfig) -> None:
    value = str(cfg.trainer.selective_layers)
    if value not in ("all", "auto") and not (value.isdigit() and int(value) >= 0):
        raise ConfigError(
            f"trainer.selective_layers={value!r} is not supported; choose all | auto | a number "
            "of layers >= 0"
        )
    why = selective_unbuilt(cfg)
    if why and value not in ("auto", "0"):
        raise ConfigError(
            f"trainer.selective_layers={value} with {why}: selective recompute is not built for "
            "that; leave trainer.selective_layers=auto (it keeps none there)"
        )


def _check_layer_counts(cfg: RunConfig) -> None:
    """trainer.checkpoint_layers / selective_layers as a number of layers the model has (they
    were cut to the model's count without a word: 99 on a 2-layer model ran as all)."""
    layers = int(cfg.model.architecture.get("num_hidden_layers") or 0)
    if not layers:
        return
    for key in ("checkpoint_layers", "selective_layers"):
        value = str(getattr(cfg.trainer, key))
        if value.isdigit() and int(value) > layers:
            raise ConfigError(
                f"trainer.{key}={value}: {cfg.model.name_or_path} has {layers} layers "
                f"(num_hidden_layers); choose 0-{layers}, all, or auto"
            )


def check_sequence_parallel(cfg: RunConfig, sp: int) -> None:
    """Whether ``cfg`` can split each sequence over ``sp`` ranks (the user's setting, or a
    split the planner considers); ConfigError naming the rule it breaks."""
    _check_split_ranks(cfg, sp)
    _check_ulysses(cfg, sp)


def _check_split_ranks(cfg: RunConfig, sp: int) -> None:
    """The ranks form groups of sp, and the global batch divides over the data-parallel
    groups."""
    t, ranks = cfg.trainer, cfg.launcher.num_ranks
    if ranks % sp:
        raise ConfigError(
            f"trainer.sequence_parallel={sp} does not divide launcher.num_ranks={ranks}: the "
            f"ranks form groups of {sp} that split each sequence"
        )
    dp = ranks // sp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        across = (
            f"launcher.num_ranks = {t.micro_batch_size} × {ranks}"
            if sp == 1
            else f"data-parallel ranks (launcher.num_ranks / trainer.sequence_parallel) = "
            f"{t.micro_batch_size} × {dp}"
        )
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
            f"trainer.micro_batch_size × {across} = {per_step}"
        )


def _check_ulysses(cfg: RunConfig, sp: int) -> None:
    """Ulysses' rules (DeepSpeed's UlyssesSPAttentionHF checks them too, on a rank, mid-load):
    each rank of a group attends for heads/sp query heads and its share of the KV heads
    (replicated when there are fewer KV heads than ranks), over the whole sequence, which is
    cut into sp equal shards; not built for routed experts."""
    if sp == 1:
        return
    arch = cfg.model.architecture
    check_experts_split(cfg, sp)
    if linear_attention_layers(arch):
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            count = int(arch.get(field) or 0)
            if count % sp:
                raise ConfigError(
                    f"trainer.sequence_parallel={sp} must divide the model's {field}={count} "
                    "(each rank runs the linear-attention recurrence for heads / sp of them); "
                    f"choose one of {[d for d in range(1, count + 1) if count % d == 0]}"
                )
    heads = int(arch.get("num_attention_heads") or 0)
    kv = int(arch.get("num_key_value_heads") or heads)
    where = f"trainer.sequence_parallel={sp}"
    if heads % sp:
        raise ConfigError(
            f"{where} must divide the model's {heads} attention heads (each rank attends for "
            f"heads / sp of them); choose one of {_divisors(heads, kv)}"
        )
    if kv % sp and sp % kv:
        raise ConfigError(
            f"{where} must divide the model's {kv} KV heads or be a multiple of them; "
            f"choose one of {_divisors(heads, kv)}"
        )
    if cfg.data.max_seq_len % sp:
        raise ConfigError(
            f"{where} must divide data.max_seq_len={cfg.data.max_seq_len} (each rank holds an "
            "equal shard of every sequence)"
        )
    attn = cfg.model.attn_implementation
    if attn in ("sdpa", "eager"):
        raise ConfigError(
            f"{where} with model.attn_implementation={attn}: sequence parallelism marks samples "
            "by positions and sample boundaries, not a dense mask, which "
            f"transformers' {attn} needs; use auto (sdpa_varlen, or FlashAttention-2 on a GPU)"
        )


def _check_positions(cfg: RunConfig) -> None:
    from memtune.config.derive import rope_positions

    limit = rope_positions(cfg)
    if limit and cfg.data.max_seq_len > limit:
        raise ConfigError(
            f"data.max_seq_len={cfg.data.max_seq_len:,} is beyond the {limit:,} positions "
            f"{cfg.model.name_or_path} encodes (max_position_embeddings"
            + (" × model.rope_scaling.factor" if cfg.model.rope_scaling else "")
            + "); lower it, or set model.rope_scaling (Qwen2.5 documents YaRN: "
            "{type: yarn, factor: 4.0, original_max_position_embeddings: 32768})"
        )


def _divisors(heads: int, kv: int) -> str:
    ok = [n for n in range(1, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
    return ", ".join(str(n) for n in ok)


def _not_there(source: str) -> bool:
    """A data source that is neither a path on this machine nor a hub dataset's name."""
    return hub_dataset(source) is None and not Path(source).expanduser().exists()


def _check_data(data: DataConfig) -> None:
    if data.path and data.sources:
        raise ConfigError("data.path and data.sources are both set: use one")
    if not data.path and not data.sources:
        raise ConfigError(
            "data.path is not set: give your file, e.g. data.path=/data/train.jsonl "
            "(or data.sources for several)"
        )
    for i, src in enumerate(data.all_sources()):
        key = "data.path" if not data.sources else f"data.sources[{i}]"
        if src.format not in FORMATS:
            raise ConfigError(f"{key}: format {src.format!r}; choose {' | '.join(FORMATS)}")
        if src.weight <= 0:
            raise ConfigError(f"{key}: weight must be > 0 (got {src.weight})")
        if _not_there(src.path):
            raise ConfigError(f"{key}={src.path!r}: no such file or folder")
    if not 0.0 <= data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1) (got {data.val_fraction})")
    if data.val_path and data.val_fraction:
        raise ConfigError("data.val_path and data.val_fraction are both set: use one")
    if data.val_path and _not_there(data.val_path):
        raise ConfigError(f"data.val_path={data.val_path!r}: no such file or folder")
    if data.overlong == "split":
        chat = [s.format for s in data.all_sources() if s.format != "text"]
        if "preference" in chat:
            raise ConfigError(
                "data.overlong=split cuts long documents (format text); a preference pair is "
                "never cut apart (its chosen and rejected sequences share one row, "
                "data.max_seq_len bounding the two): use truncate or drop for it"
            )
        if chat:
            raise ConfigError(
                f"data.overlong=split cuts long documents (format text); a {chat[0]} record "
                "cut in pieces would lose its prompt: use truncate or drop for it"
            )
    for key in ("min_pixels", "max_pixels"):
        value = getattr(data, key)
        if value is not None and value < 1:
            raise ConfigError(f"data.{key} must be a positive number of pixels (got {value})")
    if data.min_pixels and data.max_pixels and data.min_pixels > data.max_pixels:
        raise ConfigError(
            f"data.min_pixels={data.min_pixels} is above data.max_pixels={data.max_pixels}"
        )
    if data.image_cache_gb <= 0:
        raise ConfigError(f"data.image_cache_gb must be > 0 (got {data.image_cache_gb})")
    if data.packing and data.group_by_length:
        raise ConfigError(
            "data.group_by_length batches unpacked samples; packing is on by default: "
            "set data.packing=false with it"
        )


def _check_objective(cfg: RunConfig) -> None:
    """Preference pairs and the preference objectives come together: an SFT loss over pairs
    would learn the rejected replies as much as the chosen ones, and a preference loss has
    nothing to compare in single conversations. The validation file (data.val_path) is read
    in the first source's format, so checking the sources covers it."""
    objective, data = cfg.trainer.objective, cfg.data
    for i, src in enumerate(data.all_sources()):
        key = "data.format" if not data.sources else f"data.sources[{i}].format"
        if objective != "sft" and src.format != "preference":
            raise ConfigError(
                f"trainer.objective={objective} trains on preference pairs, and {key} is "
                f"{src.format}: give prompt / chosen / rejected records with {key}=preference, "
                "or set trainer.objective=sft"
            )
        if objective == "sft" and src.format == "preference":
            raise ConfigError(
                f"{key}=preference holds prompt / chosen / rejected pairs, which "
                "trainer.objective=sft does not train on: set trainer.objective=dpo (or ipo, "
                "simpo, orpo)"
            )
    if objective != "sft" and data.train_on_prompt:
        raise ConfigError(
            f"data.train_on_prompt=true does not apply to trainer.objective={objective}: a "
            "pair's labels are its final reply only (the objective compares the chosen reply "
            "with the rejected one); set data.train_on_prompt=false"
        )


def _check_synthesized_path(model: ModelConfig) -> None:
    """A synthesized (random demo) model is built only in memtune's cache: a path set on such a
    group is the user's own model or directory, which the build would write over."""
    if not model.synthesize:
        return
    # realpath, not Path.resolve: a symlink loop on the way was resolve's RuntimeError
    # (Python < 3.13), a traceback; building there says what is wrong with it (cannot_write)
    where = Path(os.path.realpath(Path(model.name_or_path).expanduser()))
    if where.parent != Path(os.path.realpath(cache_dir().expanduser())):
        raise ConfigError(
            f"model.name_or_path={model.name_or_path!r}: this model group builds a random "
            f"demo model in memtune's cache ({cache_dir()}), not at a path of yours; to train "
            "your own checkpoint use model=local model.name_or_path=/path/to/it (or a model "
            "group such as model=qwen2.5-7b)"
        )


def _check_model_path(model: ModelConfig) -> None:
    """A local path must hold a checkpoint; "org/name" is left to the hub (or its cache)."""
    name = model.name_or_path
    path = Path(name).expanduser()
    if model.synthesize or not is_local_source(name):
        return
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.name_or_path={name!r}: no config.json there; point it at a directory "
            "saved with save_pretrained (or a hub name such as Qwen/Qwen2.5-7B-Instruct)"
        )


def _preference_settings(cfg: RunConfig) -> None:
    """A preference objective's own settings, and none set where it has no effect (a value
    other than its default, for an objective that does not read it: it was taken and ignored
    without a word, where label_smoothing was refused)."""
    t, pref = cfg.trainer, cfg.preference
    defaults = PreferenceConfig()
    applies = {  # the preference.* settings and the objectives that read them
        "beta": ("dpo", "ipo", "simpo", "orpo"),
        "label_smoothing": ("dpo", "simpo"),
        "simpo_gamma": ("simpo",),
        "reference": ("dpo", "ipo"),
    }
    for name, objectives in applies.items():
        value = getattr(pref, name)
        if value != getattr(defaults, name) and t.objective not in objectives:
            raise ConfigError(
                f"preference.{name}={value} has no effect with trainer.objective={t.objective}: "
                f"it applies to {' and '.join(objectives)}; leave it at its default "
                f"({getattr(defaults, name)})"
            )
    if t.objective == "sft":
        return
    if pref.beta is not None and pref.beta <= 0:
        raise ConfigError(f"preference.beta must be > 0 (got {pref.beta}); null: the default")
    if not 0 <= pref.label_smoothing < 0.5:
        raise ConfigError(
            f"preference.label_smoothing={pref.label_smoothing}: the assumed share of flipped "
            "pairs must be in [0, 0.5)"
        )
    if pref.simpo_gamma < 0:
        raise ConfigError(f"preference.simpo_gamma must be >= 0 (got {pref.simpo_gamma})")
    if cfg.peft.dropout > 0:
        why = (
            "makes the policy differ from its reference at random from the first step (the "
            "reference is taken without it)"
            if t.objective in ("dpo", "ipo")
            else "draws other masks for a pair's chosen and rejected replies, so the two "
            "log-probabilities it compares differ at random"
        )
        raise ConfigError(
            f"peft.dropout={cfg.peft.dropout} with trainer.objective={t.objective}: dropout "
            f"{why}; TRL turns dropout off for every preference objective; set peft.dropout=0"
        )


LAYER_BLOCKS = ("self_attn", "mlp", "linear_attn", "mlp.shared_expert")
"""The blocks of a decoder layer that hold adapted modules (attention, MLP, Qwen3.5's linear
attention, a mixture's shared expert)."""


def _lora_variants(cfg: RunConfig) -> None:
    """rsLoRA, DoRA, the initialisations, LoRA+ and per-module ranks: bad values and the
    combinations that cannot work, by name."""
    from memtune.config.derive import (
        REFERENCE_OBJECTIVES,
        REWRITING_INIT,
        adapts_experts,
        lora_targets,
        one_rank_stage,
    )

    p = cfg.peft
    if p.loraplus_lr_ratio is not None and p.loraplus_lr_ratio <= 0:
        raise ConfigError(
            f"peft.loraplus_lr_ratio must be > 0 (got {p.loraplus_lr_ratio}; the LoRA+ paper "
            "uses 16; null: one rate for A and B)"
        )
    if p.dora and p.method == "lora-int8":
        raise ConfigError(
            "peft.dora=true with peft.method=lora-int8: peft's DoRA dequantizes the LLM.int8 "
            "weights to take their norms and leaves bitsandbytes without their scales (the "
            "first forward stops with \"'NoneType' object has no attribute 'unsqueeze'\"); use "
            "peft.method=qlora (NF4, with zero=zero2) or lora"
        )
    if p.dora and p.method != "lora" and one_rank_stage(cfg) == 3:
        raise ConfigError(
            f"peft.dora=true with peft.method={p.method} under zero.stage=3: peft's DoRA "
            "dequantizes the base weight inside a forward that ZeRO-3 does not gather "
            "bitsandbytes' parameters for (it stops with \"'Params4bit' object has no attribute "
            "'ds_status'\"); use zero=zero2 (tested), or peft.method=lora"
        )
    targets = lora_targets(cfg)
    # peft's rule (LoraModel: re.match(rf"(.*\.)?({key})$", module name)) over the names the
    # adapted modules have in a layer, whichever block holds them.
    names = [f"model.layers.0.{block}.{t}" for t in targets for block in LAYER_BLOCKS]
    for field, pattern in (("rank_pattern", p.rank_pattern), ("alpha_pattern", p.alpha_pattern)):
        for key, value in pattern.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"peft.{field}.{key}={value!r}: must be a positive integer")
            try:
                rule = re.compile(rf"(.*\.)?({key})$")
            except re.error as err:
                raise ConfigError(f"peft.{field}: {key!r} is not a valid pattern ({err})") from None
            if re.search(r"layers\.\d", str(key)):
                raise ConfigError(
                    f"peft.{field}: {key!r} names a layer; memtune plans one rank per module name, "
                    "every layer alike: key it by module name (e.g. mlp.down_proj)"
                )
            stacks = [f"model.layers.0.mlp.experts.{x}" for x in ("gate_up_proj", "down_proj")]
            if adapts_experts(cfg) and any(rule.match(name) for name in stacks):
                raise ConfigError(
                    f"peft.{field}: {key!r} also names the routed experts' stacks "
                    "(mlp.experts.gate_up_proj / down_proj: peft applies the pattern to them "
                    "when it loads the adapter), which memtune adapts at peft.r and peft.alpha; "
                    "key it by its block (e.g. mlp.shared_expert.down_proj), or use "
                    "peft.target=all-linear-but-experts"
                )
            if not any(rule.match(name) for name in names):
                raise ConfigError(
                    f"peft.{field}: {key!r} names no adapted module (peft.target="
                    f"{p.target} adapts {', '.join(targets)}); it would change nothing"
                )
    if p.init in REWRITING_INIT:
        how = f"peft.init={p.init}"
        if p.method != "lora":
            raise ConfigError(
                f"{how} with peft.method={p.method}: {p.init} moves the top of each adapted "
                "weight into the adapter and leaves the base the rest, which a quantized base "
                "cannot be rewritten to; use peft.method=lora, or peft.init=default"
            )
        if p.dora:
            raise ConfigError(
                f"{how} with peft.dora=true: the adapter is exported for the original base as "
                "a plain LoRA of twice the rank (the base it trains over is the residual), "
                "which DoRA's magnitudes do not convert to; drop one of them"
            )
        if p.init_from:
            raise ConfigError(
                f"{how} with peft.init_from: the adapter loaded from init_from replaces the one "
                f"{p.init} builds, over a base {p.init} has rewritten; drop one of them"
            )
        if cfg.trainer.objective in REFERENCE_OBJECTIVES:
            raise ConfigError(
                f"{how} with trainer.objective={cfg.trainer.objective}: the reference is the "
                f"base without the adapter, which {p.init} has rewritten (the original weights "
                "minus the adapter's start); use peft.init=default"
            )


def _check_init_from(cfg: RunConfig) -> None:
    """peft.init_from: an adapter memtune (or peft) saved, whose shape is this run's LoRA."""
    import json

    from memtune.config.derive import (
        adapts_vision,
        live_reference,
        lora_target_pattern,
        lora_targets,
    )

    path = cfg.peft.init_from
    if path is None:
        return
    folder = Path(path).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise ConfigError(
            f"peft.init_from={path}: no adapter there (adapter_config.json and "
            "adapter_model.safetensors; a run's adapter is RUN_DIR/adapter)"
        )
    problem = adapter_problem(folder, weights_required=True)
    if problem:  # damaged: not JSON, not a LoRA config, the weights cut short
        raise ConfigError(
            f"peft.init_from={path}: {problem}; give an adapter saved whole (a run's "
            "RUN_DIR/adapter, or a checkpoint's adapter/)"
        )
    saved = json.loads(config_file.read_text())
    p = cfg.peft
    wanted = {"r": p.r, "lora_alpha": p.alpha, "target_modules": sorted(lora_targets(cfg))}
    wanted |= {"use_rslora": p.rslora, "use_dora": p.dora}
    wanted |= {"rank_pattern": dict(p.rank_pattern), "alpha_pattern": dict(p.alpha_pattern)}
    fields = {"r": "peft.r", "lora_alpha": "peft.alpha", "target_modules": "peft.target"}
    fields |= {"use_rslora": "peft.rslora", "use_dora": "peft.dora"}
    fields |= {"rank_pattern": "peft.rank_pattern", "alpha_pattern": "peft.alpha_pattern"}
    unset: dict[str, Any] = {"use_rslora": False, "use_dora": False}
    unset |= {"rank_pattern": {}, "alpha_pattern": {}}
    for key, value in wanted.items():
        have = saved.get(key)
        if have is None:  # peft writes null (or nothing) for a setting left at its default
            have = unset.get(key)
        have = sorted(have) if isinstance(have, list) else have
        if key == "target_modules" and isinstance(have, str):
            # an adapter of a vision-language class (trained on images): one pattern
            value = lora_target_pattern(lora_targets(cfg), adapts_vision(cfg))
        if have != value:
            hint = ""
            if key in ("r", "lora_alpha"):
                hint = (
                    " (an adapter exported from a peft.init=pissa or olora run is a plain LoRA "
                    "of twice the rank and alpha, for the original base; with rsLoRA its alpha "
                    "is × √2, not an integer peft.alpha can take)"
                )
            raise ConfigError(
                f"peft.init_from={path}: the adapter has {key}={have}, this run {fields[key]} "
                f"gives {value}; set {fields[key]} as the adapter was trained{hint}"
            )
    if live_reference(cfg):
        raise ConfigError(
            "peft.init_from with preference.reference=live: the reference is the adapter as "
            "loaded, which a live reference would need a second copy of; use "
            "preference.reference=precomputed (computed before the first step changes it)"
        )
