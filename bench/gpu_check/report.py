"""The outputs: the phases' fragments collected into ``gpu_check.json``, rendered as
``gpu_check.md``, and the dry run's format check (the GPU-only branches with made-up
readings)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .measure import add_fits_card, add_mfu, add_plan_error, census
from .mixture_report import collect_mixture, fake_readings, mixture_markdown
from .modes import CAP_GIB, GIB, MEASURED_TFLOPS, MOE_SHAPE, PEAK_TFLOPS, Mode
from .phases import PHASE_NAMES
from .unsloth_report import collect_unsloth, compare_unsloth, unsloth_markdown


def short_kernel(path: str) -> str:
    return "torch" if path.startswith("transformers.") else path.split(".")[0]


def load_fragments(work: Path) -> list[dict[str, Any]]:
    frags = []
    for name in PHASE_NAMES:
        path = work / f"{name}.json"
        if path.is_file():
            with contextlib.suppress(json.JSONDecodeError):
                frags.append(json.loads(path.read_text()))
    return frags


def write_outputs(mode: Mode, work: Path, out: Path) -> dict[str, Any]:
    """gpu_check.json and gpu_check.md from the phases' fragments so far. The tables are
    rendered from readings no CPU run has seen: where rendering fails, the failure is among
    the errors and gpu_check.md says so, and gpu_check.json keeps every reading (a raise here
    ended the phase that saved, and the orchestrator with every phase after it)."""
    result = collect(mode, work)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tables = markdown(result)
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        print(f"gpu_check: the tables could not be rendered ({why})", flush=True)
        result["errors"].append({"phase": "report", "where": "markdown", "error": why[-2000:]})
        tables = (
            f"# GPU check\n\nThe tables could not be rendered ({why}); every reading is in "
            "gpu_check.json.\n"
        )
    for name, text in (
        ("gpu_check.json", json.dumps(result, indent=2, default=str) + "\n"),
        ("gpu_check.md", tables),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    return result


def collect(mode: Mode, work: Path) -> dict[str, Any]:
    frags = load_fragments(work)
    status_path = work / "status.json"
    status = json.loads(status_path.read_text()) if status_path.is_file() else {}
    env = dict(next((f["env"] for f in frags if "env" in f), {}))
    # each phase's CUDA allocator (recorder.device_and_env): memtune's as a rank starts, the
    # recipes' as their users run them; by allocator, the phases that ran with it
    allocators: dict[str, list[str]] = {}
    for f in frags:
        if "cuda_allocator" in f.get("env", {}):
            allocators.setdefault(f["env"]["cuda_allocator"], []).append(f["phase"])
    env.pop("cuda_allocator", None)
    if allocators:
        env["cuda_allocators"] = allocators
    records = [r for f in frags for r in f["records"]]
    search = next((f for f in frags if f.get("search_info")), None)
    result = {
        "mode": asdict(mode),
        "env": env,
        "status": status,
        "constants": {
            "peak_tflops": PEAK_TFLOPS,
            "measured_ceiling_tflops": MEASURED_TFLOPS,
            "cap_gib": CAP_GIB,
        },
        "records": records,
        "comparison": compare(records),
        "search": search["search"] if search else [],
        "search_info": search.get("search_info") if search else None,
        "long": [
            {
                "phase": f["phase"],
                "method": f["method"],
                "info": f["long_search_info"],
                "search": f.get("long_search", []),
                "records": f["records"],
            }
            for f in frags
            if f.get("long_search_info")
        ],
        "hybrid": [f["hybrid"] for f in frags if f.get("hybrid")],
        "moe": next((f["moe"] for f in frags if f.get("moe")), None),
        "profile": [f["profile"] for f in frags if f.get("profile")],
        "kernels": next((f["kernels"] for f in frags if f.get("kernels")), None),
        "zero_cost": next((f["zero_cost"] for f in frags if f.get("zero_cost")), None),
        "attention": next((f["attention"] for f in frags if f.get("attention")), None),
        "unsloth": collect_unsloth(frags, records),
        "mixture": collect_mixture(frags),
        "errors": [{"phase": f["phase"], **e} for f in frags for e in f["errors"]],
        "notes": {f["phase"]: f["notes"] for f in frags},
    }
    return result


def format_check(mode: Mode, work: Path) -> Path:
    """Dry run: fill the records with made-up GPU readings and render them, so the accounting
    and table branches only a CUDA device reaches run here too (never in the real outputs)."""
    from types import SimpleNamespace

    result = collect(mode, work)
    fake_gpu = SimpleNamespace(type="cuda")
    for i, r in enumerate(result["records"]):
        if r["side"] == "unsloth":  # made up below: the dry run cannot import Unsloth
            r.pop("error", None)
            r.update(step_s_median=0.5, tokens_per_s=2.0 * r["seq_len"], losses=[12.1, 12.0])
        r.update(peak_allocated_gib=10.0 + i, peak_reserved_gib=11.0 + i)
        r.update(outside_allocator_gib=0.6, leftover_gib=0.1)
        add_mfu(r, {"lora": 1e15, "six_n": 1.4e15}, fake_gpu)
        if "plan" in r:
            add_plan_error(r)
            assert r["mfu"] > 0 and "plan_error_pct" in r, r
        else:
            r["measured_gib"] = r["peak_allocated_gib"] - r["leftover_gib"]
            r["device_used_gib"] = r["peak_reserved_gib"] - r["leftover_gib"] + 0.6
    # memtune's rows ran under the cap, the recipe's not: each says whether it fitted the card
    capped = ("memtune", "memtune-at-unsloth", "memtune-compiled")
    for r in result["records"]:
        where = f"{r['side']} {r['method']} {r['seq_len']}"
        assert r["side"] not in capped or r.get("cap_gib"), f"{where}: not run under the cap"
        assert r["side"] != "baseline" or r.get("cap_gib", 0) is None, f"{where}: capped"
        assert r["side"] != "baseline" or "fits_cap" in r, f"{where}: no fits_cap"
    over = next((r for r in result["records"] if r["side"] == "baseline"), None)
    if over is not None:  # as the recipe's LoRA 4,096 row on the H200 (2026-12-04)
        over["device_used_gib"] = 25.53
        add_fits_card(over)
    for i, r in enumerate(result["hybrid"]):
        if "plan" in r:
            r.update(peak_allocated_gib=15.0 + i, peak_reserved_gib=16.0 + i)
            r.update(outside_allocator_gib=0.6, leftover_gib=0.1)
            add_plan_error(r)
            assert "plan_error_pct" in r, r
        r["resolved"] = {"conv": "transformers.x.causal_conv1d_fn", "recurrence": "fla.ops.x.f"}
    if result["moe"]:
        result["moe"].update(device="cuda:0", dtype="bfloat16")
        for i, r in enumerate(result["moe"]["rows"]):
            if r.get("step_ms"):
                r["peak_mib"] = 1000.0 + 100 * i
        result["moe"]["rows"].append(
            {"variant": "made-up", "tokens": 1, "error": "RuntimeError('made up (format check)')"}
        )
    for s in result["search"]:
        s.update(peak_allocated_gib=20.0, checkpointed_layers=28)
    if result["kernels"]:
        from .kernels import compare_to_first

        for i, v in enumerate(result["kernels"]["variants"]):
            if v.get("losses"):
                v["peak_allocated_gib"] = 19.5 - 0.1 * i
        result["kernels"]["variants"].append(
            {"variant": "made-up", "kernels": "?", "error": "RuntimeError('made up')"}
        )
        compare_to_first(result["kernels"])
    z = result["zero_cost"]
    if z and z.get("plain", {}).get("step_s_median") and z.get("engine", {}).get("step_s_median"):
        z["plain"]["peak_allocated_gib"], z["engine"]["peak_allocated_gib"] = 17.0, 17.5
        z["zero_gib"] = 0.5
    made_up = [  # the allocator's history as _snapshot gives it: a census of its peak
        {
            "action": "alloc",
            "addr": 1,
            "size": 3 * GIB,
            "frames": [
                {"filename": "torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/x/memtune/rank/long_context.py", "line": 90, "name": "backward"},
            ],
        },
        {"action": "alloc", "addr": 2, "size": GIB, "frames": []},
        {"action": "free_completed", "addr": 2, "size": GIB},
        {"action": "alloc", "addr": 3, "size": GIB // 2, "frames": []},
    ]
    for lc in result["long"]:
        if lc["search"]:
            lc["search"][0]["census"] = census(made_up)
            assert abs(lc["search"][0]["census"]["peak_gib"] - 4.0) < 1e-9
            assert lc["search"][0]["census"]["rows"][0]["gib"] == 3.0
    if result["search_info"]:
        result["search_info"]["allocator_cap_gib"] = 23.4
    result["comparison"] = compare(result["records"])
    if result["unsloth"]:
        result["unsloth"]["comparison"] = compare_unsloth(result["records"])
    fake_readings(result.get("mixture"))
    result["env"].update(gpu="FAKE GPU (format check)", gpu_total_gib=139.8, matmul_tflops=777.0)
    result["env"]["cuda_allocators"] = {
        "expandable segments": ["lora-memtune"],
        "torch's defaults (the recipe's)": ["lora-baseline"],
    }
    assert all("speedup" in c and "memory_ratio" in c for c in result["comparison"])
    text = markdown(result)
    assert over is None or f"| none — **{OVER_CAP}** |" in text, "no over-the-card mark"
    if over is not None and any(
        (c["method"], c["seq_len"]) == (over["method"], over["seq_len"])
        for c in result["comparison"]
    ):
        assert "**no** (25.53 GiB" in text, "the comparison does not say the recipe was over"
    assert "; CUDA allocator expandable segments: lora-memtune;" in text, "no allocator"
    assert not result["moe"] or "| memtune | " in text, "the MoE table did not render"
    assert not result["kernels"] or "| all three |" in text, "the kernels table did not render"
    assert not z or "#### ZeRO's own cost on one card" in text, "the ZeRO cost did not render"
    compiled = any(r["side"] == "memtune-compiled" for r in result["records"])
    assert not compiled or "Compiled layers (`trainer.compile=true`" in text, "no compiled row"
    assert not z or z.get("zero_ms_per_step") is None or "+0.50 GiB at the peak" in text, z
    if result["attention"]:  # made up: the kernels a CUDA device runs
        for r in result["attention"]["rows"]:
            if r["kernel"] != "sdpa_varlen":
                r.pop("error", None)
                r.update(ms=1.0, speedup=2.0, max_abs_diff=1e-3)
        for r in result["attention"].get("backward", []):
            r.pop("error", None)
            r.update(measured_mib=200.0, planned_mib=100.0, error_pct=-50.0)
        text = markdown(result)
        assert "| torch_varlen | 1.00 | 2.00 | 1.00e-03 |" in text, "no attention table"
        assert "| sdpa_varlen | one per KV head | 200 | 100 | -50.0% |" in text, "no backward table"
    runs = (result.get("mixture") or {}).get("runs") or []
    assert not runs or "#### A whole mixture on one card" in text, "the mixture did not render"
    assert not any(r["rows"] for r in runs) or "as the plan said" in text, "no planned OOM row"
    if result["unsloth"]:
        rows = result["unsloth"]["comparison"]
        assert rows and all(r.get("at_peak_speed") or "at_peak" not in r for r in rows), rows
        assert "#### Unsloth beside memtune" in text, "the Unsloth table did not render"
    path = work / "format_check.md"
    path.write_text(text)
    return path


def census_markdown(lc: dict[str, Any]) -> list[str]:
    """The allocator's census at the peak of the long phase's first one-step run."""
    rec = next((r for r in lc.get("search", []) if r.get("census")), None)
    if rec is None:
        return []
    c = rec["census"]
    if "error" in c:
        return ["", f"Census at {rec['seq_len']} tokens failed: {c['error']}"]
    lines = [
        "",
        f"What the step at {rec['seq_len']} tokens had allocated at its peak "
        f"({c['peak_gib']:.2f} GiB above what existed before it; {c['blocks']:,} blocks, "
        f"{c['events']:,} allocator events; the allocator's history, grouped by the innermost "
        "frame ← the innermost frame of memtune, transformers, peft, bitsandbytes or DeepSpeed):",
        "",
        "| GiB | blocks | allocated in |",
        "|---:|---:|---|",
    ]
    for r in c["rows"]:
        lines.append(f"| {r['gib']:.3f} | {r['count']} | {r['where'].replace('|', '/')} |")
    lines.append(f"| {c['rest_gib']:.3f} | | the rest |")
    return lines


def _search_row(tried: dict[str, Any], planned: dict[str, Any], middle: str) -> str:
    """One row of a search under the cap: measured (if tried) next to planned."""
    ok = {True: "yes", False: "OOM" if tried.get("oom") else "error"}.get(tried.get("ok"), "—")
    return (
        f"| {planned['seq_len']} | {ok} | {_f(tried.get('peak_allocated_gib'), '.2f')} "
        f"| {_f(tried.get('step_s'), '.2f')} | {middle} | {planned['total_gib']:.2f} "
        f"| {'yes' if planned['fits'] else 'no'} |"
    )


def compare(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    by = {(r["method"], r["seq_len"], r["side"]): r for r in records}
    for (method, seq_len, side), m in by.items():
        b = by.get((method, seq_len, "baseline"))
        if side != "memtune" or b is None:
            continue
        row: dict[str, Any] = {"method": method, "seq_len": seq_len}
        # memtune's row under the cap, the recipe's not: whether the recipe's peak fitted
        row["baseline_fits_cap"] = b.get("fits_cap")
        row["baseline_device_used_gib"] = b.get("device_used_gib")
        if m.get("tokens_per_s") and b.get("tokens_per_s"):
            row["speedup"] = m["tokens_per_s"] / b["tokens_per_s"]
        if m.get("measured_gib") and b.get("measured_gib"):
            row["memory_ratio"] = m["measured_gib"] / b["measured_gib"]
        rows.append(row)
    return rows


def compiled_lines(records: list[dict[str, Any]]) -> list[str]:
    """``trainer.compile`` (phase ``lora-compiled``) beside the eager row at its length: the
    steady tokens/s, the first step (the compile in it), the graphs and breaks, the loss."""
    by = {(r["method"], r["seq_len"], r["side"]): r for r in records}
    lines = []
    for (method, seq_len, side), c in by.items():
        if side != "memtune-compiled":
            continue
        eager = by.get((method, seq_len, "memtune"), {})
        if not c.get("tokens_per_s"):
            lines += ["", f"Compiled layers ({method}, {seq_len} tokens): {c.get('error', '—')}"]
            continue
        ratio = c["tokens_per_s"] / eager["tokens_per_s"] if eager.get("tokens_per_s") else None
        dynamo = c.get("dynamo") or {}
        first = (c.get("step_s") or [None])[0]
        losses, eager_losses = c.get("losses") or [], eager.get("losses") or []
        lines += [
            "",
            f"Compiled layers (`trainer.compile=true`; {method}, {seq_len} tokens, "
            f"{c.get('compiled_layers', '?')} layers compiled, "
            f"{c.get('checkpointed_layers', '?')} of them inside the checkpoint): "
            f"{c['tokens_per_s']:,.0f} tokens/s"
            + (f", {ratio:.2f}× eager's {eager['tokens_per_s']:,.0f}" if ratio else "")
            + (f"; the first step (the compile) {first:.1f} s" if first is not None else "")
            + f"; {dynamo.get('graphs', '?')} graphs, {dynamo.get('graph_breaks', '?')} breaks"
            + (
                f"; first loss {losses[0]:.4f} (eager {eager_losses[0]:.4f})"
                if losses and eager_losses
                else ""
            )
            + ".",
        ]
    return lines


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _layers(r: dict[str, Any]) -> str:
    """Checkpointed layers in a table cell: "20", or "20 + 5 sel." with selective ones."""
    full, selective = r.get("checkpointed_layers"), r.get("selective_layers") or 0
    return _f(full, "d") + (f" + {selective} sel." if selective else "")


def _pct(x: Any) -> str:
    return "—" if x is None else f"{x:+.1f}%"


OVER_CAP = "over 24 GB: would not fit a 4090"
"""The mark of a row whose card use at its peak was over the 24 GB card (``fits_cap``)."""


def _cap(r: dict[str, Any]) -> str:
    """A row's cap in a table cell: the card its allocator was capped at, "none" (the recipe,
    uncapped), "—" (not recorded: results before the cap), and the mark when its card use at
    the peak was over the 24 GB card."""
    cap = r.get("cap_gib")
    cell = "—" if "cap_gib" not in r else ("none" if cap is None else f"{cap:.2f}")
    return cell + (f" — **{OVER_CAP}**" if r.get("fits_cap") is False else "")


def _fits(c: dict[str, Any]) -> str:
    """Whether the recipe's row fitted the 24 GB card, in the comparison's cell."""
    fits, used = c.get("baseline_fits_cap"), c.get("baseline_device_used_gib")
    if fits is None:
        return "—"
    return "yes" if fits else f"**no** ({used:.2f} GiB: {OVER_CAP})"


def markdown(result: dict[str, Any]) -> str:
    env, mode = result["env"], result["mode"]
    gpu = env.get("gpu", "no GPU (dry run on CPU)")
    lines = [
        f"### GPU check, {env.get('date', dt.date.today().isoformat())}, {gpu}",
        "",
        (
            "**Dry run on CPU with the tiny model: checks that every code path runs; "
            "no number below means anything.**\n"
            if mode["dry_run"]
            else ""
        ),
        f"Model `{mode['model']}` (random weights), one rank, micro batch 1, every token "
        f"labelled; {mode['warmup']} warm-up + {mode['timed']} timed steps (median). "
        + ", ".join(
            f"{k} {env[k]}"
            for k in ("python", "torch", "torch_cuda", "transformers", "peft", "deepspeed")
            if k in env
        )
        + (f", bitsandbytes {env['bitsandbytes']}" if "bitsandbytes" in env else "")
        + (f"; {env['gpu_total_gib']:.1f} GiB" if "gpu_total_gib" in env else "")
        + (
            f"; bf16 matmul 8192³ {env['matmul_tflops']:.0f} TFLOP/s at the start"
            if "matmul_tflops" in env
            else ""
        )
        + "".join(
            f"; CUDA allocator {alloc}: {', '.join(phases)}"
            for alloc, phases in env.get("cuda_allocators", {}).items()
        )
        + ".",
        "",
        "| method | tokens | side | tokens/s | step s | peak GiB | card GiB | cap GiB "
        "| plan GiB | plan err | MFU | MFU 6N | ckpt layers | loss |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(result["records"], key=lambda r: (r["method"], -r["seq_len"], r["side"])):
        plan = r.get("plan", {})
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else r.get("error", "—")[:60]
        lines.append(
            f"| {r['method']} | {r['seq_len']} | {r['side']} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_s_median'), '.3f')} | {_f(r.get('measured_gib'), '.2f')} "
            f"| {_f(r.get('device_used_gib'), '.2f')} | {_cap(r)} "
            f"| {_f(plan.get('live_gib'), '.2f')} | {_pct(r.get('plan_error_pct'))} "
            f"| {_f(r.get('mfu'), '.1%')} | {_f(r.get('mfu_6n'), '.1%')} "
            f"| {_layers(r)} | {loss} |"
        )
    # The first length's first loss is ln 2 (0.6931): the adapter has not moved yet.
    for r in result["records"]:
        if r.get("reference_pass_s") is not None:
            step = r.get("step_s_median")
            lines += [
                "",
                f"DPO at {r['seq_len']} tokens (one pair per row): the reference pass took "
                f"{r['reference_pass_s']:.3f} s for the row (memtune's precompute, once per pair "
                "before training; at the first length the first loss is ln 2 = 0.6931)"
                + (f"; a training step {step:.3f} s" if step else "")
                + (f"; first loss {r['losses'][0]:.4f}" if r.get("losses") else "")
                + ".",
            ]
    lines += compiled_lines(result["records"])
    if result["comparison"]:
        lines += [
            "",
            "| method | tokens | memtune / baseline tokens/s | memtune / baseline peak "
            "| baseline fits 24 GB |",
        ]
        lines.append("|---|---:|---:|---:|---|")
        for c in result["comparison"]:
            lines.append(
                f"| {c['method']} | {c['seq_len']} | {_f(c.get('speedup'), '.2f')}× "
                f"| {_f(c.get('memory_ratio'), '.2f')}× | {_fits(c)} |"
            )
    info = result.get("search_info")
    if info:
        cap = info.get("allocator_cap_gib")
        lines += [
            "",
            f"Longest QLoRA sequence with memtune under a {info['cap_gib']} GiB card"
            + (f" (allocator capped at {cap:.2f} GiB: the rest is the CUDA context)" if cap else "")
            + ", one step each, ascending, stopping at the first failure:",
            "",
            "| tokens | fits | peak GiB | step s | ckpt layers | plan total GiB | plan fits |",
            "|---:|:---:|---:|---:|---:|---:|:---:|",
        ]
        planned = {p["seq_len"]: p for p in info.get("planned", [])}
        tried = {s["seq_len"]: s for s in result["search"]}
        for seq_len, p in planned.items():
            s = tried.get(seq_len, {})
            lines.append(_search_row(s, p, _f(s.get("checkpointed_layers"), "d")))
        fits = [s["seq_len"] for s in result["search"] if s.get("ok")]
        plan_fits = [p["seq_len"] for p in info.get("planned", []) if p["fits"]]
        lines += [
            "",
            f"Measured: longest that fits {max(fits) if fits else 'none of those tried'}; "
            f"planner: {max(plan_fits) if plan_fits else 'none'}.",
        ]
    for lc in result.get("long", []):
        info = lc["info"]
        lines += [
            "",
            f"Long context, {lc['method']} on one GPU under a {info['cap_gib']} GiB card "
            "(sp=1, MLP tiled, every layer recomputed from an input offloaded to pinned host "
            "memory), one step each, ascending, stopping at the first failure:",
            "",
            "| tokens | fits | peak GiB | step s | tokens/s | plan total GiB | plan fits |",
            "|---:|:---:|---:|---:|---:|---:|:---:|",
        ]
        for r in lc["records"]:
            lines.append(
                f"| {r['seq_len']} (timed) | {'error' if r.get('error') else 'yes'} "
                f"| {_f(r.get('measured_gib'), '.2f')} | {_f(r.get('step_s_median'), '.2f')} "
                f"| {_f(r.get('tokens_per_s'), ',.0f')} "
                f"| {_f((r.get('plan') or {}).get('total_gib'), '.2f')} | — |"
            )
        tried = {s["seq_len"]: s for s in lc["search"]}
        for p in info.get("planned", []):
            lines.append(_search_row(tried.get(p["seq_len"], {}), p, "—"))
        fits = [s["seq_len"] for s in lc["search"] if s.get("ok")]
        lines += [
            "",
            f"Measured: longest that fits {max(fits) if fits else 'none of those tried'}; "
            f"planner's longest: {info.get('planned_longest', 0):,} tokens "
            f"({info.get('planned_longest_how', '')}).",
        ]
        lines += census_markdown(lc)
    lines += profile_markdown(result.get("profile") or [])
    from .attention import attention_markdown
    from .kernels import kernels_markdown
    from .zero_cost import zero_cost_markdown

    lines += kernels_markdown(result.get("kernels"))
    lines += zero_cost_markdown(result.get("zero_cost"))
    lines += attention_markdown(result.get("attention"))
    lines += unsloth_markdown(result.get("unsloth") or {})
    lines += moe_markdown(result.get("moe"))
    lines += hybrid_markdown(result["hybrid"], mode)
    lines += mixture_markdown(result.get("mixture"))
    lines += [
        "",
        "*peak GiB*: `torch.cuda.max_memory_allocated` over the steps (reset before them), less "
        "what was allocated before the model was built. *plan GiB*: the planner's rows less "
        "fragmentation and the CUDA context (what the allocator can see); *plan err* = plan / "
        "peak − 1 (baseline rows: the planner's nearest config, ZeRO-2 + plain loss, "
        "approximate). *MFU*: model FLOPs / step time / 989 TFLOP/s (H100 and H200 SXM dense "
        "bf16 by the datasheet; this card's bf16 matmul, measured at the start, is in the "
        "header): (4·N + 6·N_lora)·T + 6·L·T²·h, N the "
        "decoder's linear weights and the LM head (frozen: forward 2N, input gradient 2N, no "
        "weight gradient), attention causal within each sequence (a DPO row: its pair, "
        "2·(T/2)² for T²); recompute not counted. *MFU 6N*: the usual "
        "6·N·T + attention, for comparison. *card GiB*: what the card had in use at the peak "
        "(peak reserved + what lies outside the allocator, less what was allocated before). "
        "*cap GiB*: memtune's rows (and Unsloth's) run with the allocator capped "
        "(`set_per_process_memory_fraction`) at the card they are planned for, less what lies "
        "outside the allocator; the recipe's run uncapped (*none*), so that its speed is "
        f"measured at all, and a row whose card GiB is over {CAP_GIB} is marked *{OVER_CAP}* "
        "(as run: uncapped, its allocator keeps cache a cap would make it free, so over is "
        "not proof that it cannot fit, only that it did not).",
    ]
    status = result.get("status") or {}
    if status:
        lines += ["", "Phases: " + "; ".join(f"{k} {v}" for k, v in status.items()) + "."]
    if result["errors"]:
        lines += ["", "Errors:"]
        lines += [f"- {e['phase']} / {e['where']}: {e['error'][:300]}" for e in result["errors"]]
    return "\n".join(line for line in lines) + "\n"


def profile_markdown(profiles: list[dict[str, Any]]) -> list[str]:
    """Where a step's time goes, memtune's and the recipe's side by side (profile.KINDS)."""
    from .profile import KINDS

    if not profiles:
        return []
    sides = sorted(profiles, key=lambda p: p["side"] != "memtune")
    first = sides[0]
    head = " | ".join(f"{p['side']} ms | {p['side']} share" for p in sides)
    lines = [
        "",
        f"Where a step's time goes (profile phases; LoRA, {first['seq_len']:,} tokens, "
        f"{first['steps']} profiled steps after the warm-up; own time per operator, "
        f"{first['measured_on']}):",
        "",
        f"| kind | {head} |",
        "|---|" + "---:|---:|" * len(sides),
    ]
    for kind in KINDS:
        cells = " | ".join(
            f"{p['kinds_ms'].get(kind, 0.0):,.1f} | {p['shares'].get(kind, 0.0):.1%}" for p in sides
        )
        lines.append(f"| {kind} | {cells} |")
    lines.append(
        "| **step** | " + " | ".join(f"**{p['step_ms']:,.1f}** | 100%" for p in sides) + " |"
    )
    for p in sides:
        top = "; ".join(f"{name} {ms:,.1f}" for name, ms in p["top_ops_ms"][:8])
        lines.append(
            f"- {p['side']}: {_layers(p)} layers checkpointed "
            f"({p['recompute_labelled_layers']} labelled for the recompute), attention "
            f"{p['attention']}, loss {p['loss_kind']}; costliest ms a step: {top}"
            + (
                f"; {p['kernels_outside_ops_ms']:,.1f} ms of kernels no operator launched "
                "(in the idle row)"
                if p.get("kernels_outside_ops_ms", 0.0) >= 0.05
                else ""
            )
        )
        planned = p.get("planned")
        if planned:
            lines.append(
                f"- {p['side']}, as the step-time estimate counts this step: "
                f"{planned['matmul_tflop']:.3g} TFLOP of matmuls (full recomputes included), "
                f"the selective layers' recompute passes {planned['selective_recompute_gb']:.3g} "
                f"GB, LoRA dropout's {planned['lora_dropout_gb']:.3g} GB (memory-bound: at the "
                "card's bandwidth)"
            )
    return lines


