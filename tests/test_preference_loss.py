"""The preference objectives on the tiny model, in one process: memtune's packed, chunked pair
loss against a direct computation with plain transformers + peft (each sequence alone, full
logits, log-softmax, the published formulas written out here), gradients included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from memtune.data.batching import collate_packed
from memtune.data.encode import IGNORE_INDEX, Sample
from memtune.rank.preference import PreferenceLoss
from tests.test_long_context import _model

BETA = 0.3


def _pairs(vocab: int) -> list[Sample]:
    """Three pairs of random tokens: a prompt (no labels), then a reply (labels)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k, (prompt, chosen, rejected) in enumerate([(9, 7, 12), (5, 16, 4), (14, 3, 9)]):
        p = torch.randint(5, vocab, (prompt,), generator=g).tolist()
        c = torch.randint(5, vocab, (chosen,), generator=g).tolist()
        r = torch.randint(5, vocab, (rejected,), generator=g).tolist()
        ids = p + c + p + r
        labels = [IGNORE_INDEX] * prompt + c + [IGNORE_INDEX] * prompt + r
        out.append(Sample(ids, labels, split=prompt + chosen, index=10 + k))
    return out


def _batch(pairs: list[Sample]) -> dict[str, torch.Tensor]:
    """The first two pairs in one packed row, the third in a second row."""
    batch = collate_packed([pairs[:2], pairs[2:]], pad_token_id=0)
    return {k: v for k, v in batch.items() if k != "real_tokens"}


def _direct_logps(model, pairs: list[Sample], adapter: bool = True) -> torch.Tensor:
    """[pairs, 2] summed log-probabilities of each reply, every sequence run alone."""
    rows = []
    for s in pairs:
        row = []
        for a, b in ((0, s.split), (s.split, len(s.input_ids))):
            ids = torch.tensor([s.input_ids[a:b]])
            labels = torch.tensor(s.labels[a:b])
            if adapter:
                logits = model(input_ids=ids).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0]
            logp = logits[:-1].float().log_softmax(-1)
            y = labels[1:]
            keep = y != IGNORE_INDEX
            row.append(logp[keep].gather(1, y[keep][:, None]).sum())
        rows.append(torch.stack(row))
    return torch.stack(rows)


def _direct(model, pairs: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy, reference, label tokens) of each pair's two replies, [pairs, 2] each."""
    with torch.no_grad():
        pi = _direct_logps(model, pairs)
        ref = _direct_logps(model, pairs, adapter=False)
    return pi, ref, _counts(pairs)


def _counts(pairs: list[Sample]) -> torch.Tensor:
    return torch.tensor(
        [
            [
                sum(t != IGNORE_INDEX for t in s.labels[1 : s.split]),
                sum(t != IGNORE_INDEX for t in s.labels[s.split + 1 :]),
            ]
            for s in pairs
        ],
        dtype=torch.float32,
    )


