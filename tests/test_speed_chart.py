"""bench/speed_chart.py: the chart of the GPU check's four speed rows that README.md and
docs/speed.md show (issue #47), drawn from the committed results and kept in step with them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench import speed_chart
from tests.conftest import ROOT

H200 = ROOT / "bench" / "results" / "2026-12-04-h200.json"


def test_the_chart_draws_each_sides_measured_figures() -> None:
    results = json.loads(H200.read_text())
    data = speed_chart.figures(results)
    assert data["gpu"] == "H200" and data["cap_gib"] == pytest.approx(23.99)
    lora_2k = data["rows"][1]
    assert (lora_2k["method"], lora_2k["seq_len"]) == ("lora", 2048)
    # the figures docs/speed.md's table gives: 6,059 against 6,793 tokens/s, 19.88 GiB
    assert round(lora_2k["memtune"]["tokens_per_s"]) == 6059
    assert round(lora_2k["baseline"]["tokens_per_s"]) == 6793
    assert round(lora_2k["memtune"]["peak_gib"], 2) == 19.88
    assert lora_2k["unsloth"] == {
        "tokens_per_s": None,
        "peak_gib": None,
        "mfu": None,
        "card_gib": None,
        "fits": None,
        "capped": False,
    }
    # that run capped no side's allocator; the recipe's LoRA 4,096 row had 25.53 GiB of the
    # card in use at its peak: more than a 24 GB card has, which the chart marks
    lora_4k = data["rows"][0]
    assert round(lora_4k["baseline"]["card_gib"], 2) == 25.53
    assert lora_4k["baseline"]["fits"] is False and lora_4k["memtune"]["fits"] is True
    assert [row[side]["fits"] for row in data["rows"][1:] for side in ("memtune", "baseline")] == [
        True
    ] * 6
    assert not any(row[side]["capped"] for row in data["rows"] for side in ("memtune", "baseline"))
    assert speed_chart.title(data, ["memtune", "baseline"], "x.json") == (
        "Qwen2.5-7B on one H200 (x.json)\nmemtune planned for a 24 GB card, no side's memory capped"
    )
    assert speed_chart.complete(results)
    # a re-run of a few phases holds no comparison: never the chart's source
    rerun = json.loads((ROOT / "bench" / "results" / "2026-12-04-h200-rerun.json").read_text())
    assert not speed_chart.complete(rerun)


def test_the_committed_chart_is_drawn_from_the_newest_complete_results() -> None:
    """After a GPU check's results are committed, `python bench/speed_chart.py` draws the
    chart again; this fails until it has."""
    newest = speed_chart.newest_complete()
    drawn = speed_chart.described(speed_chart.CHART.read_text())
    expected = speed_chart.figures(json.loads(newest.read_text()))
    assert drawn == {"source": newest.relative_to(ROOT).as_posix(), **expected}
    for page in ("README.md", "docs/speed.md"):
        assert "img/speed-24gb.svg" in (ROOT / page).read_text(), page


def test_unsloth_gets_its_bars_where_it_ran(tmp_path: Path) -> None:
    """Results as the GPU check writes them now: memtune's and Unsloth's rows capped
    (``cap_gib``), the recipe's not; the title and the legend say so, and the recipe's row
    over the card is marked."""
    results = json.loads(H200.read_text())
    with_unsloth = copy.deepcopy(results)
    for rec in with_unsloth["records"]:
        if rec["side"] == "memtune":
            rec["cap_gib"] = 23.99
        if rec["side"] == "baseline":
            rec["cap_gib"] = None
    for rec in results["records"]:
        if rec["side"] == "baseline":
            with_unsloth["records"].append(
                {**rec, "side": "unsloth", "tokens_per_s": 2 * rec["tokens_per_s"]}
                | {"cap_gib": 23.99, "device_used_gib": 20.0}
            )
    (tmp_path / "2026-12-04-h200.json").write_text(json.dumps(results))
    (tmp_path / "2026-12-07-h100.json").write_text(json.dumps(results))
    path = tmp_path / "2026-12-07-h100-unsloth.json"  # the second call's, beside the first's
    path.write_text(json.dumps(with_unsloth))
    assert speed_chart.newest_complete(tmp_path) == path
    out = tmp_path / "chart.svg"
    assert speed_chart.main([str(path), "--out", str(out)]) == 0
    svg = out.read_text()
    drawn = speed_chart.described(svg)
    assert drawn["rows"][0]["unsloth"]["tokens_per_s"] == pytest.approx(2 * 7324.86438807584)
    assert ">Unsloth, capped<" in svg and ">memtune, capped<" in svg
    assert ">usual recipe (Trainer + peft), uncapped<" in svg
    assert ">memtune and Unsloth capped at a 24 GB card, the usual recipe uncapped<" in svg
    assert svg.count(">over 24 GB:<") == 1 and ">card 25.5 GiB<" in svg  # the recipe's LoRA 4k
    assert drawn["rows"][0]["baseline"]["fits"] is False
    assert "1.10×" in svg  # memtune against the recipe, on memtune's bar
    assert not list(tmp_path.glob("*.tmp"))


def test_results_without_all_four_rows_draw_nothing(tmp_path: Path) -> None:
    results = json.loads(H200.read_text())
    results["records"] = [r for r in results["records"] if r["side"] != "baseline"]
    path = tmp_path / "2026-12-07-h200.json"
    path.write_text(json.dumps(results))
    out = tmp_path / "chart.svg"
    assert speed_chart.main([str(path), "--out", str(out)]) == 2
    assert not out.exists()
    with pytest.raises(SystemExit, match=r"no GPU results in .* hold all four rows"):
        speed_chart.newest_complete(tmp_path)
