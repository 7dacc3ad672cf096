"""The planner's long-context figures for the shipped box, written to bench/results/:
the longest sequence each experiment can train, the 131k run's breakdown, QLoRA on one card,
and what splitting a sequence costs by the step-time model. Planned: the GPU check
(bench/gpu_check.sh, long-* phases) measures the one-card limits when a GPU is lent.

    .venv/bin/python bench/long_context_plan.py     # ~1 minute, CPU, nothing downloaded
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memtune.config import compose, register_configs, to_run_config  # noqa: E402
from memtune.config.decisions import rank_machine  # noqa: E402
from memtune.memory.counts import count_params  # noqa: E402
from memtune.memory.fit import fit_to_device  # noqa: E402
from memtune.memory.long_context_choice import longest_sequence  # noqa: E402
from memtune.memory.plan_text import format_plan  # noqa: E402
from memtune.memory.step_time import step_time  # noqa: E402

EXPERIMENTS = [
    ("qwen2.5-7b-4x4090-lora", []),
    ("qwen2.5-7b-4x4090-qlora", []),
    ("qwen3-8b-4x4090-lora", []),
    ("qwen2.5-7b-4x4090-long", ["data.path=books.jsonl"]),
    (
        "qwen2.5-7b-4x4090-qlora",
        ["launcher.num_ranks=1", "trainer.global_batch_size=8", "plan.host_gib=120"],
    ),
    (
        "qwen2.5-7b-4x4090-lora",
        ["launcher.num_ranks=1", "trainer.global_batch_size=8", "plan.host_gib=120"],
    ),
]


def cfg_of(experiment: str, extra: list[str]):
    return to_run_config(compose([f"experiment={experiment}", *extra]))


def main() -> int:
    register_configs()
    rows, lines = [], []
    for experiment, extra in EXPERIMENTS:
        cfg = cfg_of(experiment, extra)
        fitted = fit_to_device(cfg, refuse=False)
        d = fitted.decisions
        n, how = longest_sequence(cfg, d, count_params(cfg), fitted.machine)
        where = f"{cfg.launcher.num_ranks} × {cfg.plan.device_gib} GiB, ZeRO-{d.zero_stage}"
        rows.append(
            {"experiment": experiment, "overrides": extra, "box": where, "longest": n, "with": how}
        )
    long_cfg = cfg_of("qwen2.5-7b-4x4090-long", ["data.path=books.jsonl"])
    fitted = fit_to_device(long_cfg)
    split = []
    # (ZeRO, sp, micro batch): the same micro batch, then under ZeRO-3 sp× the micro batch,
    # which holds as many tokens per rank per micro step as sp=1 (the same activations).
    cases = [(z, sp, 1) for z in ("zero2", "zero3") for sp in (1, 2, 4)]
    cases += [("zero3", 2, 2), ("zero3", 4, 4)]
    for zero, sp, micro in cases:
        cfg = cfg_of(
            "qwen2.5-7b-4x4090-long",
            [
                "data.path=books.jsonl",
                "data.max_seq_len=32768",
                f"zero={zero}",
                f"trainer.sequence_parallel={sp}",
                f"trainer.micro_batch_size={micro}",
                "trainer.tiled_mlp=on",
                "trainer.offload_activations=on",
                "trainer.checkpoint_layers=all",
            ],
        )
        d = fit_to_device(cfg, refuse=False, machine=rank_machine()).decisions
        t = step_time(cfg, d)
        assert t is not None
        split.append(
            {
                "zero": zero,
                "sp": sp,
                "micro_batch": micro,
                "rank_tokens": d.batch.rank_tokens,
                "step_s": t.step_s,
                "traffic": t.traffic,
            }
        )
    today = dt.date.today().isoformat()
    out = ROOT / "bench" / "results"
    (out / f"{today}-long-context-plan.json").write_text(
        json.dumps({"longest": rows, "split_cost_32k": split}, indent=2) + "\n"
    )
    lines += [
        f"# Long context, planned ({today}; CPU planner)",
        "",
        "The one-card limits were measured once, on an H200 under a 24 GB cap (2026-12-04,",
        "`bench/results/2026-12-04-h200-rerun.md`: QLoRA 65,536 tokens fit, 81,920 did not);",
        "the planner was corrected from that run. The box's figures are planned only.",
        "",
        "Longest `data.max_seq_len` whose plan fits with 2 GiB spare per rank, the long-context",
        "choices (sequence_parallel, tiled_mlp, offload_activations) and checkpointed layers on",
        "auto (`make plan` prints the same line):",
        "",
        "| experiment | overrides | box | longest tokens | chosen there |",
        "|---|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experiment']} | {' '.join(r['overrides']) or '—'} | {r['box']} "
            f"| {r['longest']:,} | {r['with']} |"
        )
    lines += ["", "`make plan EXP=qwen2.5-7b-4x4090-long` (131,072 tokens):", "", "```"]
    lines += [*fitted.notes, format_plan(fitted.cfg, fitted.decisions, fitted.plan), "```", ""]
    lines += [
        "What splitting a sequence costs by the step-time model at 32,768 tokens (every",
        "layer recomputed from an offloaded input, MLP tiled, the same global batch of 4):",
        "",
        "| ZeRO | sp | micro batch | tokens per rank per micro step | step s (est.) | vs sp=1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = {s["zero"]: s["step_s"] for s in split if s["sp"] == 1}
    for s in split:
        more = s["step_s"] / base[s["zero"]] - 1
        lines.append(
            f"| {s['zero']} | {s['sp']} | {s['micro_batch']} | {s['rank_tokens']:,} "
            f"| {s['step_s']:.1f} | {more:+.0%} |"
        )
    lines += [
        "",
        "ZeRO-3 gathers the weights once per micro step. At the same micro batch a group of",
        "sp ranks runs every one of its sequences together, so sp=4 takes 4× the micro steps",
        "and 4× the gathers. sp× the micro batch holds as many tokens per rank as sp=1 (the",
        "same activation memory) in as many micro steps: the gathers are sp=1's again, and the",
        "split costs its all-to-alls only. The plan offers it (`trainer.micro_batch_size=N",
        "instead: ...`) whenever ZeRO-3 splits sequences.",
    ]
    (out / f"{today}-long-context-plan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
