"""Per-rank memory, metrics.jsonl, wandb and the console, behind one logger object.

Only rank 0 writes; every other rank gets a :class:`NullLogger`, so the training loop never
asks which rank it is on.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from memtune.filesystem import write_atomic
from memtune.rundir import RunDir

GIB = 1024**3


_PEAKS_BEFORE_RESET: dict[str, float] = {}
"""The peaks :func:`memory_snapshot` read just before the last :func:`reset_window_peak`. The
reset (an evaluation's own window) also clears the counters the run's peak is read from
(CUDA's max_memory_*, and on CPU ru_maxrss with VmHWM): without these, a run whose last step
was followed by an evaluation reported the evaluation's peak as the run's."""

_HOST_OFFLOAD = {"now": 0, "peak": 0}
"""Bytes of host memory this rank holds for offloaded layer inputs (rank.long_context's
buffers, :func:`count_host_offload`): now, and the most so far; the plan's host row."""


def count_host_offload(nbytes: int) -> None:
    """``nbytes`` more (or, negative, fewer) host bytes held for offloaded layer inputs."""
    _HOST_OFFLOAD["now"] += nbytes
    _HOST_OFFLOAD["peak"] = max(_HOST_OFFLOAD["peak"], _HOST_OFFLOAD["now"])


def host_offload_gib() -> float:
    """Host memory held for offloaded layer inputs now, GiB (the GPU check's long phases)."""
    return _HOST_OFFLOAD["now"] / GIB


_OUTSIDE_PEAK: dict[str, float] = {}
"""The most this process has seen its GPU hold outside torch's allocator (see memory_snapshot)."""


def memory_snapshot(device: torch.device) -> dict[str, float]:
    """This rank's memory in GiB: CUDA allocator stats on GPU, process RSS on CPU. The peaks
    are the whole process's so far, across :func:`reset_window_peak`."""
    if device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device)
        # What the device holds beyond this process's allocator: the CUDA context, loaded
        # kernels, library workspaces, NCCL's buffers (and any other process on the card). The
        # plan allows for it in a row the allocator's statistics never see.
        free, total = torch.cuda.mem_get_info(device)
        outside = (total - free - reserved) / GIB
        _OUTSIDE_PEAK["gib"] = max(_OUTSIDE_PEAK.get("gib", 0.0), outside)
        snapshot = {
            "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "reserved_gib": reserved / GIB,
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "outside_allocator_gib": outside,
            "peak_outside_allocator_gib": _OUTSIDE_PEAK["gib"],
        }
    else:
        rss = psutil.Process().memory_info().rss
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        snapshot = {"rss_gib": rss / GIB, "peak_rss_gib": peak_kib * 1024 / GIB}
    # on every rank, 0 where nothing is offloaded: the ranks gather the same keys
    snapshot["peak_host_offload_gib"] = _HOST_OFFLOAD["peak"] / GIB
    for key, before in _PEAKS_BEFORE_RESET.items():
        snapshot[key] = max(snapshot[key], before)
    return snapshot


def window_peak_gib(device: torch.device) -> float:
    """Peak since the last :func:`reset_window_peak` (or process start): CUDA peak allocated,
    or the kernel's resident high-water mark (VmHWM) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def reset_window_peak(device: torch.device) -> bool:
    """Start a new peak window; False where the platform does not allow it. The process's
    peak so far is kept for :func:`memory_snapshot`."""
    peaks = memory_snapshot(device)
    _PEAKS_BEFORE_RESET.update({k: v for k, v in peaks.items() if k.startswith("peak_")})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the high-water mark
        return True
    except OSError:
        return False


def peak_key(device: torch.device) -> str:
    return "peak_allocated_gib" if device.type == "cuda" else "peak_rss_gib"


def keep_steps_through(path: Path, step: int) -> None:
    """Drop metrics.jsonl's rows of steps after ``step``, where this start of the run begins:
    it logs them again. ``step`` is the checkpoint a resume continues from, or 0 where there is
    none (a start killed before its first checkpoint left rows that the next start, from step
    1, appended to: steps 1-6, then 1, 2, ... again). A row that cannot be read (the last one
    cut short by a kill or a full disk) is dropped too: it is no step's."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text(errors="replace").splitlines() if _step_of(r) <= step]
    write_atomic(path, "".join(r + "\n" for r in rows))  # a crash here keeps the history


def _step_of(row: str) -> float:
    """A metrics.jsonl row's step; infinity for a row that is not one (never kept)."""
    try:
        value = json.loads(row)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
    return value if isinstance(value, int) else float("inf")


class NullLogger:
    """What ranks other than 0 log with: nothing."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def progress(self, n: int, postfix: dict[str, Any]) -> None:
        pass

    def info(self, msg: str) -> None:
        pass

    def summarize(self, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress:
    """The progress bar's content as whole lines, for output that is not a terminal (a Slurm
    job's .out file, a pipe, a CI log): tqdm redraws its bar with carriage returns, which such a
    file keeps, so a run's progress was one line of every redraw (75 KB for 1,000 steps). A
    line at the first step of this start, then at most one a minute, and one at the last."""

    def __init__(self, total: int, done: int, every_s: float = 60.0) -> None:
        self.total, self.n, self.start_n = total, done, done
        self.every_s = every_s
        self.started = time.monotonic()
        self.said = -float("inf")  # when the last line was printed
        self.postfix: dict[str, Any] = {}

    def set_postfix(self, postfix: dict[str, Any], refresh: bool = False) -> None:
        self.postfix = dict(postfix)

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if self.n - n == self.start_n or self.n >= self.total or now - self.said >= self.every_s:
            self.said = now
            print(self.line(now - self.started), file=sys.stderr, flush=True)

    def line(self, elapsed: float) -> str:
        """``train: step 12/24 (50%) · 0:05 elapsed, ~0:05 left · loss=1.2345``."""
        from tqdm import tqdm

        done_here = self.n - self.start_n
        left = ""
        if done_here > 0 and self.n < self.total:
            rest = elapsed / done_here * (self.total - self.n)
            left = f", ~{tqdm.format_interval(rest)} left"
        post = "".join(f" · {k}={v}" for k, v in self.postfix.items())
        pct = 100 * self.n // max(self.total, 1)
        return (
            f"train: step {self.n}/{self.total} ({pct}%) · "
            f"{tqdm.format_interval(elapsed)} elapsed{left}{post}"
        )

    def write(self, msg: str, file: Any = None) -> None:
        print(msg, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Rank 0: metrics.jsonl in the run dir, wandb (offline unless asked), a tqdm bar."""

    def __init__(
        self,
        rd: RunDir,
        total_steps: int,
        wandb_cfg: Any,
        config: dict[str, Any],
        done: int = 0,
    ):
        from tqdm import tqdm

        keep_steps_through(rd.metrics, done)
        self.metrics_file = rd.metrics.open("a", encoding="utf-8")
        self.bar: Any
        if sys.stderr.isatty():
            self.bar = tqdm(
                total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True
            )
        else:
            self.bar = LineProgress(total_steps, done)
        self.wandb = _start_wandb(rd.path, wandb_cfg, config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3), **metrics}
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(_flatten(metrics), step=step)

    def progress(self, n: int, postfix: dict[str, Any]) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(n)

    def info(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stdout)

    def summarize(self, values: dict[str, Any]) -> None:
        """Run-level values (wandb's run summary; summary.json has them too)."""
        if self.wandb is not None:
            for key, value in _flatten(values).items():
                self.wandb.summary[key] = value

    def close(self) -> None:
        self.bar.close()
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()
            end_wandb()


