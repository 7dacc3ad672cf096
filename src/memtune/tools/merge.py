"""Merge a LoRA adapter into its base model: ``python -m memtune.merge ADAPTER OUT``.

Loads the base (bf16 by default), applies the adapter, folds it into the weights with
``merge_and_unload`` and saves a plain model + tokenizer that
``AutoModelForCausalLM.from_pretrained(OUT)`` loads with no peft installed.

An adapter trained over a quantized base (QLoRA NF4, LLM.int8) learned to correct the
*quantized* weights, so by default it is merged into the base quantized exactly as in training
and then dequantized (``--into dequantized``): that model behaves like the one you trained.
``--into original`` merges into the original full-precision weights instead, which keeps their
precision but adds the quantization error back under the adapter's correction. The run's
``config.yaml`` next to the adapter says how the base was quantized.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memtune.config import RunConfig, load_run_config
from memtune.rank.model import quantization_config, torch_dtype

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def base_of(adapter_dir: Path) -> str:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return str(config["base_model_name_or_path"])


def run_config_of(adapter_dir: Path) -> RunConfig | None:
    """The config of the run that wrote the adapter (RUN_DIR/adapter or a checkpoint's)."""
    for parent in [adapter_dir.parent, *adapter_dir.parent.parents][:3]:
        if (parent / "config.yaml").is_file():
            return load_run_config(parent / "config.yaml")
    return None


def merge(
    adapter_dir: Path,
    out_dir: Path,
    base: str | None = None,
    dtype: str = "bf16",
    into: str = "dequantized",
) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (adapter_dir / "adapter_config.json").is_file():
        raise SystemExit(f"memtune.merge: {adapter_dir} has no adapter_config.json")
    base = base or base_of(adapter_dir)
    cfg = run_config_of(adapter_dir)
    quant = quantization_config(cfg) if cfg is not None and into == "dequantized" else None
    if quant is not None and cfg is not None:
        # Quantized exactly as in training (from the training dtype), then dequantized: the
        # weights the adapter learned to correct.
        quantized = AutoModelForCausalLM.from_pretrained(
            base, dtype=torch_dtype(cfg), quantization_config=quant
        )
        model = quantized.dequantize().to(DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=DTYPES[dtype])
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    tokenizer_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tokenizer_src)).save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m memtune.merge", description=__doc__)
    parser.add_argument("adapter", type=Path, help="an adapter/ folder (run dir or checkpoint)")
    parser.add_argument("out", type=Path, help="where to write the merged model")
    parser.add_argument("--base", help="base model (default: the one the adapter names)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--into",
        choices=["dequantized", "original"],
        default="dequantized",
        help="for an adapter trained over a quantized base: merge into that base dequantized "
        "(default, behaves like the trained model) or into the original weights",
    )
    args = parser.parse_args(argv)
    out = merge(args.adapter, args.out, args.base, args.dtype, args.into)
    print(f"memtune: merged model written to {out}")


if __name__ == "__main__":
    main()
