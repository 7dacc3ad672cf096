"""The chunked loss equals plain cross-entropy (value and gradients) and needs less memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from memtune.config import to_run_config
from memtune.data.encode import IGNORE_INDEX
from memtune.rank.loss import CausalLMLoss, chunked_loss_sum, token_loss_sum
from memtune.rank.model import add_lora, load_base_model
from memtune.tools.tiny import synthesize
from tests.conftest import FAST, Run, compose_cfg, decided, start_run


def _labels(B: int, T: int, V: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, : T // 2] = IGNORE_INDEX  # a prompt
    y[1, :] = IGNORE_INDEX  # a sample with nothing to learn
    y[2, 5:9] = IGNORE_INDEX
    return y


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_value_and_hidden_gradient_equal_plain_cross_entropy(chunk: int) -> None:
    torch.manual_seed(0)
    B, T, H, V = 3, 29, 16, 257
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H)
    labels = _labels(B, T, V)
    plain = token_loss_sum(hidden @ weight.T, labels)
    (g_plain,) = torch.autograd.grad(plain * 0.37, hidden)
    chunked = chunked_loss_sum(hidden, weight, labels, chunk)
    (g_chunked,) = torch.autograd.grad(chunked * 0.37, hidden)
    assert plain.item() > 0
    # Plain cross-entropy as written down: position t predicts label t + 1. (token_loss_sum and
    # the chunked loss share next_token_targets: with it shifting by 2, position t predicting
    # label t + 2, both agreed and this test passed.)
    logits = (hidden @ weight.T)[:, :-1].reshape(-1, V)
    textbook = torch.nn.functional.cross_entropy(
        logits, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    torch.testing.assert_close(plain, textbook, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_chunked, g_plain, rtol=1e-5, atol=1e-5)
    # Masked positions get exactly no gradient.
    assert torch.all(g_chunked[1] == 0) and torch.all(g_chunked[:, -1] == 0)


def test_no_label_at_all_gives_zero_loss_and_zero_gradient() -> None:
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    loss = chunked_loss_sum(hidden, torch.randn(11, 8), torch.full((2, 5), IGNORE_INDEX), 4)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and torch.all(hidden.grad == 0)


@pytest.fixture(scope="module")
def lora_model():
    overrides = ["trainer.precision=fp32", "peft=lora-all-linear", "peft.dropout=0"]
    cfg = to_run_config(compose_cfg(overrides))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    torch.manual_seed(0)
    d = decided(cfg, attention="sdpa")
    model = add_lora(load_base_model(cfg, d), cfg, d)
    for name, p in model.named_parameters():  # non-zero B so every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return cfg, model


def _loss_and_grads(model, kind: str, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = CausalLMLoss(model, kind, chunk_tokens=5)(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def test_lora_gradients_equal_plain_through_the_real_model(lora_model) -> None:
    cfg, model = lora_model
    V = cfg.model.architecture["vocab_size"]
    ids = torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 18:] = 0
    labels = _labels(3, 24, V, seed=2)
    labels[2, 18:] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    plain, g_plain = _loss_and_grads(model, "plain", batch)
    chunked, g_chunked = _loss_and_grads(model, "chunked", batch)
    assert len(g_plain) == 2 * 7 * cfg.model.architecture["num_hidden_layers"]
    assert plain == pytest.approx(chunked, rel=1e-5)
    for name, g in g_plain.items():
        assert g.abs().max() > 0, name
        # fp32 sums in a different order: equal to 1e-5 of the gradient's scale.
        scale = float(g.abs().max())
        torch.testing.assert_close(g_chunked[name], g, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_a_trainable_head_is_refused(lora_model) -> None:
    _, model = lora_model
    head = model.get_base_model().get_output_embeddings()
    head.weight.requires_grad_(True)
    try:
        with pytest.raises(ValueError, match="frozen"):
            CausalLMLoss(model, "chunked")(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))
    finally:
        head.weight.requires_grad_(False)


PEAK_SCRIPT = """
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from memtune.rank.loss import CausalLMLoss
from memtune.rank.telemetry import reset_window_peak, window_peak_gib

class Frozen(torch.nn.Module):  # what get_base_model() returns under PEFT
    def __init__(self, m): super().__init__(); self.m = m
    def get_base_model(self): return self.m
    def forward(self, **kw): return self.m(**kw)

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
model = Qwen2ForCausalLM(cfg)
model.lm_head.weight.requires_grad_(False)
loss_fn = CausalLMLoss(Frozen(model), sys.argv[1], chunk_tokens=256)
ids = torch.randint(0, 32000, (4, 1024))
loss_fn(input_ids=ids, labels=ids).backward()  # warm-up: allocator pools, lazy inits
device = torch.device("cpu")
reset_window_peak(device)
before = window_peak_gib(device)
loss_fn(input_ids=ids, labels=ids).backward()
print(json.dumps({"delta_gib": window_peak_gib(device) - before}))
"""


def _peak_delta(kind: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, kind], capture_output=True, text=True, check=True
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["delta_gib"])


def test_measured_peak_memory_falls_with_the_chunked_loss() -> None:
    # 4 × 1024 tokens × 32,000 vocabulary: 0.49 GiB of fp32 logits in the plain loss.
    logits_gib = 4 * 1024 * 32000 * 4 / 1024**3
    plain, chunked = _peak_delta("plain"), _peak_delta("chunked")
    assert plain > logits_gib, (plain, chunked)  # the plain loss holds at least the logits
    assert chunked < plain - logits_gib, (plain, chunked)


def test_chunked_under_zero3_equals_plain(zero3_run: Run, runs_root) -> None:
    """zero3_run uses 16-token chunks, so ranks with different label counts run different
    chunk counts while the head is gathered once: a mismatch would deadlock, not differ."""
    assert zero3_run.cfg.trainer.loss_chunk_tokens == 16
    plain = start_run(
        runs_root / "zero3_plain_loss",
        [*FAST, "zero=zero3", "launcher.num_ranks=2", "trainer.loss=plain"],
        probe=False,
    )
    assert plain.code == 0
    assert zero3_run.losses() == pytest.approx(plain.losses(), rel=1e-5)
    assert len(plain.losses()) == 12