def moe_markdown(moe: dict[str, Any] | None) -> list[str]:
    """The MoE block phase: one row a variant, then memtune's loop against grouped_mm."""
    if not moe:
        return []
    shape = moe["shape"]
    lines = [
        "",
        "#### Mixture-of-experts block",
        "",
        f"One `Qwen3MoeSparseMoeBlock` (transformers' class: router + fused expert stacks), not "
        f"a model: hidden {shape['hidden_size']}, {shape['num_experts']} experts of "
        f"{shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']}"
        + (" (Qwen3-30B-A3B's full width)" if shape == MOE_SHAPE else " (reduced)")
        + f", random weights (normal, std 0.02), {moe['dtype']} on {moe['device']}; "
        f"1 × {moe['tokens']} tokens a step, forward + backward (the input's gradient and the "
        f"adapters'); LoRA {moe['lora']} on every routed expert; {moe['warmup']} warm-up + "
        f"{moe['timed']} timed steps (median); the variants built and freed in turn in one "
        "process:",
        "",
        "| variant | tokens/s | step ms | peak MiB | note |",
        "|---|---:|---:|---:|---|",
    ]
    rows = {r["variant"]: r for r in moe["rows"]}
    for r in moe["rows"]:
        note = f"error: {r['error'][:120]}" if r.get("error") else r.get("note", "")
        if r.get("trainable"):
            note = f"{r['trainable']:,} trainable; {note}"
        lines.append(
            f"| {r['variant']} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_ms'), '.1f')} | {_f(r.get('peak_mib'), ',.0f')} | {note} |"
        )
    ratios = []
    for ours, theirs in (
        ("memtune", "peft-grouped_mm"),
        ("frozen-memtune", "frozen-grouped_mm"),
        ("memtune-nf4", "memtune"),
        ("memtune", "memtune-loop"),
    ):
        a, b = rows.get(ours, {}).get("tokens_per_s"), rows.get(theirs, {}).get("tokens_per_s")
        if a and b:
            ratios.append(f"{ours} / {theirs} {a / b:.2f}×")
    if ratios:
        lines += ["", "tokens/s: " + "; ".join(ratios) + "."]
    lines += [
        "",
        "*memtune*: rank.experts' forward, every expert on its routed rows in one grouped_mm "
        "a projection (adapters as x·Aᵀ·Bᵀ, grouped too; *memtune-loop*: the same as a Python "
        "loop over the experts); *peft-grouped_mm*: peft's `target_parameters` adapters "
        "(W + s·B·A built at every forward) over transformers' `grouped_mm` experts; "
        "*frozen-*: no adapters; *memtune-nf4 / -int8*: `quantize_experts` on the stacks, then "
        "memtune's adapters. *peak MiB*: `max_memory_allocated` over the steps less what was "
        "allocated before them (the block and the input): what the steps add.",
    ]
    return lines