def _published(objective: str, pi, ref, n, beta=BETA, eps=0.0, gamma=0.5) -> torch.Tensor:
    """The per-pair losses as the papers write them."""
    if objective == "dpo":
        h = (pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    avg, ref_avg = pi / n, ref / n
    if objective == "ipo":
        h = (avg[:, 0] - ref_avg[:, 0]) - (avg[:, 1] - ref_avg[:, 1])
        return (h - 1 / (2 * beta)) ** 2
    if objective == "simpo":
        return -F.logsigmoid(beta * (avg[:, 0] - avg[:, 1]) - gamma)
    odds = avg - torch.log(1 - torch.exp(avg))  # orpo
    return -avg[:, 0] - beta * F.logsigmoid(odds[:, 0] - odds[:, 1])


@pytest.fixture(scope="module")
def tiny():
    cfg, model = _model("peft.dropout=0.0")
    return cfg, model.eval()


def test_at_the_first_step_the_dpo_loss_is_ln_2(tiny) -> None:
    """B = 0: the policy is the reference, every pair's margin is 0, σ(0) = ½."""
    cfg, model = tiny
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    try:
        pairs = _pairs(cfg.model.architecture["vocab_size"])
        loss = PreferenceLoss(model, "chunked", 16, "dpo", 0.1)
        total = loss(**_batch(pairs))  # the reference live, as the first step sees it
        assert abs(float(total) / 3 - math.log(2)) < 1e-6, float(total)
        assert loss.stats is not None and float(loss.stats[-1]) == 3.0
        assert float(loss.stats[2]) == 0.0  # margins
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_the_packed_chunked_loss_is_the_published_formula_on_each_sequence_alone(
    tiny, objective: str
) -> None:
    cfg, model = tiny
    pairs = _pairs(cfg.model.architecture["vocab_size"])
    pi, ref, n = _direct(model, pairs)
    want = _published(objective, pi, ref, n)
    module = PreferenceLoss(model, "chunked", 16, objective, BETA)
    with torch.no_grad():
        got = module(**_batch(pairs))
    torch.testing.assert_close(got, want.sum(), rtol=1e-5, atol=1e-6)
    # The rewards TRL reports, summed over the pairs (then the pair count).
    if objective == "dpo":
        rewards, shown = BETA * (pi - ref), pi
    elif objective == "ipo":
        rewards, shown = BETA * (pi - ref) / n, pi / n
    else:
        rewards, shown = BETA * pi / n, pi / n
    stats = module.stats
    assert stats is not None
    expected = [
        rewards[:, 0].sum(),
        rewards[:, 1].sum(),
        (rewards[:, 0] - rewards[:, 1]).sum(),
        (rewards[:, 0] > rewards[:, 1]).sum(),
        shown[:, 0].sum(),
        shown[:, 1].sum(),
        3,
    ]
    torch.testing.assert_close(
        stats.float(), torch.tensor([float(e) for e in expected]), rtol=1e-5, atol=1e-5
    )


def test_precomputed_reference_gives_the_live_loss(tiny) -> None:
    cfg, model = tiny
    pairs = _pairs(cfg.model.architecture["vocab_size"])
    module = PreferenceLoss(model, "chunked", 16, "dpo", BETA)
    batch = _batch(pairs)
    with torch.no_grad():
        reference = module(**batch, reference_pass=True)
        torch.testing.assert_close(
            reference.float(), _direct_logps(model, pairs, adapter=False), rtol=1e-5, atol=1e-5
        )
        live = module(**batch)
        precomputed = module(**batch, reference_logps=reference)
    assert float(live) == float(precomputed)


def test_fillers_count_nothing(tiny) -> None:
    """A label-free filler pair (a rank's padding of its validation shard) adds no loss."""
    cfg, model = tiny
    pairs = _pairs(cfg.model.architecture["vocab_size"])
    module = PreferenceLoss(model, "chunked", 16, "dpo", BETA)
    with torch.no_grad():
        two = module(**{k: v for k, v in collate_packed([pairs[:2]], 0).items()
                        if k != "real_tokens"})  # fmt: skip
        blank = Sample(pairs[2].input_ids, [IGNORE_INDEX] * len(pairs[2].labels), pairs[2].split)
        batch = collate_packed([pairs[:2], [blank]], 0)
        assert batch["pair_index"].tolist() == [10, 11, -1]
        batch = {k: v for k, v in batch.items() if k != "real_tokens"}
        padded = module(**batch)
        # Precomputed, with a table whose row 0 (where a filler's index is clamped) is NaN.
        from memtune.rank.reference import References

        table = torch.full((12, 2), float("nan"))
        table[10:] = module(**batch, reference_pass=True)[:2].double()
        precomputed = module(**References({"train": table}).attach(batch))
    torch.testing.assert_close(padded, two)
    torch.testing.assert_close(precomputed, two)
    assert module.stats is not None and float(module.stats[-1]) == 2.0
    assert module.stats.isfinite().all()


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_gradients_through_the_chunked_log_probs_equal_those_through_full_logits(
    tiny, objective: str
) -> None:
    cfg, model = tiny
    pairs = _pairs(cfg.model.architecture["vocab_size"])
    batch = _batch(pairs)
    with torch.no_grad():
        reference = PreferenceLoss(model, "plain", 16, objective, BETA)(
            **batch, reference_pass=True
        )
    grads = []
    for kind in ("plain", "chunked"):
        model.zero_grad()
        PreferenceLoss(model, kind, 8, objective, BETA)(
            **batch, reference_logps=reference
        ).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    model.zero_grad()
    full, chunked = grads
    assert full.keys() == chunked.keys() and len(full) > 10
    for name in full:
        drift = float((chunked[name] - full[name]).norm() / full[name].norm().clamp_min(1e-12))
        assert drift < 1e-5, (name, drift)
    assert max(float(g.abs().max()) for g in full.values()) > 1e-4  # not all zero


def test_a_pair_without_a_reference_value_stops_the_step() -> None:
    """A table computed for other steps (its NaN rows: pairs it did not cover) is refused, not
    trained against."""
    from memtune.rank.reference import References

    table = torch.tensor([[-3.0, -4.0], [float("nan"), float("nan")], [-1.0, -2.0]])
    refs = References({"train": table})
    ok = refs.attach({"pair_index": torch.tensor([2, 0, -1])})
    assert ok["reference_logps"].tolist() == [[-1.0, -2.0], [-3.0, -4.0], [0.0, 0.0]]
    with pytest.raises(RuntimeError, match="train pair 1 has no precomputed reference"):
        refs.attach({"pair_index": torch.tensor([0, 1])})


@pytest.mark.parametrize("packing", [True, False])
def test_the_reference_covers_exactly_what_every_ranks_loader_yields(
    tmp_path, packing: bool
) -> None:
    """rank.reference.train_items against the real loaders of 2 data-parallel ranks, stepped
    through max_steps × accumulation micro batches (several epochs: the rows an epoch leaves
    out, a later one takes)."""
    from memtune.config import to_run_config
    from memtune.data.cache import _arrays, _save
    from memtune.data.loaders import make_loader
    from memtune.rank.reference import train_items
    from memtune.rank.worker import _batches
    from tests.conftest import compose_cfg, decided

    samples = [Sample([7] * (10 + i % 7), [7] * (10 + i % 7), split=5) for i in range(61)]
    _save(_arrays(samples), tmp_path / "train.safetensors")
    overrides = ["data.max_seq_len=64", "trainer.micro_batch_size=2"]
    overrides += ["trainer.global_batch_size=8", f"data.packing={str(packing).lower()}"]
    wants = {}
    for steps in (2, 7):
        cfg = to_run_config(compose_cfg([*overrides, f"trainer.max_steps={steps}"]))
        seen: set[int] = set()
        for rank in range(2):
            d = decided(cfg)
            loader, sampler = make_loader(cfg, d.batch, str(tmp_path), 0, rank, 2)
            batches = _batches(loader, sampler)
            for _ in range(steps * 2):  # accumulation 2 on each of the 2 ranks
                seen.update(next(batches)["pair_index"].tolist())
            if rank == 0:  # the worker passes its own loader's dataset and sampler
                want = train_items(loader.dataset, sampler, cfg, d.batch)
        assert sorted(seen) == want
        wants[steps] = set(want)
    assert wants[2] <= wants[7]
    if not packing:  # 2 steps of 8 pairs: 16 of the 61
        assert len(wants[2]) == 16 < len(wants[7])


@pytest.mark.parametrize(("objective", "eps", "gamma"), [("dpo", 0.1, 0.5), ("simpo", 0.2, 1.3)])
def test_label_smoothing_and_the_simpo_margin_follow_the_formulas(
    tiny, objective: str, eps: float, gamma: float
) -> None:
    cfg, model = tiny
    pairs = _pairs(cfg.model.architecture["vocab_size"])
    pi, ref, n = _direct(model, pairs)
    with torch.no_grad():
        got = PreferenceLoss(model, "chunked", 16, objective, BETA, eps, gamma)(**_batch(pairs))
    if objective == "simpo":  # smoothing as in DPO's, around the margin less gamma
        z = BETA * (pi[:, 0] / n[:, 0] - pi[:, 1] / n[:, 1]) - gamma
        want = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    else:
        want = _published(objective, pi, ref, n, eps=eps)
    torch.testing.assert_close(got, want.sum(), rtol=1e-5, atol=1e-6)
    plain = PreferenceLoss(model, "chunked", 16, objective, BETA)
    with torch.no_grad():
        assert abs(float(plain(**_batch(pairs))) - float(got)) > 1e-3  # the settings matter
