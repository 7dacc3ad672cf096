"""The chart of the GPU check's four speed rows (issue #47): LoRA and QLoRA at 4,096 and 2,048
tokens, memtune beside the usual recipe (and Unsloth where it ran), tokens/s and peak memory.
The GPU check runs memtune's and Unsloth's rows with the allocator capped at a 24 GB card and
the recipe's uncapped (results before that, 2026-12-04's, ran no side capped): the title and
the legend say which ran capped, as the records do, and a bar whose card use at its peak was
over the card is marked.

    .venv/bin/python bench/speed_chart.py                       # the newest complete results
    .venv/bin/python bench/speed_chart.py bench/results/2026-12-04-h200.json

Reads a GPU check's results JSON (``bench/results/<date>-<gpu>.json``: its ``records``, one per
side, method and length) and writes ``docs/img/speed-24gb.svg``, which README.md and
docs/speed.md show beside their tables. Run it when a GPU check's results are committed. The
figures drawn are written into the SVG's description as JSON, so tests/test_speed_chart.py
holds the committed chart to the newest results without comparing drawings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CHART = ROOT / "docs" / "img" / "speed-24gb.svg"

ROWS = (("lora", 4096), ("lora", 2048), ("qlora", 4096), ("qlora", 2048))
SIDES = (  # (record side, legend label, colour)
    ("memtune", "memtune", "#3f51b5"),
    ("baseline", "usual recipe (Trainer + peft)", "#9e9e9e"),
    ("unsloth", "Unsloth", "#4caf50"),
)
GPU_RESULTS = re.compile(r"^\d{4}-\d{2}-\d{2}-(h100|h200)[\w-]*\.json$")


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """What the chart draws: per row and side, tokens/s, measured peak (GiB) and MFU, None where
    that side did not run or failed; what the card had in use at the peak (``card_gib``) and
    whether that fits the 24 GB card (``fits``); whether the row ran with the allocator
    capped (``capped``: memtune's and Unsloth's rows since the cap was made like for like; the
    recipe's never, and no side's in results before that, 2026-12-04's included); and the 24 GB
    card's GiB (``cap_gib``), the cap of the sides that ran capped."""
    by = {(r.get("side"), r.get("method"), r.get("seq_len")): r for r in results["records"]}
    cap = results.get("constants", {}).get("cap_gib")
    rows = []
    for method, seq_len in ROWS:
        row: dict[str, Any] = {"method": method, "seq_len": seq_len}
        for side, _, _ in SIDES:
            rec = by.get((side, method, seq_len)) or {}
            used = rec.get("device_used_gib")
            row[side] = {
                "tokens_per_s": rec.get("tokens_per_s"),
                "peak_gib": rec.get("measured_gib"),
                "mfu": rec.get("mfu"),
                "card_gib": used,
                # the gpu check's rule (measure.add_fits_card), for results written before it
                "fits": None if used is None or cap is None else used <= cap,
                "capped": rec.get("cap_gib") is not None,
            }
        rows.append(row)
    return {"gpu": _gpu(results), "cap_gib": cap, "rows": rows}


def complete(results: dict[str, Any]) -> bool:
    """Whether memtune and the recipe both measured tokens/s in all four rows."""
    rows = figures(results)["rows"]
    return all(row[side]["tokens_per_s"] for row in rows for side in ("memtune", "baseline"))


def newest_complete(folder: Path = RESULTS) -> Path:
    """The newest GPU results file with all four rows on both sides (a re-run of a few phases
    is not a chart); of one date's, the one with the most sides (Unsloth's call, kept beside
    the comparison's, holds all three)."""

    def sides(results: dict[str, Any]) -> int:
        rows = figures(results)["rows"]
        return sum(all(row[side]["tokens_per_s"] for row in rows) for side, _, _ in SIDES)

    found = []
    for path in (p for p in folder.iterdir() if GPU_RESULTS.match(p.name)):
        results = json.loads(path.read_text())
        if "records" in results and complete(results):
            found.append((path.name[:10], sides(results), path))
    if not found:
        raise SystemExit(f"speed_chart: no GPU results in {folder} hold all four rows")
    return max(found)[2]


def _gpu(results: dict[str, Any]) -> str:
    env = results.get("env", {})
    return str(env.get("gpu") or "GPU").removeprefix("NVIDIA ")


def _label(method: str, seq_len: int) -> str:
    return f"{'LoRA' if method == 'lora' else 'QLoRA'}\n{seq_len:,} tokens"


NAMES = {"memtune": "memtune", "baseline": "the usual recipe", "unsloth": "Unsloth"}


def _capped(data: dict[str, Any], side: str) -> bool:
    """Whether every row of ``side`` that ran, ran with the allocator capped."""
    ran = [row[side] for row in data["rows"] if row[side]["tokens_per_s"]]
    return bool(ran) and all(r["capped"] for r in ran)


def title(data: dict[str, Any], sides: list[str], source: str) -> str:
    """What ran capped and what did not, as the figures say."""
    capped = [NAMES[s] for s in sides if _capped(data, s)]
    uncapped = [NAMES[s] for s in sides if not _capped(data, s)]
    if not capped:
        how = "memtune planned for a 24 GB card, no side's memory capped"
    else:
        how = f"{' and '.join(capped)} capped at a 24 GB card" + (
            f", {' and '.join(uncapped)} uncapped" if uncapped else ""
        )
    return f"Qwen2.5-7B on one {data['gpu']} ({source})\n{how}"


def draw(data: dict[str, Any], source: str, path: Path) -> None:
    """Two panels: tokens/s (memtune's bar says × the recipe and its MFU) and peak allocated
    memory beside the 24 GB card's line, a bar whose card use at its peak was over the card
    marked so; the title and the legend say which sides ran with the allocator capped.
    Deterministic SVG (no date, fixed hash salt), its figures in the description."""
    import matplotlib

    from memtune.filesystem import follow_umask

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "memtune"
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, 25 kB not 64
    sides = [s for s in SIDES if any(row[s[0]]["tokens_per_s"] for row in data["rows"])]
    width = 0.8 / len(sides)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for i, (side, label, colour) in enumerate(sides):
        xs = [k + (i - (len(sides) - 1) / 2) * width for k in range(len(data["rows"]))]
        rate = [row[side]["tokens_per_s"] or 0 for row in data["rows"]]
        peak = [row[side]["peak_gib"] or 0 for row in data["rows"]]
        label += ", capped" if _capped(data, side) else ", uncapped"
        speed.bar(xs, rate, width, label=label, color=colour)
        memory.bar(xs, peak, width, label=label, color=colour)
        for x, row in zip(xs, data["rows"], strict=True):
            if row[side]["fits"] is False:  # its card use at the peak was over the card
                memory.annotate(  # above the card's line, which the bar (allocated) may be under
                    f"over 24 GB:\ncard {row[side]['card_gib']:.1f} GiB",
                    (x, max(row[side]["peak_gib"] or 0, data["cap_gib"])),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#c62828",
                )
        if side != "memtune":
            continue
        for x, row in zip(xs, data["rows"], strict=True):
            ours, theirs = row["memtune"]["tokens_per_s"], row["baseline"]["tokens_per_s"]
            if ours and theirs:
                note = f"{ours / theirs:.2f}×"
                if row["memtune"]["mfu"]:
                    note += f"\nMFU {row['memtune']['mfu']:.0%}"
                speed.annotate(note, (x, ours), ha="center", va="bottom", fontsize=8)
    ticks = range(len(data["rows"]))
    names = [_label(row["method"], row["seq_len"]) for row in data["rows"]]
    for ax in (speed, memory):
        ax.set_xticks(list(ticks), names, fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    speed.set_ylabel("tokens/s (one rank)")
    speed.set_ylim(
        0, 1.25 * max(row[s[0]]["tokens_per_s"] or 0 for row in data["rows"] for s in sides)
    )
    memory.set_ylabel("peak allocated (GiB)")
    if data["cap_gib"]:
        memory.axhline(data["cap_gib"], color="#c62828", linewidth=1, linestyle="--")
        memory.annotate(
            f"24 GB card: {data['cap_gib']:g} GiB",
            (len(data["rows"]) - 0.5, data["cap_gib"]),
            ha="right",
            va="bottom",
            fontsize=8,
            color="#c62828",
        )
        memory.set_ylim(0, 1.25 * data["cap_gib"])
    fig.suptitle(title(data, [s[0] for s in sides], source), fontsize=10)
    handles, labels = speed.get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=len(sides),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.89),
    )
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own beside the chart (two runs never share one), renamed into place
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    description = json.dumps({"source": source, **data}, sort_keys=True)
    try:
        fig.savefig(tmp, format="svg", metadata={"Date": None, "Description": description})
        follow_umask(tmp)  # mkstemp's 0600 is not a chart's mode
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def described(svg: str) -> dict[str, Any]:
    """The figures a chart was drawn from (its SVG description)."""
    import html

    found = re.search(r"<dc:description>(.*?)</dc:description>", svg, re.S)
    if found is None:
        raise ValueError("the chart has no description")
    result: dict[str, Any] = json.loads(html.unescape(found.group(1)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", type=Path, help="a GPU check's results JSON")
    parser.add_argument("--out", type=Path, default=CHART)
    args = parser.parse_args(argv)
    path = args.results or newest_complete()
    results = json.loads(path.read_text())
    if not complete(results):
        print(
            f"speed_chart: {path} lacks memtune's or the recipe's tokens/s in a row",
            file=sys.stderr,
        )
        return 2
    path = path.resolve()
    source = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    draw(figures(results), source, args.out)
    print(f"speed_chart: {args.out} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
