"""Mixture-of-experts block benchmark: LoRA on the routed experts, memtune's way against peft's.

    .venv/bin/python bench/moe_bench.py                 # ~4 min on 2 CPUs (make bench runs it)
    .venv/bin/python bench/moe_bench.py --smoke --out /tmp/moe

One Qwen3-MoE sparse block (router + fused expert stacks, transformers 5's own classes, random
weights) at a reduced width, forward and backward over a batch of tokens, LoRA r=16 on every
routed expert. Each variant runs in its own process (so its peak RSS is its own), ``--reps``
times, alternating:

* **memtune**: rank.experts' forward: each expert on the tokens routed to it, the adapter as
  x·Aᵀ·Bᵀ, no W + B·A built;
* **peft-<impl>**: peft 0.21's ``target_parameters`` adapters over transformers' experts
  implementation ``<impl>`` (``eager``, ``grouped_mm``): the stack is
  re-parametrized as W + s·B·A (one ``baddbmm``) at every forward;
* **frozen-memtune** / **frozen-<impl>**: the experts without adapters (what
  ``peft.target=all-linear-but-experts`` runs), memtune's routed forward (torch's
  ``grouped_mm`` where torch allows, a loop over the experts otherwise) against transformers'
  implementations.

Reported: the median step (forward + backward) in ms, tokens/s, and the process's peak RSS
above the block's weights (``getrusage`` after the steps minus before them: what the steps
added at their peak). Writes ``<out>/<date>-moe.json`` and ``<out>/<date>-moe.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import loadavg, machine

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(  # Qwen3-30B-A3B's proportions at 1/2 of its width, 64 of its 128 experts
    hidden_size=1024,
    moe_intermediate_size=384,
    num_experts=64,
    num_experts_per_tok=8,
)
VARIANTS = [
    "memtune",
    "peft-eager",
    "peft-grouped_mm",
    "frozen-memtune",
    "frozen-eager",
    "frozen-grouped_mm",
]
"""transformers' third implementation, ``batched_mm``, gathers a weight per routed token: at 256
tokens it took 47.6 s a step and 12.1 GB with peft's adapters (2026-12-03, this shape), so it
is left out."""


def one(variant: str, tokens: int, steps: int, threads: int) -> dict[str, Any]:
    """Run in a child process: build the block, time ``steps`` forward + backward passes."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    frozen = variant.startswith("frozen-")
    impl = variant.split("-", 1)[1] if "-" in variant else "memtune"
    config = AutoConfig.for_model(
        "qwen3_moe",
        **SHAPE,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=3072,
    )
    config._experts_implementation = impl if impl != "memtune" else "eager"
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.requires_grad_(False)
    if impl == "memtune":
        from memtune.rank.experts import add_expert_lora, use_routed_forward

        if frozen:
            use_routed_forward(block)
        else:
            add_expert_lora(block, 16, 2.0)
    elif not frozen:
        from peft import LoraConfig, get_peft_model

        wrapper = torch.nn.ModuleDict({"mlp": block})
        lora = LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            lora_dropout=0.0,
        )
        block = get_peft_model(wrapper, lora).base_model.model["mlp"]
    trainable = sum(p.numel() for p in block.parameters() if p.requires_grad)
    x = torch.randn(1, tokens, SHAPE["hidden_size"], requires_grad=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        block(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]  # the first warms up
    return {
        "variant": variant,
        "trainable": trainable,
        "step_ms": 1000 * step,
        "tokens_per_s": tokens / step,
        "peak_rss_added_mib": (peak - before) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="256 tokens, 2 steps, 1 round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()  # make bench passes bench.py's ARGS to both
    if args.smoke:
        args.tokens, args.steps, args.reps = 256, 2, 1
    if args.child:
        print(json.dumps(one(args.child, args.tokens, args.steps, args.threads)))
        return
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
                 "--steps", str(args.steps), "--threads", str(args.threads)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            rows[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(variant, rows[variant][-1], flush=True)
    table = []
    for variant, runs in rows.items():
        table.append(
            {
                "variant": variant,
                "trainable": runs[0]["trainable"],
                "step_ms": statistics.median(r["step_ms"] for r in runs),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "peak_rss_added_mib": statistics.median(r["peak_rss_added_mib"] for r in runs),
            }
        )
    today = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": today,
        "shape": SHAPE,
        "tokens": args.tokens,
        "steps": args.steps,
        "reps": args.reps,
        "threads": args.threads,
        "loadavg_end": loadavg(),
        "machine": machine(),
        "runs": rows,
        "table": table,
    }
    (args.out / f"{today}-moe.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# MoE block benchmark, {today}",
        "",
        f"One Qwen3-MoE sparse block, hidden {SHAPE['hidden_size']}, {SHAPE['num_experts']} "
        f"experts of {SHAPE['moe_intermediate_size']}, top-{SHAPE['num_experts_per_tok']}, "
        f"{args.tokens} tokens, forward + backward, LoRA r=16 on the routed experts, fp32, "
        f"{args.threads} threads; median of {args.reps} rounds × {args.steps} steps (the first "
        "step of each round left out). Peak RSS added: what the steps added to the process's "
        "peak over the block's weights.",
        "",
        "| variant | trainable | step (ms) | tokens/s | peak RSS added (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in table:
        lines.append(
            f"| {row['variant']} | {row['trainable']:,} | {row['step_ms']:.0f} | "
            f"{row['tokens_per_s']:,.0f} | {row['peak_rss_added_mib']:.0f} |"
        )
    (args.out / f"{today}-moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
