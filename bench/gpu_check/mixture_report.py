"""The whole-mixture phases in the outputs (mixture.py, mixture_load.py): collected from the
fragments, rendered as markdown, and filled with made-up GPU readings for the dry run's format
check."""

from __future__ import annotations

from typing import Any

from .measure import add_mfu, add_plan_error


def collect_mixture(frags: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{"runs": [each whole-model phase's record], "load": the loader's}``; None without
    either."""
    runs = [f["mixture"] for f in frags if f.get("mixture")]
    load = next((f["mixture_load"] for f in frags if f.get("mixture_load")), None)
    if not runs and load is None:
        return None
    return {"runs": runs, "load": load}


def fake_readings(mixture: dict[str, Any] | None) -> None:
    """The dry run's format check: the readings only a CUDA device gives, made up, so the
    accounting and the tables' GPU branches run here."""
    from types import SimpleNamespace

    if not mixture:
        return
    gpu = SimpleNamespace(type="cuda")
    for run in mixture["runs"]:
        if "build" in run:
            run["build"].update(peak_allocated_gib=17.5, peak_reserved_gib=18.0)
        for i, r in enumerate(run["rows"]):
            if "plan" not in r:
                continue
            r.update(peak_allocated_gib=20.0 + i, peak_reserved_gib=21.0 + i)
            r.update(outside_allocator_gib=0.6, leftover_gib=0.0)
            add_mfu(r, {"lora": 1e14, "six_n": 1.5e14}, gpu)
            add_plan_error(r)
            assert "plan_error_pct" in r and r["mfu"] > 0, r
        if run["rows"]:  # a longer row out of memory where the plan said it would not fit
            made_up = "OutOfMemoryError('made up (format check)')"
            run["rows"].append({"seq_len": 8192, "error": made_up, "oom": True, "as_planned": True})
    load = mixture["load"]
    if load and "load" in load:
        load["load"].update(device_peak_gib=5.0, device_kept_gib=4.5)
        from .mixture_load import compare_to_plan

        compare_to_plan(load)
        assert "device_error_pct" in load["load"], load


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _pct(x: Any) -> str:
    return "—" if x is None else f"{x:+.1f}%"


def mixture_markdown(mixture: dict[str, Any] | None) -> list[str]:
    """The candidates the planner weighed, the pick and why, each measured run's rows; then
    the loader's peaks against the plan."""
    if not mixture:
        return []
    lines: list[str] = []
    for run in mixture["runs"]:
        lines += _run_markdown(run)
    lines += _load_markdown(mixture["load"])
    return lines


def _run_markdown(run: dict[str, Any]) -> list[str]:
    first = run["candidates"][0]
    lines = [
        "",
        f"#### A whole mixture on one card ({run['phase']})",
        "",
        f"`{run['model']}` (random weights), QLoRA (NF4 base: linear layers by bitsandbytes, "
        "expert stacks by memtune), one rank, ZeRO-2, micro batch 1, under a 23.99 GiB cap; "
        "built on the meta device and quantized a layer at a time. The planner's candidates at "
        f"{first['seq_len']:,} tokens (checkpointed layers as a launch decides them; plan "
        f"computed in {run['planning_s']:.1f} s):",
        "",
        "| candidate | planned GiB | fits | 2 GiB spare | ckpt layers | optimizer state GiB "
        "| trainable | change |",
        "|---|---:|:---:|:---:|---:|---:|---:|---|",
    ]
    for c in run["candidates"]:
        mark = " ←" if c["label"] == run.get("measured") else ""
        lines.append(
            f"| {c['label']}{mark} | {c['total_gib']:.2f} | {'yes' if c['fits'] else 'no'} "
            f"| {'yes' if c['fits_with_spare'] else 'no'} | {c['checkpointed_layers']} "
            f"| {_f(c['rows'].get('optimizer state'), '.2f')} | {c['trainable']:,} "
            f"| {' '.join(c['overrides']) or '—'} |"
        )
    lines += ["", f"The planner's pick: **{run['pick']}** ({run['why']})."]
    if run.get("skipped"):
        lines += [f"Not measured here: {run['skipped']}."]
        return lines
    b = run.get("build") or {}
    if b:
        parts = ", ".join(f"{k} {v:,}" for k, v in (b.get("trainable_by_part") or {}).items())
        lines += [
            "",
            f"Measured: {run.get('measured')}. Built in {_f(b.get('rank_s'), '.1f')} s (the "
            f"base {_f(b.get('base_s'), '.1f')} s, {b.get('stacks_quantized', '?')} expert "
            f"stacks quantized; peak while building {_f(b.get('peak_allocated_gib'), '.2f')} "
            f"GiB on the device, {_f(b.get('host_anon_peak_gib'), '.2f')} GiB more on the "
            f"host); {b.get('trainable', 0):,} trainable ({parts}); {b.get('optimizer', '')}; "
            f"attention {b.get('attention')}, loss {b.get('loss_kind')}; {run['warmup']} "
            f"warm-up + {run['timed']} timed steps (median):",
            "",
            "| tokens | tokens/s | step s | peak GiB | reserved GiB | plan GiB | plan err "
            "| plan total GiB | total err | MFU | ckpt layers | loss |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
    for r in run["rows"]:
        plan = r.get("plan") or {}
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else (r.get("error") or "—")[:80]
        if r.get("as_planned"):
            loss = "out of memory, as the plan said (does not fit)"
        lines.append(
            f"| {r['seq_len']} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('step_s_median'), '.3f')} | {_f(r.get('measured_gib'), '.2f')} "
            f"| {_f(r.get('peak_reserved_gib'), '.2f')} | {_f(plan.get('live_gib'), '.2f')} "
            f"| {_pct(r.get('plan_error_pct'))} | {_f(plan.get('total_gib'), '.2f')} "
            f"| {_pct(r.get('plan_total_error_pct'))} | {_f(r.get('mfu'), '.1%')} "
            f"| {_f(r.get('checkpointed_layers'), 'd')} | {loss} |"
        )
    return lines


def _load_markdown(load: dict[str, Any] | None) -> list[str]:
    if not load:
        return []
    lines = [
        "",
        "#### The streaming loader's peak (mixture-load)",
        "",
        f"`{load['model']}` shortened to {load['layers']} layers, random weights written in "
        "the released layout (each expert's gate / up / down apart, a shard a layer), then read "
        "by `rank.model.load_base_model` for QLoRA (each expert stack quantized as it is read).",
    ]
    if load.get("skipped"):
        return [*lines, f"Not run: {load['skipped']}."]
    w, ld, plan = load.get("write") or {}, load.get("load") or {}, load.get("plan") or {}
    check = load.get("check") or {}
    if w:
        lines.append(
            f"Written: {w['gb']:.2f} GB in {w['shards']} shards, {w['tensors']:,} tensors, "
            f"{w['write_s']:.1f} s ({w['write_gb_s']:.2f} GB/s); read back from the page cache."
        )
    if ld:
        lines += [
            "",
            "| loading | measured GiB | planned GiB | plan err |",
            "|---|---:|---:|---:|",
            f"| device peak | {_f(ld.get('device_peak_gib'), '.2f')} "
            f"| {_f(plan.get('device_gib'), '.2f')} | {_pct(ld.get('device_error_pct'))} |",
            f"| host peak (RssAnon) | {_f(ld.get('host_anon_peak_gib'), '.2f')} "
            f"| {_f(plan.get('host_gib'), '.2f')} | {_pct(ld.get('host_error_pct'))} |",
            f"| checkpoint pages mapped (RssFile; not planned) "
            f"| {_f(ld.get('host_file_peak_gib'), '.2f')} | — | — |",
            f"| kept on the device after loading | {_f(ld.get('device_kept_gib'), '.2f')} "
            f"| {_f(plan.get('base_weights_gib'), '.2f')} (base weights) | — |",
            "",
            f"Loaded in {_f(ld.get('load_s'), '.1f')} s; host sampled "
            f"{ld.get('host_samples', 0):,} times. Plan: {plan.get('how')}. Layout check: "
            f"router {'as written' if check.get('router_equal') else '**NOT as written**'}, "
            f"layer 0's gate_up stack "
            f"{'byte for byte' if check.get('gate_up_equal') else '**NOT**'} the written experts "
            f"merged and quantized; {check.get('stacks_quantized', '?')} stacks quantized.",
        ]
    return lines
