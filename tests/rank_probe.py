"""A rank entry point for tests: memtune.worker.run, then checks that need the live engine.

Started by the real launcher (``deepspeed --module rank_probe RUN_DIR``) with tests/ on
PYTHONPATH. After training it records, per rank: how much of each parameter this rank holds,
whether the frozen base weights still equal the checkpoint on disk, and (rank 0) the trained
model's logits on a fixed batch, so the test process can compare them with base + saved adapter.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from memtune.worker import RankContext, run

PROBE_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def probe(engine: Any, ctx: RankContext) -> None:
    import deepspeed
    from transformers import AutoModelForCausalLM

    if os.environ.get("MEMTUNE_TEST_CRASH_RANK") == str(ctx.rank):
        os._exit(7)  # dies while the other ranks enter the collectives below
    model = engine.module.model
    params = dict(model.named_parameters())
    zero3 = any(hasattr(p, "ds_id") for p in params.values())
    held = sum(int(p.ds_tensor.numel()) if zero3 else p.numel() for p in params.values())
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params.values())

    gathered = deepspeed.zero.GatheredParameters(list(params.values())) if zero3 else None
    if gathered is not None:
        gathered.__enter__()
    full = {n: p.detach().float().cpu().clone() for n, p in params.items()}
    if gathered is not None:
        gathered.__exit__(None, None, None)

    from memtune.model import torch_dtype

    # In the dtype the rank loaded it in, so any difference is a change, not a rounding.
    base = AutoModelForCausalLM.from_pretrained(
        ctx.cfg.model.name_or_path, dtype=torch_dtype(ctx.cfg)
    )
    base_sd = base.state_dict()
    max_base_diff = 0.0
    n_base = 0
    for name, value in full.items():
        if "lora_" in name:
            continue
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        max_base_diff = max(max_base_diff, float((value - base_sd[key].float()).abs().max()))
        n_base += 1
    lora_b_zero = [n for n, v in full.items() if "lora_B" in n and not torch.any(v != 0)]
    n_lora_b = sum(1 for n in full if "lora_B" in n)

    ids = torch.tensor([ctx.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)])
    engine.eval()
    with torch.no_grad():
        logits = engine.module.model(input_ids=ids.to(ctx.device)).logits.float().cpu()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "zero3": zero3,
        "held_params": held,
        "total_params": total,
        "base_tensors_checked": n_base,
        "max_base_diff": max_base_diff,
        "lora_b_tensors": n_lora_b,
        "lora_b_all_zero": lora_b_zero,
    }
    (ctx.run_dir / f"probe_rank{ctx.rank}.json").write_text(json.dumps(result, indent=2))
    if ctx.rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, ctx.run_dir / "probe_logits.pt")


if __name__ == "__main__":
    run(sys.argv[1], after_train=probe)
