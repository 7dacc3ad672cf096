"""Inside a phase's process: :class:`Phase`, what it records (a fragment rewritten after every
measurement, and the outputs with it), and what every runner starts with (the device and the
machine's record, a world of one rank, the time left)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .measure import empty_cache, environment, matmul_tflops, memory_now
from .modes import Mode
from .report import write_outputs


class Phase:
    """What a child process measures; writes its fragment after every measurement."""

    def __init__(self, mode: Mode, name: str, method: str, side: str, frag: Path, out: Path):
        self.mode, self.name, self.method, self.side = mode, name, method, side
        self.frag, self.out = frag, out
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {
            "phase": name,
            "method": method,
            "side": side,
            "records": [],
            "search": [],
            "errors": [],
            "notes": [],
        }

    def save(self) -> None:
        with self.lock:
            tmp = self.frag.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(self.frag)
            write_outputs(self.mode, self.frag.parent, self.out)

    def error(self, where: str, err: BaseException) -> None:
        import traceback

        text = "".join(traceback.format_exception_only(type(err), err)).strip()
        print(f"gpu_check: {self.name}: {where}: {text}", flush=True)
        traceback.print_exc()
        self.data["errors"].append({"where": where, "error": text[-2000:]})
        self.save()

    def add(self, rec: dict[str, Any]) -> None:
        self.data["records"].append(rec)
        self.save()
        self.say(rec, rec["seq_len"])

    def say(self, rec: dict[str, Any], seq_len: int) -> None:
        """One line for a length's result: tokens/s, peak, the plan's error."""
        tps, peak = rec.get("tokens_per_s"), rec.get("measured_gib")
        print(
            f"gpu_check: {self.name} {seq_len}: "
            + (f"{tps:,.0f} tokens/s" if tps else "no timing")
            + (f", peak {peak:.2f} GiB" if peak is not None else "")
            + (f", plan error {rec['plan_error_pct']:+.1f}%" if "plan_error_pct" in rec else ""),
            flush=True,
        )


BASELINE_SIDES = ("profile-baseline", "baseline", "unsloth-model", "unsloth")
"""Phases that run another recipe as its users run it: CUDA's allocator left as torch sets it."""


def device_and_env(phase: Phase) -> Any:
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not phase.mode.dry_run:
        raise RuntimeError("no CUDA device: the GPU check needs one (--dry-run runs on CPU)")
    allocator = None
    if phase.side not in BASELINE_SIDES:
        # as a rank starts (rank.worker), before anything starts CUDA: the shipped default
        from memtune.config import compose, to_run_config
        from memtune.config.decisions import cuda_alloc_conf
        from memtune.rank.worker import use_cuda_allocator

        allocator = use_cuda_allocator(cuda_alloc_conf(to_run_config(compose([]))))
    phase.data["env"] = environment(device)
    if device.type == "cuda":
        phase.data["env"]["cuda_allocator"] = allocator or "torch's defaults (the recipe's)"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        phase.data["env"]["matmul_tflops"] = matmul_tflops(device)
        gc.collect()
        empty_cache(device)
    phase.data["start_memory"] = memory_now(device)
    return device


def time_left(deadline: float, need_s: float) -> bool:
    return time.time() + need_s < deadline


def init_one_rank(device: Any) -> None:
    """The environment ``deepspeed``/``torchrun`` give a rank, for a world of one."""
    from memtune.launcher.spawn import free_port, node_env
    from memtune.rank.worker import init_distributed

    world = {"RANK": "0", "LOCAL_RANK": "0", **node_env(1, free_port())}
    for key, value in world.items():
        if key != "CUDA_VISIBLE_DEVICES":  # the card the check was given stays its card
            os.environ.setdefault(key, value)

    init_distributed()
