"""Merge a LoRA adapter into its base model: ``python -m memtune.merge ADAPTER OUT``.

Loads the base (bf16 by default), applies the adapter, folds it into the weights with
``merge_and_unload`` and saves a plain model + tokenizer that
``AutoModelForCausalLM.from_pretrained(OUT)`` loads with no peft installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def base_of(adapter_dir: Path) -> str:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return str(config["base_model_name_or_path"])


def merge(adapter_dir: Path, out_dir: Path, base: str | None = None, dtype: str = "bf16") -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (adapter_dir / "adapter_config.json").is_file():
        raise SystemExit(f"memtune.merge: {adapter_dir} has no adapter_config.json")
    base = base or base_of(adapter_dir)
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
    args = parser.parse_args(argv)
    out = merge(args.adapter, args.out, args.base, args.dtype)
    print(f"memtune: merged model written to {out}")


if __name__ == "__main__":
    main()
