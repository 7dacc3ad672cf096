"""Load the base model, pick the attention kernel, add LoRA, turn on activation checkpointing."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from memtune.config import ConfigError, RunConfig
from memtune.config.decisions import SPLITTING_KERNELS, AttentionKernel, Decisions
from memtune.config.derive import REWRITING_INIT, lora_config, lora_scaling, variant_words
from memtune.config.schema import PeftMethod
from memtune.rank.layers import decoder_layers, embedding_grad_as_decided, set_checkpointed_layers
from memtune.rank.long_context import compiled_checkpoints

log = logging.getLogger("memtune")


def torch_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32


def use_attention(kernel: AttentionKernel, device_type: str) -> AttentionKernel:
    """The decided attention kernel (decisions.json ``attention``), made ready on this rank:
    sdpa_varlen (SDPA per sample, no dense mask: rank/attention.py) and torch_varlen
    registered with transformers, and its FlashAttention-2 function wrapped to split by KV
    head (the three :data:`SPLITTING_KERNELS`); FlashAttention-2 and torch_varlen refused
    where this rank cannot run them (the job decided from its view of the machine, which
    this one may not match)."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if kernel == "flash_attention_2" and not (device_type == "cuda" and has_flash):
        raise ConfigError(
            "attention=flash_attention_2 (decisions.json) needs a CUDA GPU and the flash-attn "
            "package on every rank (pip install -e '.[flash]'); this rank has "
            f"{'no CUDA' if device_type != 'cuda' else 'no flash-attn'}: install it, or run "
            "with model.attn_implementation=sdpa_varlen"
        )
    if kernel == "torch_varlen" and device_type != "cuda":
        raise ConfigError(
            "attention=torch_varlen (decisions.json) needs a CUDA GPU on every rank (torch's "
            "variable-length attention is FlashAttention's CUDA kernel); run with "
            "model.attn_implementation=sdpa_varlen"
        )
    if kernel in SPLITTING_KERNELS:
        from memtune.rank import attention

        attention.register()
    return kernel


def quantization_config(cfg: RunConfig, method: PeftMethod, keep: list[str] | None = None) -> Any:
    """bitsandbytes settings for a base quantized by ``method`` (the decided peft method:
    qlora / lora-int8), else None. ``keep``: modules left unquantized, in place of
    bitsandbytes' default (the LM head; a vision tower: rank.vision.NOT_QUANTIZED).

    NF4 weights are stored packed in the training dtype (``bnb_4bit_quant_storage``): ZeRO-3
    partitions and gathers parameters of one floating dtype, and a uint8 store would not be
    sharded with the rest.
    """
    from transformers import BitsAndBytesConfig

    p, dtype = cfg.peft, torch_dtype(cfg)
    if method == "qlora":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=p.quant_type,
            bnb_4bit_use_double_quant=p.double_quant,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
            llm_int8_skip_modules=keep,
        )
    if method == "lora-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=keep)
    return None


def with_rope_scaling(
    name_or_path: str,
    revision: str | None,
    rope_scaling: dict[str, Any] | None,
    trust_remote_code: bool = False,
) -> Any:
    """The checkpoint's config (its text model's, in a vision-language one) with
    ``rope_scaling`` (model.rope_scaling) laid over its RoPE parameters, for
    ``from_pretrained(config=...)``; None for an empty ``rope_scaling``: the checkpoint's own.
    Over, not instead: transformers 5 reads every RoPE setting from one dict
    (``rope_parameters``), and a ``rope_scaling`` given to ``from_pretrained`` replaced it
    whole, its ``rope_theta`` lost (YaRN's first forward was a TypeError). The older
    ``type`` key is read as ``rope_type``. Training, ``memtune merge`` and ``memtune
    generate`` load the base with it, so all three hold the same positions."""
    if not rope_scaling:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        name_or_path, revision=revision, trust_remote_code=trust_remote_code
    )
    text = config.get_text_config()
    given = dict(rope_scaling)
    kind = given.pop("type", None)
    if kind is not None:
        given.setdefault("rope_type", kind)
    own = dict(getattr(text, "rope_parameters", None) or {})
    nested = text.nested_rope_parameter_keys(own) if own else []
    if nested:  # one dict per layer type: each scaled alike
        text.rope_parameters = {
            k: ({**v, **given} if k in nested and v is not None else v) for k, v in own.items()
        }
    else:
        text.rope_parameters = {**own, **given}
    text.standardize_rope_params()  # yarn's original_max_position_embeddings, where not given
    return config


