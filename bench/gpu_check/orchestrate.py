"""The entry (``python -m bench.gpu_check``): the orchestrator runs each phase in its own
process (``python -m bench.gpu_check --phase NAME``, internal), in priority order, within one
budget (phases.Budget)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memtune.launcher.extensions import use_own_ops_dir

from .attention import run_attention
from .baseline_runner import run_baseline
from .hybrid import run_hybrid
from .kernels import run_kernels
from .memtune_runner import run_memtune
from .mixture import run_mixture
from .mixture_load import run_mixture_load
from .modes import DRY, GPU, lengths_from_env
from .moe import run_moe
from .phases import CUT_SHORT, Budget, next_session, select, spec
from .profile import run_profile_baseline, run_profile_memtune
from .recorder import Phase
from .report import format_check, write_outputs
from .unsloth import SITE_ENV, run_at_unsloth, run_unsloth, run_unsloth_model
from .work_lock import holding
from .zero_cost import run_zero_cost


def run_phase(args: argparse.Namespace) -> int:
    mode = lengths_from_env(DRY if args.dry_run else GPU)
    name = args.phase
    this = spec(name)
    method, side = this.method, this.side
    phase = Phase(mode, name, method, side, Path(args.fragment), Path(args.out))
    deadline = args.deadline

    def expire() -> None:
        with contextlib.suppress(Exception):
            phase.data["errors"].append(
                {"where": "deadline", "error": "phase stopped: out of time"}
            )
            phase.save()
        print(f"gpu_check: {name}: out of time, stopping", flush=True)
        os._exit(124)

    watchdog = threading.Timer(max(1.0, deadline - time.time()), expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        if side == "profile":
            run_profile_memtune(phase, deadline)
        elif side == "profile-baseline":
            run_profile_baseline(phase, deadline)
        elif side == "attention":
            run_attention(phase, deadline)
        elif side == "kernels":
            run_kernels(phase, deadline)
        elif side == "zero-cost":
            run_zero_cost(phase, deadline)
        elif side == "compiled":
            run_memtune(phase, deadline, compiled=True)
        elif side == "unsloth-model":
            run_unsloth_model(phase, deadline)
        elif side == "unsloth":
            run_unsloth(phase, deadline)
        elif side == "at-unsloth":
            run_at_unsloth(phase, deadline)
        elif side in ("whole", "whole-offload"):
            run_mixture(phase, deadline, offload=side == "whole-offload")
        elif side == "load":
            run_mixture_load(phase, deadline)
        elif method == "moe":
            run_moe(phase, deadline)
        elif method == "qwen35":
            run_hybrid(phase, deadline, fla=side == "fla")
        elif side == "baseline":
            run_baseline(phase, deadline)
        else:
            run_memtune(phase, deadline, long=side == "long")
    except Exception as err:
        phase.error("phase", err)
        return 1
    finally:
        watchdog.cancel()
    return 0


# ------------------------------------------------------------------ orchestration


def ran_out(fragment: Path, status: str) -> bool:
    """Whether the phase ran out of time: killed, stopped by its watchdog, or its tail (later
    lengths, the search, later variants, the steps) skipped for want of time."""
    if status.startswith("killed"):
        return True
    try:
        errors = json.loads(fragment.read_text()).get("errors", [])
    except (OSError, json.JSONDecodeError):
        return False
    return any("out of time" in str(e.get("error", "")) for e in errors)


def orchestrate(args: argparse.Namespace) -> int:
    # Outside OUT: the device returns at most 8 files from there.
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "gpu_check_parts"
    work.mkdir(parents=True, exist_ok=True)
    with holding(work) as busy:
        if busy:
            print(f"gpu_check: {busy}", file=sys.stderr, flush=True)
            return 2
        return _orchestrate(args, work)


def _orchestrate(args: argparse.Namespace, work: Path) -> int:
    mode = lengths_from_env(DRY if args.dry_run else GPU)
    budget = Budget(mode.budget_s if args.budget_s is None else args.budget_s, mode.dry_run)
    out = Path(args.out)
    # on the device: when named (--phases); the dry run runs them all
    groups = ("unsloth", "mixture") if mode.dry_run else ()
    chosen = select(args.phases, groups)
    # --keep-parts: an earlier call's fragments on this machine stay (the Unsloth call's
    # results beside the main check's); only the phases about to run start afresh.
    names = {p.name for p in chosen} if args.keep_parts else None
    for old in work.glob("*.json"):
        if names is None or old.stem in names:
            old.unlink()
    status: dict[str, str] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        if args.keep_parts:
            status = json.loads((work / "status.json").read_text())
            status = {k: v for k, v in status.items() if k not in ("total", "next session")}
    write_outputs(mode, work, out)
    # gpu_check.sh's hard stop (timeout's SIGTERM) ends the phase running too: a phase runs in
    # a session of its own (killed whole at its deadline), out of the stop's reach, and would
    # have gone on holding the GPU and writing to OUT after the command had returned
    running: list[int] = []

    def hard_stop(signum: int, frame: Any) -> None:
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, hard_stop)
    for phase in chosen:
        name = phase.name
        now = time.time()
        phase_deadline, why = budget.grant(phase, now)
        if phase_deadline is None:
            status[name] = why
            print(f"gpu_check: {name}: {why}", flush=True)
            (work / "status.json").write_text(json.dumps(status))
            continue
        cmd = [
            sys.executable,
            "-m",
            str(__package__),
            "--phase",
            name,
            "--fragment",
            str(work / f"{name}.json"),
            "--out",
            str(out),
            "--deadline",
            str(phase_deadline),
            *(["--dry-run"] if mode.dry_run else []),
        ]
        # DeepSpeed's ops from memtune's dir (make install built them there), free of the
        # locks a phase killed at its deadline (or a killed earlier check) left: the next
        # phase loading that op would otherwise wait out its whole time on it, silently.
        use_own_ops_dir()
        print(
            f"gpu_check: {name}: starting ({phase_deadline - now:.0f} s at most, "
            f"{budget.left(now):.0f} s left of the budget)",
            flush=True,
        )
        t0 = time.time()
        env = None
        if phase.side.startswith("unsloth") and os.environ.get(SITE_ENV):
            # Unsloth's own environment: its wheels and the image's, not the main check's
            # (transformers 5.24 there; Unsloth 2026.10.9 takes <= 5.17, the image's).
            env = {**os.environ, "PYTHONPATH": os.environ[SITE_ENV]}
        with subprocess.Popen(cmd, start_new_session=True, env=env) as child:
            running[:] = [child.pid]  # cleared below: a finished phase's id may be reused
            try:
                code = child.wait(timeout=phase_deadline - now + 20)
                status[name] = f"exit {code} in {time.time() - t0:.0f} s"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.wait()
                status[name] = f"killed after {time.time() - t0:.0f} s"
            finally:
                running.clear()
        given, cap = phase_deadline - now, budget.cap(phase)
        if given < cap and ran_out(work / f"{name}.json", status[name]):
            status[name] += f"; {CUT_SHORT} (given {given:.0f} s of its {cap:.0f})"
        print(f"gpu_check: {name}: {status[name]}", flush=True)
        (work / "status.json").write_text(json.dumps(status))
        write_outputs(mode, work, out)
    status["total"] = f"{time.time() - budget.start:.0f} s"
    rerun = next_session(status)
    if rerun:  # what did not fit, for the next lent session
        status["next session"] = rerun
        print(f"gpu_check: not run for want of time; the next session: {rerun}", flush=True)
    (work / "status.json").write_text(json.dumps(status))
    result = write_outputs(mode, work, out)
    print((out / "gpu_check.md").read_text(), flush=True)
    if mode.dry_run:
        checked = format_check(mode, work)
        print(f"gpu_check: GPU-only branches rendered with made-up readings: {checked}")
    measured = measured_anything(result)
    return 0 if measured and not result["errors"] else 1


def measured_anything(result: dict[str, Any]) -> bool:
    """Whether the outputs hold any measurement (the exit status is 0 only then, and without
    errors): a phase's timed rows, the long search's fits, the MoE rows, the kernels, the
    attention, the mixture, the profile or ZeRO's cost (a run of only those phases too)."""
    moe_rows = (result["moe"] or {}).get("rows", [])
    kernel_rows = (result["kernels"] or {}).get("variants", [])
    searched = [s for lc in result["long"] for s in lc["search"] if s.get("ok")]
    mixture = result["mixture"] or {}
    mixture_rows = [r for run in mixture.get("runs", []) for r in run["rows"]]
    measured = (
        result["records"]
        or result["hybrid"]
        or any(r.get("step_ms") for r in moe_rows)
        or any(v.get("tokens_per_s") for v in kernel_rows)
        or any(r.get("ms") for r in (result["attention"] or {}).get("rows", []))
        or searched  # a long phase run for its census alone (GPU_CHECK_LONG_TIMED=)
        or any(r.get("tokens_per_s") for r in mixture_rows)
        or "load" in (mixture.get("load") or {})
    )
    zero = result["zero_cost"] or {}
    return bool(
        measured
        or any(p.get("step_ms") for p in result["profile"])
        or any((zero.get(side) or {}).get("tokens_per_s") for side in ("plain", "engine"))
    )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    summary = (sys.modules[str(__package__)].__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=summary)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: code paths only")
    default_out = os.environ.get("OUT") or str(Path(tempfile.gettempdir()) / "gpu_check_out")
    ap.add_argument("--out", default=default_out, help="default $OUT, else /tmp/gpu_check_out")
    ap.add_argument("--work", default=None, help="per-phase fragments (/tmp/gpu_check_parts)")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="one budget for all the phases together"
    )
    ap.add_argument(
        "--phases",
        default=None,
        help="comma-separated subset, run in priority order (phases.PHASES); what a run "
        "skipped for want of time: its status' 'next session'",
    )
    ap.add_argument(
        "--keep-parts",
        action="store_true",
        help="keep the other phases' results of an earlier call in --work (the Unsloth call)",
    )
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    # Deprecations raised inside DeepSpeed, peft and transformers on every step.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*is deprecated")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # the phases too
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the device machine has no network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.phase:
        return run_phase(args)
    return orchestrate(args)
