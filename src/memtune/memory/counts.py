"""Parameter counts from the real architecture, and the shape rules of a quantized base.

The model is instantiated on the meta device from ``model.architecture`` (the fields of its
config.json) and LoRA is applied to it with peft, so nothing is downloaded and no formula
guesses which layers exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from importlib.metadata import version
from typing import Any

from memtune.config import LORA_TARGETS, RunConfig, cache_dir, compute_bytes


@dataclass
class ParamCounts:
    """From the meta-device model: where the base's parameters are, and LoRA's."""

    linear: int  # decoder linear weights (quantized under QLoRA / int8)
    layer: int  # parameters of one decoder layer
    linear_rows: int  # their output rows (int8 keeps one fp32 scale per row)
    embedding: int
    head: int  # 0 when tied to the embedding
    small: int  # norms and biases: under ZeRO-3's persistence threshold, never sharded
    lora: int
    lora_inputs: list[tuple[str, int, int]]  # (name, in_features, r) of each target in a layer
    linear_shapes: list[tuple[str, int, int]]  # (name in a layer, in, out) of each linear layer

    @property
    def base(self) -> int:
        return self.linear + self.embedding + self.head + self.small


def arch_config(cfg: RunConfig) -> Any:
    """The transformers config of ``model.architecture`` (no weights, nothing downloaded)."""
    from transformers import AutoConfig

    arch = dict(cfg.model.architecture)
    return AutoConfig.for_model(arch.pop("model_type"), **arch)


COUNTS_CACHE_FORMAT = 1


def count_params(cfg: RunConfig) -> ParamCounts:
    """Instantiate the architecture on the meta device, add LoRA with peft, and count.

    The answer is kept in ``$MEMTUNE_CACHE_DIR/counts/<key>.json``, the key being what it
    depends on: the architecture, LoRA's rank and targets, and the transformers / peft / torch
    versions that build the model. Building it imports transformers' model code and peft, ~5 s
    of every ``train.py`` start on a small machine, for the same numbers each time."""
    p = cfg.peft
    key = json.dumps(
        {
            "format": COUNTS_CACHE_FORMAT,
            "architecture": dict(cfg.model.architecture),
            "r": p.r,
            "targets": sorted(LORA_TARGETS[p.target]),
            "versions": [version(name) for name in ("transformers", "peft", "torch")],
        },
        sort_keys=True,
        default=str,
    )
    path = cache_dir() / "counts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(path.read_text())
        return ParamCounts(
            **{
                **saved,
                "lora_inputs": [tuple(x) for x in saved["lora_inputs"]],
                "linear_shapes": [tuple(x) for x in saved["linear_shapes"]],
            }
        )
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not counted yet (or an unreadable file): count now
    counts = _count_on_meta(cfg)
    with contextlib.suppress(OSError):  # a read-only cache only costs the time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(counts)))
        tmp.replace(path)
    return counts


def _count_on_meta(cfg: RunConfig) -> ParamCounts:
    # Imported here: a launch whose counts are cached never imports torch on the job side.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoModelForCausalLM.from_config(arch_config(cfg))
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is embedding
        linear = rows = small = 0
        for module in model.get_decoder().layers.modules():
            if isinstance(module, torch.nn.Linear):
                linear += module.weight.numel()
                rows += module.out_features
        n_all = sum(p.numel() for p in model.parameters())
        layer = sum(q.numel() for q in model.get_decoder().layers[0].parameters())
        head_n = 0 if tied or head is None else head.weight.numel()
        small = n_all - linear - embedding.numel() - head_n
        p = cfg.peft
        targets = LORA_TARGETS[p.target]
        layer0 = model.get_decoder().layers[0]
        linear_shapes = [
            (name, m.in_features, m.out_features)
            for name, m in layer0.named_modules()
            if isinstance(m, torch.nn.Linear)
        ]
        lora_inputs = [
            (name.split(".")[-1], i, p.r)
            for name, i, _ in linear_shapes
            if name.split(".")[-1] in targets
        ]
        peft_model = get_peft_model(
            model, LoraConfig(r=p.r, lora_alpha=p.alpha, target_modules=targets)
        )
        lora = sum(q.numel() for q in peft_model.parameters() if q.requires_grad)
    return ParamCounts(
        linear, layer, rows, embedding.numel(), head_n, small, lora, lora_inputs, linear_shapes
    )


def quantized_shape_problems(cfg: RunConfig, counts: ParamCounts) -> list[str]:
    """The decoder's linear layers whose shape bitsandbytes cannot quantize as configured.

    A QLoRA base stores each 4-bit weight as packed bytes (two weights a byte) viewed as the
    storage dtype (rank.model.quantization_config: the compute dtype, so ZeRO-3 can shard it), which
    needs ceil(in × out / 2) to be a multiple of that dtype's size; otherwise bitsandbytes fails
    deep inside from_pretrained ("must be divisible by 2 to view Byte as BFloat16"). Real
    checkpoints' widths are multiples of 64, but a custom architecture may not be. (LLM.int8
    keeps one int8 per weight: no such rule. bitsandbytes' CPU inference layout needs
    out % 32 == 0 too, but training never uses it: rank.model.keep_training_layout.)
    """
    if cfg.peft.method != "qlora":
        return []
    storage = compute_bytes(cfg)
    dtype = "bf16" if storage == 2 else "fp32"
    return [
        f"model.layers.*.{name} (in {i}, out {o}): {-(-i * o // 2):,} packed bytes are not a "
        f"multiple of {storage} ({dtype} storage, bnb_4bit_quant_storage)"
        for name, i, o in counts.linear_shapes
        if -(-i * o // 2) % storage
    ]