def load_base_model(cfg: RunConfig, d: Decisions, device_index: int | None = None) -> Any:
    """``from_pretrained`` in the training dtype with the decided attention kernel, quantized
    for QLoRA / int8. Under ZeRO-3 the caller keeps a live ``HfDeepSpeedConfig`` so weights
    load already partitioned across ranks (no ``device_map`` then); under ZeRO-2 on a GPU the
    base loads onto the rank's GPU (where bitsandbytes quantizes a quantized one). With
    decisions ``vision`` (data with images) the checkpoint's vision-language class loads, its
    tower in the compute dtype (rank.vision)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from memtune.rank.vision import NOT_QUANTIZED, attention_per_part

    use_attention(d.attention, "cpu" if device_index is None else "cuda")
    tower = d.vision is not None
    quant = quantization_config(cfg, d.peft_method, NOT_QUANTIZED if tower else None)
    auto: Any = AutoModelForImageTextToText if tower else AutoModelForCausalLM
    attention: Any = attention_per_part(d.attention) if tower else d.attention
    extra: dict[str, Any] = {}
    if quant is not None:
        extra["quantization_config"] = quant
    m = cfg.model
    config = with_rope_scaling(m.name_or_path, m.revision, m.rope_scaling, m.trust_remote_code)
    if config is not None:
        extra["config"] = config
    if cfg.model.revision:
        extra["revision"] = cfg.model.revision
    if device_index is not None and d.zero_stage != 3:
        # Straight onto the rank's GPU: a replicated bf16 base would otherwise sit in host
        # memory once per rank (4 × 15 GB for Qwen2.5-7B) before DeepSpeed moves it.
        extra["device_map"] = {"": device_index}
    with quantized_as_loaded(cfg, d):
        model = auto.from_pretrained(
            cfg.model.name_or_path,
            dtype=torch_dtype(cfg),
            attn_implementation=attention,
            trust_remote_code=cfg.model.trust_remote_code,
            **extra,
        )
    # A KV cache is useless in training and defeats recompute (a vision-language class reads
    # its text config's; Qwen3.5's per-sample linear attention gives way to a cache).
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    return model


def quantized_as_loaded(cfg: RunConfig, d: Decisions) -> Any:
    """A quantized mixture's expert stacks quantized as the checkpoint is read
    (rank.experts.experts_as_loaded: no whole base in the compute dtype on any rank,
    which lets a quantized mixture run replicated under ZeRO-2), and under expert parallelism
    only this rank's experts kept of each stack read; else nothing to do."""
    import contextlib

    from memtune.rank.experts import experts_as_loaded

    if d.experts is None:
        return contextlib.nullcontext()
    shard = None
    if d.experts.parallel > 1:  # only this rank's experts kept as they are read
        from memtune.rank.expert_parallel import shard_for

        shard = shard_for(d.experts.parallel, d.experts.routed)
    quantized = d.peft_method != "lora" and d.experts.storage != "compute"
    if not quantized and shard is None:
        return contextlib.nullcontext()
    storage = d.experts.storage if quantized else None
    return experts_as_loaded(storage, torch_dtype(cfg), shard)


@dataclass
class RewritingStart:
    """What a PiSSA or OLoRA start left on the peft model (one attribute, read through
    :func:`rewriting_start`): the base now holds W − (the adapter's start)."""

    adapter: dict[str, torch.Tensor]
    """The trainable tensors as initialised, on the host: what turns the exported adapter into
    one for the original base (rank.checkpoint.export_adapter)."""
    seconds: float
    """How long the initialisation's decompositions took (the start-up line)."""


