"""Merge, generation and evaluation on top of real trained adapters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from memtune.data.batching import collate_padded
from memtune.data.cache import load_split
from memtune.memory.counts import count_params
from memtune.rank.loss import token_loss_sum
from memtune.tools.generate import answer, load, prompt_text, stop_token_ids
from memtune.tools.merge import merge
from tests.conftest import FAST, Run, _finished, start_run
from tests.test_stores import left_by_killed_writer

pytestmark = pytest.mark.slow


def test_merged_model_matches_base_plus_adapter(
    zero3_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A merge into the same OUT that was killed (kill -9) while writing: its whole model stayed
    # behind a dot, one per kill, until this merge removed it.
    left = left_by_killed_writer(tmp_path, ".merged.tmp-", "model.safetensors")
    out, merged, a, b = _merged_vs_adapter(zero3_run, tmp_path)
    assert not left.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    assert (
        f"memtune: removed {left} (3.0 MiB): a merge into merged that process "
        f"{left.name.split('-')[-2]} left unfinished when it was killed\n"
    ) in capsys.readouterr().out
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    # fp32: merging folds B·A·scale into W, one extra rounding per weight; the two forwards
    # also sum in other orders (1.4e-5 on one logit of 18,432 with one thread a process); a
    # merge without the scaling is off by ~1e-1.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5)
    assert (out / "tokenizer.json").is_file()


def _merged_vs_adapter(run: Run, tmp_path: Path):
    """(merged dir, merged model, its logits, base + adapter logits) on the run's probe batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = merge(run.dir / "adapter", tmp_path / "merged", dtype="fp32")
    merged = AutoModelForCausalLM.from_pretrained(out)  # a plain model: no peft involved
    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.name_or_path)
    with_adapter = PeftModel.from_pretrained(base, run.dir / "adapter").eval()
    probe = torch.load(run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        a = merged(input_ids=probe["input_ids"]).logits
        b = with_adapter(input_ids=probe["input_ids"]).logits
    return out, merged, a, b


def test_generation_uses_the_training_prompt_and_stops(zero3_run) -> None:
    model, tokenizer = load(zero3_run.dir)
    stops = stop_token_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    assert tokenizer.eos_token_id in stops
    text, ids = answer(model, tokenizer, zero3_run.dir, "What is 2 + 3?", max_new_tokens=40)
    # The training prompt (the demo's ChatML, no system prompt), then the model's own greedy
    # tokens up to and including the first stop token. "Ended on a stop token or ran out of
    # room" alone passed with the stop tokens not given to generate (40 ids: the answer, then
    # eos over and over) and with the prompt not rendered at all.
    prompt = prompt_text(zero3_run.dir, "What is 2 + 3?", tokenizer)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    want = greedy(model, tokenizer, prompt, 40)
    assert want[-1] in stops, want  # the demo's adapter answers in a few tokens and stops
    assert ids == want
    assert text == tokenizer.decode(want[:-1]) and "<|im_end|>" not in text


def greedy(model, tokenizer, prompt: str, limit: int) -> list[int]:
    """The model's greedy tokens after ``prompt``, each from a whole forward of everything so
    far (no cache), up to and including the first stop token, or ``limit`` of them."""
    stops = stop_token_ids(tokenizer)
    seq, out = tokenizer.encode(prompt, add_special_tokens=False), []
    with torch.no_grad():
        while len(out) < limit and not (out and out[-1] in stops):
            out.append(int(model(input_ids=torch.tensor([seq + out])).logits[0, -1].argmax()))
    return out


def test_eval_loss_is_the_validation_loss_of_the_saved_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtune.config import ASSETS_DIR

    # 7 validation records over 2 ranks: one shard is padded with a label-free sample.
    val = tmp_path / "val.jsonl"
    val.write_text("".join((ASSETS_DIR / "demo_alpaca.jsonl").read_text().splitlines(True)[:7]))
    overrides = [
        *FAST,
        "launcher.num_ranks=2",
        "trainer.max_steps=8",
        "trainer.eval_every=4",
        f"data.val_path={val}",
    ]
    run = start_run(tmp_path / "run", overrides, probe=False)
    assert run.code == 0
    evals = [m for m in run.metrics() if "eval/loss" in m]
    assert [m["step"] for m in evals] == [4, 8]
    assert evals[1]["eval/ppl"] == pytest.approx(math.exp(evals[1]["eval/loss"]))
    assert run.summary()["eval_loss"] == evals[1]["eval/loss"]
    # Evaluation does not raise any rank's memory peak above its training peak.
    for row in evals:
        assert set(row["eval/memory"]) == {"rank0", "rank1"}
        for m in row["eval/memory"].values():
            assert 0 < m["eval_peak_gib"] <= m["train_peak_gib"] * 1.01, m

    data = json.loads((run.dir / "data.json").read_text())
    assert data["val"]["samples"] == 7
    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.name_or_path)
    model = PeftModel.from_pretrained(base, run.dir / "adapter").eval()
    tokenizer_pad = model.config.pad_token_id
    split = load_split(data["dir"], "val")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(split)):
            batch = collate_padded([split[i]], tokenizer_pad)
            logits = model(input_ids=batch["input_ids"]).logits
            total += float(token_loss_sum(logits, batch["labels"]))
            count += int((batch["labels"][:, 1:] != -100).sum())
    assert evals[1]["eval/loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.fixture(scope="module")
def qwen3_run(runs_root: Path) -> Run:
    """The tiny Qwen3 (explicit head_dim, q/k norms, tied embeddings) with Qwen3's template,
    2 ranks under ZeRO-3, long enough to learn."""
    return _finished(
        runs_root,
        "qwen3",
        "model=tiny-qwen3",
        "data.template=qwen3",
        "zero=zero3",
        "launcher.num_ranks=2",
        # the last loss 0.52 of the first (0.38 at 30 steps; 0.6 asked below), and a learning
        # rate a fifth of the right one fails it (at 30 steps it passed)
        "trainer.max_steps=20",
    )


def test_tiny_qwen3_trains_merges_and_generates(qwen3_run: Run, tmp_path: Path) -> None:
    losses = qwen3_run.losses()
    assert losses[-1] < 0.6 * losses[0], losses
    summary = qwen3_run.summary()
    assert summary["trainable_params"] == count_params(qwen3_run.cfg).lora
    _, merged, a, b = _merged_vs_adapter(qwen3_run, tmp_path)
    assert type(merged).__name__ == "Qwen3ForCausalLM"
    torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5)  # as above: merged vs unmerged

    model, tokenizer = load(qwen3_run.dir)
    prompt = prompt_text(qwen3_run.dir, "What is 2 + 3?", tokenizer)
    # Thinking off, as trained: the prompt ends in the empty think block, one token each tag.
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert len(tokenizer.encode("<think></think>", add_special_tokens=False)) == 2
    text, ids = answer(model, tokenizer, qwen3_run.dir, "What is 2 + 3?", max_new_tokens=40)
    assert ids == greedy(model, tokenizer, prompt, 40)  # that prompt, then its greedy tokens
    assert "<think>" not in text
