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