def rewriting_start(model: Any) -> RewritingStart | None:
    return getattr(model, "memtune_rewriting_start", None)


def variant_label(cfg: RunConfig, model: Any = None) -> str:
    """The start-up line's words for the LoRA variant ("" for plain LoRA), with how long the
    initialisation's decompositions took (config.derive.variant_words)."""
    start = rewriting_start(model)
    words = variant_words(cfg)
    if start is not None:
        what = "QR" if cfg.peft.init == "olora" else "SVD"
        took = start.seconds
        words = [f"{w} ({what} in {took:.1f} s)" if w.startswith("init ") else w for w in words]
    return "".join(f" · {w}" for w in words)


def add_lora(model: Any, cfg: RunConfig, d: Decisions) -> Any:
    """LoRA (and a mixture's expert adapters) on the base, as decided: a quantized base
    prepared, activation checkpointing per layer, the adapters in the compute dtype, their
    dropout peft's or regenerated (rank.lora_dropout)."""
    from peft import get_peft_model

    from memtune.rank.lora_dropout import use_lora_dropout
    from memtune.rank.vision import set_tower_recompute, tower_inputs_need_no_grad

    p = cfg.peft
    if d.peft_method != "lora":
        model = prepare_quantized(model, torch_dtype(cfg))
        check_all_quantized(model, cfg, d)
    c = d.checkpointing
    if c.enabled:
        # On decoder layers only (transformers wraps its GradientCheckpointingLayer modules);
        # embeddings and the LM head keep their activations.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": c.reentrant}
        )
        # Per layer, as decided: the first ones recompute (backward reaches them last, once
        # the other layers' activations are freed; see memory.estimate.activation_bytes).
        set_checkpointed_layers(model, c)
    if d.vision is not None:
        set_tower_recompute(model, d.vision)
    start = time.perf_counter()
    model = get_peft_model(model, lora_config(cfg, tower=d.vision is not None))
    if p.init in REWRITING_INIT:
        # The base now holds W − (the adapter's start): keep that start, on the host, so that
        # the exported adapter can be turned into one for the original base
        # (checkpoint.export_adapter).
        initial = {
            n: q.detach().float().cpu().clone()
            for n, q in model.named_parameters()
            if q.requires_grad
        }
        model.memtune_rewriting_start = RewritingStart(initial, time.perf_counter() - start)
    from memtune.expert_stacks import add_expert_adapters, train_routers
    from memtune.rank.experts import use_routed_forward

    if d.experts is not None and d.experts.adapted:
        add_expert_adapters(model, p.r, lora_scaling(cfg), p.init)
    use_routed_forward(model)  # a mixture's experts, adapted or frozen
    if p.train_router:
        train_routers(model)
    if p.init_from:
        load_adapter_weights(model, p.init_from, text_class=d.vision is None)
    cast_adapters(model, torch_dtype(cfg))
    use_lora_dropout(model, d.kernels.lora_dropout)
    if c.reentrant:
        # Reentrant checkpointing drops gradients unless the layer inputs require grad.
        model.enable_input_require_grads()
    else:
        embedding_grad_as_decided(model, c)  # peft hooked it again
    if d.vision is not None:
        tower_inputs_need_no_grad(model)
    return model


