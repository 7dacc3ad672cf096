"""Check a node's GPUs before its ranks start: ``memtune preflight --gpus 4``.

What it looks at: how many GPUs are visible (``CUDA_VISIBLE_DEVICES`` respected), their names,
memory, compute capability and the driver; then, with more than one GPU, a cross-GPU copy and a
small NCCL all-reduce with peer-to-peer allowed, each under a timeout. From that it decides
NCCL's switches for the ranks:

- RTX 40-series cards (4090/4090D/4080...) have no NVLink and their PCIe P2P is disabled or
  broken on many boards and drivers; NCCL then hangs or corrupts data unless
  ``NCCL_P2P_DISABLE=1``. So P2P is turned off for them unless the checks prove it works.
- Any card whose P2P check fails gets ``NCCL_P2P_DISABLE=1`` too.
- One node: ``NCCL_IB_DISABLE=1`` (no InfiniBand probing on a box without it).
- A variable already set in the environment is the user's decision and is kept as it is.

The checks run in this separate process so the launcher itself never holds a CUDA context.
The decision is printed and saved as ``RUN_DIR/preflight.json``. Exit code 2: too few GPUs,
or GPUs that cannot all-reduce at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtune.arguments import VerbParser, positive_float, positive_int
from memtune.config import LauncherConfig
from memtune.exit_codes import EXIT_CONFIG
from memtune.filesystem import write_atomic

if TYPE_CHECKING:
    from memtune.memory.estimate import Plan

GIB = 1024**3
CONSUMER_NO_P2P = re.compile(r"RTX\s*40[5-9]0|\b40[5-9]0\b", re.IGNORECASE)
CHECK_TIMEOUT_S = 60.0


class PreflightError(RuntimeError):
    """This machine cannot run the launch (GPUs missing, NCCL broken). The job reports it like
    a config error (launcher.job.run_job); ``memtune preflight`` exits 2."""


def gpu_facts() -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    held_by = _compute_apps() if count else {}
    gpus = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        # seen with this process's own CUDA context on the card (cudaMemGetInfo makes it):
        # a few hundred MiB less than the ranks will find, whose own context the plan counts
        free, _ = torch.cuda.mem_get_info(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "total_gib": round(p.total_memory / GIB, 2),
                "free_gib": round(free / GIB, 2),
                "sm": f"{p.major}{p.minor}",
                "processes": held_by.get(str(getattr(p, "uuid", "")), []),
            }
        )
    driver = _driver_version() if count else None
    return {
        "count": count,
        "gpus": gpus,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _compute_apps() -> dict[str, list[str]]:
    """``{card uuid (no "GPU-"): ["pid name (N MiB)", ...]}`` of the processes nvidia-smi
    says hold memory on each card, this one left out; {} where nvidia-smi does not answer."""
    import subprocess

    query = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    return compute_apps_by_card(out.stdout, os.getpid())


def compute_apps_by_card(text: str, own_pid: int) -> dict[str, list[str]]:
    """nvidia-smi's ``gpu_uuid, pid, process_name, used_memory`` lines (csv, no header) by
    card: ``{uuid without "GPU-": ["pid name (used)", ...]}``, ``own_pid`` left out."""
    held: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[1].isdigit() or int(fields[1]) == own_pid:
            continue
        uuid, pid, used = fields[0].removeprefix("GPU-"), fields[1], fields[-1]
        name = ",".join(fields[2:-1])
        held.setdefault(uuid, []).append(f"{pid} {name} ({used})")
    return held


def planned_device_gib(planned: Plan) -> float:
    """What a rank needs free on its card by the plan, as the preflight sees the card: the
    step's peak, or loading's where larger, less the plan's CUDA-context row — the free figure
    is read with the preflight's own context on the card, which the rank's will replace (the
    rest of that row, its kernels' and NCCL's workspaces, is not counted: a card refused here
    is short by more than that)."""
    from memtune.memory.estimate import CONTEXT_ROW

    loading = planned.loading.device_gib if planned.loading is not None else 0.0
    return max(planned.total_gib - planned.gib().get(CONTEXT_ROW, 0.0), loading)


def short_cards(facts: Mapping[str, Any], required: int, planned_gib: float) -> str | None:
    """The refusal, in one line, where a card the ranks will use has less free memory than the
    plan's per-rank peak (``planned_gib``: the step's or loading's, whichever is larger): each
    such card named with its free and total GiB and, where nvidia-smi listed them, the
    processes holding it; None where every card has room (or the facts say nothing of free
    memory: a record from before it was recorded)."""
    short = [
        g
        for g in facts["gpus"][:required]
        if g.get("free_gib") is not None and g["free_gib"] < planned_gib
    ]
    if not short:
        return None
    cards = []
    for g in short:
        held = f"; held by {', '.join(g['processes'])}" if g.get("processes") else ""
        cards.append(
            f"cuda:{g['index']} {g['name']} has {g['free_gib']:.2f} GiB free of "
            f"{g['total_gib']:.2f}{held}"
        )
    return (
        f"the plan needs {planned_gib:.2f} GiB per rank, and {'; '.join(cards)}: free the "
        "card(s), choose others (CUDA_VISIBLE_DEVICES), or set plan.device_gib to what is free"
    )


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None where it is not on the PATH."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.stdout.strip() else None


def _copy_check(n: int) -> dict[str, Any]:
    """cuda:0 → cuda:i copies of a known pattern; the values must survive."""
    import torch

    result: dict[str, Any] = {"ok": True, "peer_access": [], "bad_pairs": []}
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    for i in range(1, n):
        result["peer_access"].append(torch.cuda.can_device_access_peer(0, i))
        dst = src.to(f"cuda:{i}")
        torch.cuda.synchronize(i)
        if not torch.equal(dst.cpu(), src.cpu()):
            result["ok"] = False
            result["bad_pairs"].append([0, i])
    return result


ALL_REDUCE_ELEMENTS = 1 << 24  # 64 MiB of fp32: large enough to time the link, not latency
ALL_REDUCE_ITERS = 5


def all_reduced(x: Any, world: int) -> bool:
    """Whether every element of the preflight's buffer is the sum of the ranks' fills (rank r
    fills r + 1): every one, not the first only — with several channels a broken peer-to-peer
    path corrupts other chunks of the buffer, and the first element still read right."""
    return bool((x == world * (world + 1) / 2).all())


def _all_reduce_rank(rank: int, world: int, port: int, out: Any, backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    x = torch.empty((ALL_REDUCE_ELEMENTS,), device=device)

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize()

    x.fill_(float(rank + 1))
    dist.all_reduce(x)  # warm-up: connections, buffers
    sync()
    dist.barrier()
    correct, seconds = True, 0.0
    for _ in range(ALL_REDUCE_ITERS):
        x.fill_(float(rank + 1))
        start = time.perf_counter()
        dist.all_reduce(x)  # every element: 1 + 2 + ... + world
        sync()
        seconds += time.perf_counter() - start
        correct = correct and all_reduced(x, world)  # outside the timed part
    out.put((rank, correct, seconds / ALL_REDUCE_ITERS))
    dist.destroy_process_group()


def all_reduce_check(
    n: int, env: Mapping[str, str], timeout_s: float, backend: str = "nccl"
) -> dict[str, Any]:
    """An all-reduce over n ranks (GPUs with NCCL, CPU processes with gloo) in fresh processes,
    killed after ``timeout_s``; also a bandwidth measurement: ``bus_gb_s`` is the ring's bus
    bandwidth, 2(n−1)/n × the buffer's bytes per all-reduce / its time (NCCL's busbw), which
    is what the step-time estimate's plan.link_gb_s stands for."""
    import multiprocessing as mp

    from memtune.launcher.spawn import free_port

    port = free_port()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(r, n, port, out, backend)) for r in range(n)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        rows: list[tuple[int, bool, float]] = []
        while len(rows) < n and time.monotonic() < deadline:
            try:
                rows.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if len(rows) < n:
        return {"ok": False, "error": f"no result from {n - len(rows)} rank(s) in {timeout_s} s"}
    bad = [r for r, correct, _ in rows if not correct]
    seconds = max(s for _, _, s in rows)
    bus = 2 * (n - 1) / n * ALL_REDUCE_ELEMENTS * 4 / seconds / 1e9
    return {
        "ok": not bad,
        "seconds": round(seconds, 5),
        "bus_gb_s": round(bus, 2),
        "bad_ranks": bad,
    }


