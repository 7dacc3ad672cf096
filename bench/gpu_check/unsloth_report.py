"""The Unsloth phases in the results (``bench/gpu_check/unsloth.py``): what they hold,
Unsloth's rows beside the recipe's and memtune's (at 24 GB and at Unsloth's peak), and the
section of ``gpu_check.md``."""

from __future__ import annotations

from typing import Any


def collect_unsloth(frags: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the Unsloth phases hold (the model saved, each method's set-up or why it cannot
    run) and the comparison, row by row, with the recipe, memtune at 24 GB and at Unsloth's
    peak (None when no Unsloth phase ran)."""
    by_phase = {f["phase"]: f for f in frags}
    if not any(n in by_phase for n in ("unsloth-model", "unsloth-lora", "unsloth-qlora")):
        return {}
    return {
        "model": by_phase.get("unsloth-model", {}).get("unsloth_model"),
        "methods": {
            m: by_phase[f"unsloth-{m}"].get("unsloth", {})
            for m in ("lora", "qlora")
            if f"unsloth-{m}" in by_phase
        },
        "notes": [n for name, f in by_phase.items() if "unsloth" in name for n in f["notes"]],
        "comparison": compare_unsloth(records),
    }


def compare_unsloth(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["method"], r["seq_len"], r["side"]): r for r in records}
    rows = []
    for (method, seq_len, side), u in sorted(by.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if side != "unsloth":
            continue
        row: dict[str, Any] = {"method": method, "seq_len": seq_len, "unsloth": u}
        for key, other in (
            ("baseline", "baseline"),
            ("memtune", "memtune"),
            ("at_peak", "memtune-at-unsloth"),
        ):
            r = by.get((method, seq_len, other))
            if r is None:
                continue
            row[key] = r
            if r.get("tokens_per_s") and u.get("tokens_per_s"):
                row[f"{key}_speed"] = r["tokens_per_s"] / u["tokens_per_s"]
            if r.get("measured_gib") and u.get("measured_gib"):
                row[f"{key}_memory"] = r["measured_gib"] / u["measured_gib"]
        rows.append(row)
    return rows


def unsloth_markdown(u: dict[str, Any]) -> list[str]:
    """The Unsloth section: its set-up, the table beside memtune and the recipe, its errors."""
    from .report import OVER_CAP, _f

    if not u:
        return []
    lines = ["", "#### Unsloth beside memtune and the recipe", ""]
    model = u.get("model") or {}
    spec = model.get("spec") or {}
    if spec:
        s = spec["methods"]["lora"]
        lines.append(
            f"The same random-weight `{spec['model']}` saved with Qwen's tokenizer"
            + (f" ({model['gib']:.1f} GiB, {model['saved_s']} s)" if model.get("gib") else "")
            + f"; LoRA r={s['r']}, alpha {s['alpha']}, dropout {s['dropout']} on "
            f"{', '.join(s['targets'])}; AdamW lr {s['lr']}, clipping {s['max_grad_norm']}; "
            f"one row of random tokens a step, every token labelled; {spec['warmup']} warm-up + "
            f"{spec['timed']} timed steps; Unsloth and memtune with the allocator capped at the "
            f"{spec['cap_gib']} GiB card, the recipe uncapped. Unsloth: "
            "`FastLanguageModel.from_pretrained` offline (QLoRA: `load_in_4bit`), "
            '`get_peft_model(use_gradient_checkpointing="unsloth")`, a plain loop (forward with '
            "labels under bf16 autocast, backward, clipping, AdamW step)."
        )
    for method, m in (u.get("methods") or {}).items():
        setup = m.get("setup") or {}
        if setup:
            lines.append(
                f"- Unsloth {method}: unsloth {setup.get('unsloth')}, unsloth_zoo "
                f"{setup.get('unsloth_zoo')}, transformers {setup.get('transformers')}, trl "
                f"{setup.get('trl')}, peft {setup.get('peft')}, bitsandbytes "
                f"{setup.get('bitsandbytes')}, triton {setup.get('triton')}; attention "
                f"{setup.get('attention')} (flash-attn {setup.get('flash_attention')}, xformers "
                f"{setup.get('xformers')}); forward `{setup.get('causal_lm_forward')}`, MLP "
                f"`{setup.get('mlp_forward')}`, attention `{setup.get('attention_forward')}`; "
                f"{setup.get('trainable', 0):,} trainable ({setup.get('trainable_dtype')}); "
                + (f"4-bit {setup['quantization']}; " if setup.get("quantization") else "")
                + f"checkpointing {setup.get('gradient_checkpointing')}; "
                f"import {m.get('import_s', '—')} s, load {m.get('load_s', '—')} s."
            )
        bad = m.get("cannot_run")
        if bad:
            lines.append(
                f"- Unsloth {method} **cannot run** ({bad['where']}): `{bad['type']}: "
                f"{bad['message'][:600]}`; last frames: {' ← '.join(reversed(bad['frames']))}"
            )
    lines += [
        "",
        "| method | tokens | recipe tok/s (uncapped) | memtune tok/s (24 GB plan, capped) "
        "| Unsloth tok/s (capped) "
        "| memtune / Unsloth | Unsloth peak GiB (card) | memtune at Unsloth's card: tok/s "
        "| its peak GiB (card) | at-peak / Unsloth tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in u.get("comparison") or []:
        un, at = row["unsloth"], row.get("at_peak") or {}

        def tps(r: dict[str, Any] | None) -> str:
            return _f((r or {}).get("tokens_per_s"), ",.0f")

        def recipe(r: dict[str, Any] | None) -> str:
            over = (r or {}).get("fits_cap") is False
            return tps(r) + (f" (**{OVER_CAP}**: {r['device_used_gib']:.2f} GiB)" if over else "")

        def peak(r: dict[str, Any]) -> str:
            if r.get("error") and not r.get("measured_gib"):
                return "error"
            return f"{_f(r.get('measured_gib'), '.2f')} ({_f(r.get('device_used_gib'), '.2f')})"

        lines.append(
            f"| {row['method']} | {row['seq_len']} | {recipe(row.get('baseline'))} "
            f"| {tps(row.get('memtune'))} | {tps(un) if not un.get('error') else 'error'} "
            f"| {_f(row.get('memtune_speed'), '.2f')}× | {peak(un)} | {tps(at)} "
            f"| {peak(at) if at else '—'} | {_f(row.get('at_peak_speed'), '.2f')}× |"
        )
    lines += [
        "",
        "*peak GiB*: `max_memory_allocated` less what was allocated before the model; *(card)*: "
        "what the card had in use at the peak (peak reserved + the CUDA context): memtune at "
        "Unsloth's card is planned with `plan.device_gib` = Unsloth's *(card)* figure and its "
        "allocator capped there. Unsloth's and memtune's rows run with the allocator capped "
        "(`measure.cap_allocator`: the card less what lies outside the allocator); the "
        f"recipe's uncapped, so that its speed is measured at all, marked *{OVER_CAP}* where "
        "its card use at the peak was over the 24 GB card. Unsloth's rows run in their own "
        "environment (transformers 5.17, the image's), memtune's in the main check's.",
    ]
    return lines
