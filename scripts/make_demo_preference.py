"""Generate the small bundled demo preference dataset from the demo instruction set.

Each record of ``src/memtune/assets/demo_alpaca.jsonl`` becomes one pair: its own output is
``chosen``; ``rejected`` is the output of a record asked in the other language (Chinese ↔
English, told apart by CJK characters in the instruction), never the same text as
``chosen``. The preference to learn is then one a tiny random model can pick up in a few dozen
steps: answer in the language you were asked in (and with the answer to this question).

Generation is deterministic (``random.Random(0)``, records in file order), so re-running
reproduces a byte-identical file.

Usage:
    python3 scripts/make_demo_preference.py [OUTPUT_PATH]

OUTPUT_PATH defaults to ``src/memtune/assets/demo_preference.jsonl`` under the repo root.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = REPO_ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl"
DEFAULT_OUTPUT = REPO_ROOT / "src" / "memtune" / "assets" / "demo_preference.jsonl"

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
"""CJK Unified Ideographs (and extension A, compatibility): the demo's Chinese records."""


def is_chinese(text: str) -> bool:
    return CJK.search(text) is not None


def build(records: list[dict[str, str]], seed: int = 0) -> list[dict[str, str]]:
    """One pair per record, in the records' order."""
    rng = random.Random(seed)
    outputs = {
        lang: [r["output"] for r in records if is_chinese(r["instruction"]) == lang]
        for lang in (True, False)
    }
    pairs = []
    for r in records:
        chosen = r["output"]
        others = [o for o in outputs[not is_chinese(r["instruction"])] if o != chosen]
        prompt = f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"]
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rng.choice(others)})
    return pairs


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUTPUT
    with SOURCE.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    pairs = build(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for row in pairs:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(pairs)} pairs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