def load_adapter_weights(model: Any, folder: str, text_class: bool = True) -> None:
    """peft.init_from: the saved adapter's weights into this model's LoRA, every one of them
    (config.validate checked r, alpha and targets before launch). ``text_class``: the model is
    a text class, onto which an adapter named for a multimodal class is renamed."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from memtune.config.architecture import LANGUAGE_MODEL_PREFIX
    from memtune.expert_stacks import ROUTER_MODULE, full_shape
    from memtune.rank.experts import (
        expert_adapter_names,
        expert_modules,
        from_peft_names,
        gathered,
    )

    text, multimodal = LANGUAGE_MODEL_PREFIX
    state = load_file(str(Path(folder).expanduser() / "adapter_model.safetensors"))
    # An adapter named for a multimodal class (model.language_model.*) onto its text model.
    if text_class:
        state = {k.replace(multimodal, text, 1): v for k, v in state.items()}
    # The routed experts' adapters: from peft's target_parameters layout into rank.experts'.
    state = from_peft_names(state, {n: int(m.num_experts) for n, m in expert_modules(model)})
    own = dict(model.named_parameters())
    experts = expert_adapter_names(own)
    # and a mixture's routers trained in full (peft.train_router: modules_to_save); routers in
    # an adapter for a run that does not train them stay in state: unexpected, refused below
    routers = [k for k in state if k.endswith(f".{ROUTER_MODULE}.weight") and k in own]
    experts += [k for k in routers if own[k].requires_grad]

    problems = [k for k in experts if k not in state or tuple(state[k].shape) != full_shape(own[k])]
    with torch.no_grad():
        for key in experts:
            if key not in problems:  # (a router loaded under zero.Init is partitioned)
                with gathered(own[key], modifier_rank=0):
                    own[key].copy_(state.pop(key))
    result: Any = set_peft_model_state_dict(model, state)
    lora = {n for n in own if "lora_" in n and n not in experts}
    missing = sorted(n for n in result.missing_keys if n in lora) + problems
    if result.unexpected_keys or missing:
        raise ValueError(
            f"peft.init_from={folder}: the adapter does not fit this model "
            f"(unexpected {sorted(result.unexpected_keys)[:3]}, missing {missing[:3]})"
        )


def cast_adapters(model: Any, dtype: torch.dtype) -> None:
    """Store the LoRA weights in the compute dtype, whatever the ZeRO stage or base.

    peft creates adapters in fp32. Left to DeepSpeed, what they become depends on how the base
    was loaded: it casts every parameter of a plain model to bf16, but leaves a model loaded
    through zero.Init (plain LoRA under ZeRO-3) as it is, so the same run would keep fp32
    adapters on ZeRO-3 and bf16 ones on ZeRO-2. fp32 adapters next to a bf16 base also make
    peft cast each adapted layer's input to fp32 and keep that copy for backward (7 copies per
    layer with all-linear targets: 0.6 GB per layer at 4096 tokens on Qwen2.5-7B). Deciding here
    gives one behaviour the planner can count. Precision is not lost: the ZeRO optimizer
    updates fp32 master copies of these weights and writes the result back in bf16.
    """
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def compile_layers(model: Any, zero3: bool = False) -> int:
    """trainer.compile: ``torch.compile`` the ``forward`` of every decoder layer, LoRA
    included. Regional rather than whole-model: one layer's graph serves them all (same code,
    same shapes), and the attention kernel (sdpa_varlen reads each batch's sample boundaries
    on the host) runs eager between the compiled parts.

    Three choices keep it to one compile per rank (measured on 2 CPU ranks under ZeRO-3,
    bench/results/2026-12-02-compile-zero3.md: 116 recompiles and 128 graph breaks before):

    * only ``forward`` is compiled, not the module call, so the hooks DeepSpeed puts on the
      layer (ZeRO-3's gather and release, as autograd functions) stay outside the graph;
    * under ZeRO-3 each layer is a *leaf* for DeepSpeed (``set_z3_leaf_module``): its
      parameters are gathered together by the layer's hook, so no hook fires on the linear
      layers inside the compiled forward (each would break the graph). That is what the plan
      already counts: its "ZeRO-3 gathered params" row is one whole decoder layer + prefetch;
    * ``dynamic=True``: packed micro batches are cut to their longest row, so their width
      varies; a graph compiled for one width would be compiled again at the next.

    Layers that recompute in backward (``trainer.checkpoint_layers``) are compiled inside the
    checkpoint instead (rank.long_context.compiled_checkpoints): ``torch.utils.checkpoint``
    runs its function with dynamo disabled, so a compiled forward around it ran eager
    (measured: 0 graphs with every layer checkpointed), and a compiled function is what the
    recompute in backward has to call. Their forward runs compiled twice per step: without
    grad in the forward pass, with it in the recompute. Their dropout draws from torch's own
    RNG (inductor's ``fallback_random``, for that compiled function only), so the recompute
    replays the forward's masks from the restored RNG state. In eval or under no_grad
    transformers skips the checkpoint, and those layers run eager.

    Called before ``deepspeed.initialize``, which registers the hooks, and after
    :func:`add_lora`, which marks the checkpointed layers. Returns the number of layers
    compiled."""
    compiled_checkpoints(model)
    layers = decoder_layers(model)
    if zero3:
        from deepspeed.utils import set_z3_leaf_module

        for layer in layers:
            set_z3_leaf_module(layer, True)
    for layer in layers:
        if not layer.gradient_checkpointing:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)


def is_quantized_layer(module: Any) -> bool:
    """A bitsandbytes layer itself (Linear4bit, Linear8bitLt), not peft's LoRA wrapper of it."""
    return type(module).__module__.startswith("bitsandbytes")


def prepare_quantized(model: Any, dtype: torch.dtype) -> Any:
    """A quantized base frozen for LoRA, every weight that is not quantized in the compute
    dtype: peft's ``prepare_model_for_kbit_training`` (without gradient checkpointing: it
    freezes the base and upcasts every bf16 / fp16 weight that is not bitsandbytes' 4-bit to
    fp32), without its fp32 upcast.

    The upcast costs twice: the embedding and LM head (frozen, 2 × vocab × hidden) double to
    4.4 GB on Qwen2.5-7B, and fp32 norms turn the whole residual stream fp32 (RMSNorm multiplies
    by its weight's dtype, and bitsandbytes layers return their input's dtype), doubling the
    activations kept for the backward pass; memtune used to cast those weights back, which
    still held every one of them in fp32 at once during start-up. It would also read a
    mixture's quantized expert stacks (rank.experts: packed bytes stored as the training dtype,
    quantized as they were loaded) as numbers and rewrite them. So: frozen, bitsandbytes'
    layers kept in their training layout, any fp32 weight (other than a quantized stack) in the
    compute dtype, as in a plain bf16 LoRA run.
    """
    from memtune.expert_stacks import quantized_stack

    for param in model.parameters():
        param.requires_grad = False
    for module in model.modules():
        if is_quantized_layer(module):
            keep_training_layout(module)
            release_8bit_input(module)
            continue
        for param in module.parameters(recurse=False):
            if quantized_stack(param) is not None:
                continue
            if param.dtype == torch.float32 and dtype != torch.float32:
                param.data = param.data.to(dtype)
    return model


def check_all_quantized(model: Any, cfg: RunConfig, d: Decisions) -> None:
    """A quantized base: a mixture's routed-expert stacks quantized too, as decided
    (decisions.json experts.storage; rank.experts: bitsandbytes leaves them in the compute
    dtype), then nothing large left unquantized. A weight of hidden² or more elements still in
    a floating dtype would be counted 4-bit by the plan and load 4 times larger: refused,
    named, before any step."""
    from memtune.rank.experts import expert_modules, full_precision_weights, quantize_experts

    if expert_modules(model) and d.experts is not None and d.experts.storage != "compute":
        quantize_experts(model, d.experts.storage, torch_dtype(cfg))
    from memtune.rank.vision import is_tower_module

    hidden = int(cfg.model.architecture["hidden_size"])
    # A vision tower stays in the compute dtype (rank.vision.NOT_QUANTIZED).
    left = [n for n in full_precision_weights(model, hidden * hidden) if not is_tower_module(n)]
    if left:
        raise ConfigError(
            f"peft.method={d.peft_method}: {len(left)} large weights of "
            f"{cfg.model.name_or_path} were not quantized ({', '.join(left[:3])}"
            f"{', …' if len(left) > 3 else ''}); they would take their full size, which the "
            "plan counted 4-bit or 8-bit. Use peft.method=lora for this model."
        )


def keep_training_layout(layer: Any) -> None:
    """Stop bitsandbytes from repacking this 4-bit layer into its CPU inference layout.

    On a CPU with AVX512-BF16, bitsandbytes (>= 0.49) rewrites a Linear4bit's weight in place
    into a kernel-specific layout the first time the layer runs in eval mode without grad (our
    validation passes), and keeps it so afterwards. That layout's kernel has no backward: back
    in training, the base weight's path stops passing gradients to the layers below (LoRA then
    trains on wrong gradients, silently), the repack needs out_features % 32 == 0, and under
    ZeRO-3 it changes the shape of a partitioned parameter. Training keeps the one layout every
    CPU and GPU shares; generation and merging load their own models and are not affected.
    """
    if hasattr(layer, "support_avx512bf16_for_cpu"):
        layer.support_avx512bf16_for_cpu = False


EIGHT_BIT_NODES = ("MatMul8bitLtBackward", "MatMul8bitFpBackward")
"""bitsandbytes' autograd nodes of an 8-bit base projection: MatMul8bitLt's (CUDA, and any
device in eval), MatMul8bitFp's (training on CPU and XPU)."""


def release_8bit_input(layer: Any) -> None:
    """Let a checkpointed layer's 8-bit projections (lora-int8) free their inputs after the
    forward.

    bitsandbytes' 8-bit matmul functions keep their input as an attribute of the autograd node
    (``ctx.tensors`` / ``ctx.A``), not through ``save_for_backward``, so activation
    checkpointing, whose saved-tensor hooks are how it drops what a layer saved, never sees it:
    a recomputed layer held every projection's input (q/k/v's, o_proj's, gate/up's and
    down_proj's, tokens × intermediate) for as long as the graph lived, where the plan counts
    the checkpoint's input (docs/quantized.md). The backward reads the input only for the
    weight's gradient, and a frozen base has none: a forward hook drops the node's reference
    once the projection has run."""
    if type(layer).__name__ == "Linear8bitLt":
        # first, before any hook that wraps the output (ZeRO-3's) hides bitsandbytes' node
        layer.register_forward_hook(_drop_8bit_input, prepend=True)


def _drop_8bit_input(layer: Any, args: Any, out: torch.Tensor) -> None:
    node: Any = out.grad_fn  # the function's ctx, whose attributes bitsandbytes set
    if node is None or type(node).__name__ not in EIGHT_BIT_NODES or layer.weight.requires_grad:
        return
    if getattr(node, "is_empty", False):
        return  # an empty input's backward builds its zero gradient from it
    if type(node).__name__ == "MatMul8bitFpBackward":
        node.A = None
    else:
        node.tensors = (None, None, None)  # the quantized input transposed, outliers, the input


def method_label(cfg: RunConfig, d: Decisions) -> str:
    """How the run trains, for humans: LoRA, QLoRA (NF4 base), LoRA (int8 base)."""
    p = cfg.peft
    if d.peft_method == "qlora":
        return f"QLoRA ({p.quant_type.upper()} base)"
    if d.peft_method == "lora-int8":
        return "LoRA (int8 base)"
    return f"LoRA ({cfg.trainer.precision} base)"


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) weights, using ZeRO-3's full sizes when parameters are partitioned
    and the unpacked size of 4-bit weights (stored several to an element)."""
    from memtune.expert_stacks import full_numel

    trainable = total = 0
    for p in model.parameters():
        n = full_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


MODEL_PARTS = (
    (".visual.", "vision tower"),
    (".mlp.experts.", "routed experts"),
    (".mlp.shared_expert", "shared expert"),
    (".mlp.gate.", "routers"),  # peft.train_router (not gate_proj, not shared_expert_gate)
    (".linear_attn.", "linear attention"),
    (".self_attn.", "attention"),
    (".mlp.", "MLP"),
)
"""Where a parameter is, by its name, first match: the start-up line's parts."""


def trainable_by_part(model: Any) -> dict[str, int]:
    """Trainable weights by the part of the model they adapt (full sizes under ZeRO-3), in
    MODEL_PARTS order, parts with none left out."""
    from memtune.expert_stacks import full_numel

    counts = dict.fromkeys([label for _, label in MODEL_PARTS] + ["other"], 0)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = next((label for key, label in MODEL_PARTS if key in f".{name}"), "other")
        counts[part] += full_numel(p)
    return {part: n for part, n in counts.items() if n}