def hybrid_markdown(recs: list[dict[str, Any]], mode: dict[str, Any]) -> list[str]:
    """The Qwen3.5 phases: one row each, then each one's packed = alone check."""
    if not recs:
        return []
    r0 = recs[0]
    samples = next((r["samples"] for r in recs if r.get("samples")), None)
    lines = [
        "",
        f"Qwen3.5 (hybrid: 3 of 4 layers Gated DeltaNet), `{r0['model']}` (random weights), "
        f"LoRA of `qwen3.5-9b-4x4090-lora` ({r0.get('lora', '?')}), "
        f"ZeRO-{r0.get('zero_stage', '?')} on one rank, loss {r0.get('loss_kind', '?')}, "
        f"attention {r0.get('attention', '?')}; one packed row of {r0['seq_len']} tokens a step"
        + (f" ({len(samples)} samples: {', '.join(map(str, samples))})" if samples else "")
        + f", cu_seq_lens as the loader gives them; {mode['warmup']} warm-up + {mode['timed']} "
        "timed steps (median); with flash-linear-attention the first step includes Triton "
        "compiling and autotuning what the packed = alone check before it did not run:",
        "",
        "| phase | recurrence / conv | tokens/s | step s | first step s | peak GiB | plan GiB "
        "| plan err | ckpt layers | packed = alone | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for r in recs:
        res = r.get("resolved")
        kernels = f"{short_kernel(res['recurrence'])} / {short_kernel(res['conv'])}" if res else "—"
        check = r.get("check") or {}
        ok = {True: "yes", False: "**NO**"}.get(check.get("ok"), "error" if check else "—")
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else r.get("error", "—")[:60]
        if r.get("skipped") and not r.get("resolved"):
            loss = r["skipped"][:80]
        lines.append(
            f"| {r['phase']} | {kernels} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_s_median'), '.3f')} | {_f(r.get('first_step_s'), '.2f')} "
            f"| {_f(r.get('measured_gib'), '.2f')} "
            f"| {_f((r.get('plan') or {}).get('live_gib'), '.2f')} "
            f"| {_pct(r.get('plan_error_pct'))} "
            f"| {_layers(r)} | {ok} | {loss} |"
        )
    lines.append("")
    for r in recs:
        packages = dict(r.get("packages") or {})
        fla = packages.pop("fla_import", "?")
        took = packages.pop("fla_import_s", None)
        have = ", ".join(f"{k} {v}" for k, v in packages.items() if v)
        ran = "; the torch path ran in its place" if r.get("skipped") and r.get("resolved") else ""
        lines.append(
            f"- {r['phase']}: {r.get('kernels', '—')} (import fla: {fla}"
            + (f" in {took:.1f} s" if took is not None else "")
            + (f"; {have}" if have else "")
            + f"{ran}). {_check_line(r.get('check') or {})}"
            + (
                " Seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()) + "."
                if r.get("seconds")
                else ""
            )
        )
    lines += [""]
    lines.append(
        "*plan GiB* for these rows: the planner's live rows, which measure the Gated DeltaNet "
        "mixer on transformers' torch code (memory.counts.linear_mixer_bytes), so the fla row "
        "shows how far its kernels are below that."
    )
    return lines


def _check_line(check: dict[str, Any]) -> str:
    if "max_loss_diff" not in check:
        return f"Packed = alone: {check.get('error', 'not run')[:200]}."
    lengths = ", ".join(map(str, check["lengths"]))
    return (
        f"Packed = alone over samples of {lengths} tokens ({check['dtype']}): max |Δ mean loss| "
        f"{check['max_loss_diff']:.4f} nats, max |Δ logit| {check['max_logit_diff']:.3f} "
        f"(tolerances {check['tolerance']['loss']}, {check['tolerance']['logit']}); the same "
        "row without its boundaries: "
        f"{check['no_bounds_max_loss_diff']:.4f} and {check['no_bounds_max_logit_diff']:.3f}"
        + ("" if check["control_sees_leak"] else " (a leak would not show on this model)")
        + "."
    )