WANDB_TEMP_DIRS = (
    ("wandb.sdk.data_types._private", None, "MEDIA_TMP"),
    ("wandb.sdk.artifacts.artifact", "Artifact", "_TMP_DIR"),
)
"""wandb's two staging dirs, ``$TMPDIR/tmp*wandb-media`` and ``tmp*wandb-artifacts``: module
(or class) level ``tempfile.TemporaryDirectory`` objects made when wandb is imported."""


def end_wandb() -> None:
    """What wandb leaves to ``atexit``, done now: a rank ends with ``os._exit``
    (rank.worker.leave), which runs no atexit hook, so every run used to leave wandb's two
    staging dirs in $TMPDIR (and its service running until it noticed). ``wandb.teardown``
    stops the service; the staging dirs are removed through the very TemporaryDirectory
    objects that made them (nothing else in $TMPDIR is touched). Only after the run's
    ``finish``: nothing of the run is staged any more."""
    import wandb

    wandb.teardown()
    for module_name, owner, attr in WANDB_TEMP_DIRS:
        holder: Any = sys.modules.get(module_name)  # only what this process imported
        if holder is not None and owner is not None:
            holder = getattr(holder, owner, None)
        staging = getattr(holder, attr, None)
        if isinstance(staging, tempfile.TemporaryDirectory):
            staging.cleanup()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, list):
            continue  # metrics.jsonl's (a mixture's expert shares): no wandb scalar
        else:
            out[f"{prefix}{k}"] = v
    return out


def _start_wandb(run_dir: Path, cfg: Any, config: dict[str, Any]) -> Any:
    if cfg.backend != "wandb":
        return None
    import wandb

    from memtune.config.logger_check import wandb_mode

    mode = wandb_mode(cfg)  # what train.py checked (config.logger_check)
    return wandb.init(
        project=cfg.project,
        group=cfg.group,
        name=cfg.name or run_dir.name,
        dir=str(run_dir),
        mode=mode,
        config=config,
        settings=wandb.Settings(silent=True, console="off"),
    )
