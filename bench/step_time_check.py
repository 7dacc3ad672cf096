"""The step-time estimate (``memtune.memory.step_time``) against measured step times on CPU.

    .venv/bin/python bench/step_time_check.py          # ~2 min on 2 CPUs
    .venv/bin/python bench/step_time_check.py --steps 8 --hidden 1024

The estimate divides FLOPs by a device rate and bytes by a link bandwidth. Here both are
measured on this machine first — the rate of one fp32 matmul of a decoder layer's shape on one
thread (each CPU rank runs one), and gloo's all-reduce bus bandwidth between two processes (the
GPU preflight's own measurement, ``launcher.preflight.all_reduce_check``) — and passed as
``plan.device_tflops`` (with ``plan.mfu=1``) and ``plan.link_gb_s``. Then a Qwen2-shaped model
wide enough for matmuls to dominate (``--hidden``, 4 layers, fp32, LoRA on all linear layers,
packed rows) trains on 2 CPU ranks under ZeRO-2 and ZeRO-3, and each run's median step time
after the first two steps is compared with the estimate for its resolved config.

Writes ``<out>/<YYYY-MM-DD>-step-time.json`` and ``.md`` and prints the table. Not a test: the
numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import loadavg, machine

from memtune.config import compose, register_configs
from memtune.launcher.preflight import all_reduce_check
from memtune.launcher.prepare import lay_out
from memtune.launcher.spawn import launch
from memtune.memory.counts import count_params
from memtune.memory.step_time import step_time
from memtune.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def matmul_tflops(tokens: int, hidden: int, inter: int, seconds: float = 3.0) -> float:
    """fp32 (tokens × hidden) @ (hidden × inter) on one thread, as a rank runs it."""
    torch.set_num_threads(1)
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, inter)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * tokens * hidden * inter * n / (time.perf_counter() - start) / 1e12


def overrides(a: argparse.Namespace, stage: int, tflops: float, link: float) -> list[str]:
    return [
        "logger=none",
        "launcher.num_ranks=2",
        f"zero=zero{stage}",
        "peft=lora-all-linear",
        "trainer.precision=fp32",
        f"trainer.max_steps={a.steps}",
        "trainer.warmup_steps=1",
        "trainer.save_every=0",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=4",
        f"data.max_seq_len={a.seq_len}",
        f"model.architecture.hidden_size={a.hidden}",
        f"model.architecture.intermediate_size={a.inter}",
        "model.architecture.num_hidden_layers=4",
        "model.architecture.num_attention_heads=8",
        "model.architecture.num_key_value_heads=2",
        f"plan.device_tflops={tflops}",
        "plan.mfu=1.0",
        f"plan.link_gb_s={link}",
    ]


def step_seconds(run_dir: Path, skip: int) -> list[float]:
    rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    rows = [r for r in rows if "perf/tokens_per_s" in r and r["step"] > skip]
    return [r["train/input_tokens"] / r["perf/tokens_per_s"] for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2816)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args(argv)
    register_configs()
    tflops = matmul_tflops(a.seq_len, a.hidden, a.inter)
    link = all_reduce_check(2, {}, timeout_s=120, backend="gloo")
    if not link["ok"]:
        raise SystemExit(f"gloo all-reduce failed: {link}")
    print(f"matmul {tflops * 1e3:.1f} GFLOPS/thread · gloo bus {link['bus_gb_s']} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="memtune-step-time-") as tmp:
        for stage in (2, 3):
            run_dir = Path(tmp) / f"zero{stage}"
            log = run_dir.with_suffix(".log")
            cfg, d = lay_out(compose(overrides(a, stage, tflops, link["bus_gb_s"])), run_dir)
            load = loadavg()
            with log.open("w") as f:
                saved = os.dup(1), os.dup(2)
                os.dup2(f.fileno(), 1)
                os.dup2(f.fileno(), 2)
                try:
                    code = launch(cfg, run_dir)
                finally:
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
            if code != 0:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"zero{stage}: exit code {code}")
            measured = statistics.median(step_seconds(run_dir, skip=2))
            estimate = step_time(cfg, d, count_params(cfg))
            assert estimate is not None
            rows.append(
                {
                    "zero_stage": stage,
                    "checkpointed_layers": d.checkpointing.recomputed,
                    "selective_layers": d.checkpointing.selective,
                    "measured_step_s": round(measured, 3),
                    "estimated_step_s": round(estimate.step_s, 3),
                    "estimated_compute_s": round(estimate.compute_s, 3),
                    "estimated_comm_s": round(estimate.comm_s, 3),
                    "estimated_bytes": round(estimate.bytes),
                    "error": round(estimate.step_s / measured - 1, 3),
                    "loadavg_1min_before": load,
                }
            )
            print(rows[-1], flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "settings": vars(a) | {"out": str(a.out)},
        "matmul_tflops_per_thread": tflops,
        "gloo": link,
        "runs": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{result['date']}-step-time"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"### Step-time estimate vs measured, {result['date']} (CPU, 2 gloo ranks)",
        "",
        f"Qwen2-shaped model: 4 layers, hidden {a.hidden}, intermediate {a.inter}, 8/2 heads, "
        f"fp32, LoRA r=16 on all linear layers, packed rows of {a.seq_len} tokens, micro batch "
        f"1 × accumulation 2 × 2 ranks, {a.steps} steps (median of steps 3..{a.steps}). Rates "
        f"measured here first: fp32 matmul {tflops * 1e3:.1f} GFLOPS on one thread "
        f"(`plan.device_tflops`, `plan.mfu=1`), gloo all-reduce bus bandwidth "
        f"{link['bus_gb_s']} GB/s (`plan.link_gb_s`).",
        "",
        "| ZeRO | measured s/step | estimated s/step | of which compute | of which communication "
        "| estimate − measured |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['zero_stage']} | {r['measured_step_s']:.2f} | {r['estimated_step_s']:.2f} | "
            f"{r['estimated_compute_s']:.2f} | {r['estimated_comm_s']:.2f} | {r['error']:+.0%} |"
            for r in rows
        ),
        "",
        "The estimate counts matmuls only; on CPU the norms, RoPE, SiLU, the optimizer and "
        "DeepSpeed's hooks are what it leaves out, and the ZeRO-3 row's communication runs in "
        "the same cores as the compute.",
    ]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