def measured_bus_gb_s(record: Mapping[str, Any], nnodes: int = 1) -> float | None:
    """The bus bandwidth of the all-reduce the ranks will run like (P2P off when decided).
    None on several nodes: the check ran between this node's GPUs, and the job's all-reduce
    crosses the nodes' network (plan.link_gb_s stands for that one)."""
    if nnodes > 1:
        return None
    checks = record.get("checks", {})
    p2p_off = record.get("env", {}).get("NCCL_P2P_DISABLE") == "1"
    chosen = checks.get("all_reduce_no_p2p" if p2p_off else "all_reduce_p2p") or {}
    return chosen.get("bus_gb_s") if chosen.get("ok") else None


def nccl_env_decision(
    facts: Mapping[str, Any],
    checks: Mapping[str, Any],
    nnodes: int,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The NCCL environment for the ranks and the reason for each choice (pure logic)."""
    chosen: dict[str, str] = {}
    reasons: list[str] = []
    names = [g["name"] for g in facts.get("gpus", [])]
    consumer = any(CONSUMER_NO_P2P.search(n) for n in names)
    p2p_proven = bool(checks.get("copy", {}).get("ok")) and bool(
        checks.get("all_reduce_p2p", {}).get("ok")
    )
    if "NCCL_P2P_DISABLE" in env:
        reasons.append(f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']}: set by you, kept")
    elif len(names) < 2:
        reasons.append("P2P: one GPU on this node, nothing to decide")
    elif p2p_proven:
        reasons.append("P2P: kept on; the cross-GPU copy and the NCCL all-reduce with P2P passed")
    elif consumer:
        chosen["NCCL_P2P_DISABLE"] = "1"
        reasons.append(
            "NCCL_P2P_DISABLE=1: RTX 40-series cards, and the checks did not prove P2P works"
        )
    else:
        chosen["NCCL_P2P_DISABLE"] = "1"
        reasons.append("NCCL_P2P_DISABLE=1: the P2P copy or all-reduce check failed")
    if "NCCL_IB_DISABLE" in env:
        reasons.append(f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}: set by you, kept")
    elif nnodes == 1:
        chosen["NCCL_IB_DISABLE"] = "1"
        reasons.append("NCCL_IB_DISABLE=1: a single node, no InfiniBand between ranks")
    return {"env": chosen, "reasons": reasons}


def run_checks(required: int, nnodes: int, timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, Any]:
    facts = gpu_facts()
    count = facts["count"]
    if count < required:
        hint = (
            "this machine has no usable CUDA GPU (or torch is a CPU build); "
            "`make train` runs the CPU demo"
            if count == 0
            else "set CUDA_VISIBLE_DEVICES or launcher.num_ranks to what is there"
        )
        raise PreflightError(f"{required} GPUs needed, {count} visible: {hint}")
    checks: dict[str, Any] = {}
    if required > 1:
        checks["copy"] = _copy_check(required)
        checks["all_reduce_p2p"] = all_reduce_check(required, {}, timeout_s)
    decision = nccl_env_decision(facts, checks, nnodes, os.environ)
    if required > 1 and (
        not checks["all_reduce_p2p"]["ok"] or decision["env"].get("NCCL_P2P_DISABLE") == "1"
    ):
        # P2P off must work, or NCCL itself is broken here: say so before the ranks hang. It
        # is also the bandwidth the ranks will see.
        checks["all_reduce_no_p2p"] = all_reduce_check(
            required, {**decision["env"], "NCCL_P2P_DISABLE": "1"}, timeout_s
        )
        if not checks["all_reduce_no_p2p"]["ok"]:
            raise PreflightError(
                f"an NCCL all-reduce over {required} GPUs fails even with P2P off "
                f"({checks['all_reduce_no_p2p']}); check the driver and NCCL install"
            )
    return {"facts": facts, "checks": checks, **decision}


def describe(record: Mapping[str, Any], required: int) -> list[str]:
    facts = record["facts"]
    lines = [f"memtune: preflight: {facts['count']} GPU(s) visible, using {required}"]
    for g in facts["gpus"][:required]:
        free = f" ({g['free_gib']:.1f} free)" if g.get("free_gib") is not None else ""
        lines.append(
            f"  cuda:{g['index']} {g['name']} · {g['total_gib']:.1f} GiB{free} · sm_{g['sm']}"
        )
    lines.append(
        f"  driver {facts['driver'] or '?'} · torch {facts['torch']} · CUDA {facts['cuda']}"
    )
    for name, check in record["checks"].items():
        lines.append(f"  check {name}: {'ok' if check.get('ok') else 'FAILED'} {check}")
    bus = measured_bus_gb_s(record)
    if bus is not None:
        lines.append(f"  all-reduce bus bandwidth as the ranks will run: {bus:g} GB/s")
    lines.extend(f"  {r}" for r in record["reasons"])
    return lines


def for_launch(
    launcher: LauncherConfig,
    ranks_per_node: int,
    nnodes: int,
    out: Path,
    planned_gib: float | None = None,
) -> tuple[dict[str, str], float | None]:
    """The launcher's preflight, run by train.py before it tokenizes or plans anything: {} on a
    machine without CUDA (CPU ranks; refused with launcher.require_gpus), else the NCCL
    environment decided by this module run as a child (``python -m memtune.launcher.preflight``,
    timed out), so the launcher itself never holds a CUDA context; and the all-reduce bus
    bandwidth it measured (None when no check ran). With ``planned_gib`` (the plan's per-rank
    peak), a card with less free memory than that is refused (:func:`short_cards`)."""
    import subprocess

    from memtune.machine import cuda_available

    if not cuda_available():
        if launcher.require_gpus:
            raise PreflightError(
                f"{ranks_per_node} GPUs needed on this node, 0 visible (no CUDA device; "
                "launcher.require_gpus=true: this experiment is not for CPU ranks)"
            )
        return {}, None
    if not launcher.preflight:
        from memtune.launcher.spawn import listed_devices

        # as CUDA reads the list (up to a negative entry), as launcher.spawn passes it on
        visible = listed_devices(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        if 0 < len(visible) < ranks_per_node:
            # launcher.spawn passes the list on as it is: the ranks beyond it would find no card
            raise PreflightError(
                f"{ranks_per_node} GPUs needed on this node, CUDA_VISIBLE_DEVICES lists "
                f"{len(visible)} ({','.join(visible)}): list as many as "
                "the node's ranks, or ask for fewer (launcher.num_ranks)"
            )
        return {}, None
    cmd = [sys.executable, "-m", "memtune.launcher.preflight", "--gpus", str(ranks_per_node)]
    cmd += ["--nnodes", str(nnodes), "--json", str(out)]
    try:
        proc = subprocess.run(cmd, timeout=4 * CHECK_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired as err:
        raise PreflightError(f"the GPU checks did not finish in {err.timeout:.0f} s") from None
    if proc.returncode != 0:
        raise PreflightError(f"the GPU checks failed (exit code {proc.returncode}, see above)")
    record = json.loads(out.read_text())
    if planned_gib is not None:
        short = short_cards(record["facts"], ranks_per_node, planned_gib)
        if short is not None:
            raise PreflightError(short)
    return dict(record["env"]), measured_bus_gb_s(record, nnodes)


def main(argv: list[str] | None = None) -> None:
    parser = VerbParser(
        prog="memtune preflight",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs this node must have")
    parser.add_argument("--nnodes", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--timeout", type=positive_float, default=CHECK_TIMEOUT_S)
    args = parser.parse_args(argv)
    try:
        record = run_checks(args.gpus, args.nnodes, args.timeout)
    except PreflightError as err:
        print(f"memtune preflight: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    print("\n".join(describe(record, args.gpus)), flush=True)
    if args.json:
        write_record(args.json, record)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """The checks' record, through a temporary name: a folder at RUN/preflight.json (or a full
    disk) is one line naming it and exit 2, not a traceback after the checks passed (the job
    said only that "the GPU checks failed")."""
    try:
        write_atomic(path, json.dumps(record, indent=2) + "\n")
    except OSError as err:
        why = f"{type(err).__name__}: {err.strerror or err}"
        print(f"memtune preflight: cannot write {path} ({why})", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


if __name__ == "__main__":
    main()
