"""The base model of a phase: the architecture with random weights, built on the device (no
checkpoint is read), and the decoder quantized to 4 bits as ``from_pretrained`` would."""

from __future__ import annotations

import gc
from typing import Any

from .measure import empty_cache


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
    for layer in model.get_decoder().layers:
        quantize_linears(layer, quant, device)
    mark_quantized(model, quant)
    gc.collect()
    empty_cache(device)
    return model


def mark_quantized(model: Any, quant: Any) -> None:
    """What transformers' bitsandbytes quantizer sets on a model it loaded (peft reads it)."""
    model.is_loaded_in_4bit = True
    model.config.quantization_config = quant


def quantize_linears(module: Any, quant: Any, device: Any) -> None:
    """Every ``nn.Linear`` inside ``module`` → a bitsandbytes ``Linear4bit`` with ``quant``'s
    settings, its weight quantized on ``device`` (what ``from_pretrained`` does tensor by
    tensor); the float weight is dropped with the layer it came from."""
    import bitsandbytes as bnb
    import torch

    settings = {
        "compress_statistics": quant.bnb_4bit_use_double_quant,
        "quant_type": quant.bnb_4bit_quant_type,
        "quant_storage": quant.bnb_4bit_quant_storage,
    }
    for name, linear in list(module.named_modules()):
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
        weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, module=q, **settings)
        q.weight = weight.to(device)  # quantizes
        if linear.bias is not None:
            q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, q)


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


def build_mixture_by_layer(
    cfg: Any, device: Any, attn: str, quant: Any, experts_storage: str
) -> tuple[Any, int]:
    """A mixture of ``cfg.model.architecture`` with random weights, QLoRA-quantized as it is
    materialised, never whole in the compute dtype (Qwen3-30B-A3B: 61 GB in bf16).

    Built on the meta device (no memory, :func:`meta_model`), then materialised on ``device`` a
    piece at a time: the embedding, final norm, LM head (not quantized, as from_pretrained
    leaves it) and rotary tables (:func:`draw_outside_layers`), then each decoder layer in
    turn — its weights drawn, its linear weights quantized by bitsandbytes
    (:func:`quantize_linears`, the settings of memtune's ``quantization_config``) and its
    routed-expert stacks by memtune's own quantization (``rank.experts.quantize_experts`` to
    ``experts_storage``, as decided: the bytes ``experts_as_loaded`` makes of a checkpoint's
    stack as it is read) before the next layer exists. So at most one layer is in the compute
    dtype at a time, and what trains is what memtune trains. Returns the model and the number
    of expert stacks quantized."""
    import torch

    from memtune.rank.experts import quantize_experts

    model = meta_model(cfg, attn)
    torch.manual_seed(cfg.trainer.seed)
    draw_outside_layers(model, device)
    stacks = 0
    dtype = torch_dtype(cfg)
    for layer in model.get_decoder().layers:
        draw_weights(layer, device, model.config)
        quantize_linears(layer, quant, device)
        stacks += quantize_experts(layer, experts_storage, dtype)
    mark_quantized(model, quant)
    gc.collect()
    empty_cache(device)
    return model, stacks


def meta_model(cfg: Any, attn: str = "sdpa") -> Any:
    """The causal LM of ``cfg.model.architecture`` on the meta device: its structure, no
    memory (what from_pretrained builds before it reads a checkpoint)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(cfg.model.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype(cfg), attn_implementation=attn
        )
    model.config.use_cache = False  # as memtune.rank.model.load_base_model
    return model


def draw_weights(module: Any, device: Any, config: Any) -> None:
    """Every parameter inside ``module`` materialised on ``device`` and drawn: normal with the
    config's ``initializer_range`` (transformers' own init), norms 1."""
    for sub in module.modules():
        draw_own(sub, device, config)


def draw_own(module: Any, device: Any, config: Any) -> None:
    """:func:`draw_weights` for ``module``'s own parameters (not its children's)."""
    import torch

    std = float(getattr(config, "initializer_range", 0.02))
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            if "Norm" in type(module).__name__:
                p.fill_(1.0)
            else:
                p.normal_(std=std)


def draw_outside_layers(model: Any, device: Any) -> None:
    """A meta model's embedding, final norm and LM head drawn on ``device``
    (:func:`draw_own`), and its rotary tables computed again (buffers made at init)."""
    import torch

    decoder = model.get_decoder()
    in_layers = {id(m) for m in decoder.layers.modules()}
    rotary = decoder.rotary_emb
    for module in model.modules():
        if id(module) not in in_layers and module is not rotary:
            draw_own(module, device, model.config)
    with torch.device(device):
        decoder.rotary_emb = type(rotary)(model.config)
