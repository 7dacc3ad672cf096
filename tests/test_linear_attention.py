"""Packed rows through Qwen3.5's linear-attention layers: each sample as if it were alone.

The tiny Qwen3.5 (conf/model/tiny-qwen3.5.yaml) has three Gated DeltaNet layers and one
full-attention layer; the tiny Qwen3.5-MoE the same with routed experts (adapted) and a shared
expert. Two samples packed into one row must give the same logits, the same
per-sample losses and the same LoRA gradients as each sample run alone; without memtune's
per-sample path (restarting positions only) the conv and the recurrence carry the first sample
into the second, and the same comparison fails.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from memtune.config import to_run_config
from memtune.rank.linear_attention import PATH_PER_SAMPLE, keep_samples_apart
from memtune.rank.loss import model_inputs, token_loss_sum
from memtune.rank.model import add_lora, load_base_model
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg, decided

LENGTHS = (7, 13)  # a second sample longer than the conv kernel and not a chunk multiple


@pytest.fixture(scope="module", params=["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def hybrid_cfg(request):
    """The dense hybrid, and the mixture of experts (its routed experts adapted too)."""
    cfg = to_run_config(
        compose_cfg(
            [
                f"model={request.param}",
                "peft.target=all-linear",
                "peft.dropout=0",  # the same masks alone and packed
                "trainer.precision=fp32",
                "trainer.activation_checkpointing=false",
            ]
        )
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return cfg


def _model(cfg, per_sample: bool):
    torch.manual_seed(0)
    d = decided(cfg)
    model = add_lora(load_base_model(cfg, d), cfg, d)
    # LoRA's B starts at zero: give it values, so its gradients and the A gradients are not 0.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if per_sample:
        assert keep_samples_apart(model).startswith(PATH_PER_SAMPLE)
    return model.train()


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 1000, (1, n), generator=g) for n in LENGTHS]


def _loss_and_grads(model, ids, positions, cu=None):
    """Summed token loss of ``ids`` (labels = the ids), and the LoRA gradients it gives."""
    model.zero_grad(set_to_none=True)
    out = model(**model_inputs(ids, None, positions, cu, max(LENGTHS) if cu is not None else None))
    losses = []
    if cu is None:
        losses.append(token_loss_sum(out.logits, ids))
    else:
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            losses.append(token_loss_sum(out.logits[:, a:b], ids[:, a:b]))
    sum(losses).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), [float(x.detach()) for x in losses], grads


def _packed(model, samples, with_bounds: bool):
    row = torch.cat(samples, dim=1)
    positions = torch.cat([torch.arange(s.shape[1]) for s in samples])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return _loss_and_grads(model, row, positions, cu if with_bounds else None), cu


def _alone(model, samples):
    logits, losses, grads = [], [], {}
    for s in samples:
        lg, (loss,), g = _loss_and_grads(model, s, torch.arange(s.shape[1])[None])
        logits.append(lg)
        losses.append(loss)
        for n, t in g.items():
            grads[n] = grads.get(n, 0) + t
    return torch.cat(logits, dim=1), losses, grads


def test_a_packed_row_trains_each_sample_as_if_alone(hybrid_cfg) -> None:
    model = _model(hybrid_cfg, per_sample=True)
    (logits, losses, grads), _ = _packed(model, _samples(), with_bounds=True)
    alone_logits, alone_losses, alone_grads = _alone(model, _samples())
    torch.testing.assert_close(logits, alone_logits, rtol=1e-4, atol=1e-4)
    assert losses == pytest.approx(alone_losses, rel=1e-5)
    linear = [n for n in grads if "linear_attn" in n]
    assert {n.split(".")[-4] for n in linear} == {"in_proj_qkv", "in_proj_z", "out_proj"}
    for name, grad in grads.items():
        # fp32 sums in another order: ~2e-6 of a tensor's largest gradient (the mixture's
        # summed losses give gradients of ~100); without the boundaries the mixture's
        # gradients move by 40-95% of theirs (measured 2026-12-03)
        want = alone_grads[name]
        atol = max(5e-5, 1e-5 * float(want.abs().max()))
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=atol, msg=name)


def test_without_the_sample_boundaries_the_second_sample_reads_the_first(hybrid_cfg) -> None:
    """The same comparison fails when the row is passed as transformers would take it with
    positions restarting and no boundaries (what packing gave before): the leak is real."""
    model = _model(hybrid_cfg, per_sample=False)
    (logits, _, _), _ = _packed(model, _samples(), with_bounds=False)
    alone_logits, _, _ = _alone(model, _samples())
    first = LENGTHS[0]
    torch.testing.assert_close(logits[:, :first], alone_logits[:, :first], rtol=1e-4, atol=1e-4)
    assert (logits[:, first:] - alone_logits[:, first:]).abs().max() > 0.1


@pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None, reason="flash-linear-attention takes cu_seqlens"
)
def test_transformers_alone_refuses_the_boundaries(hybrid_cfg) -> None:
    """Without flash-linear-attention transformers' recurrence cannot take cu_seq_lens: the
    per-sample path is what makes packing possible on CPU (and wherever fla is missing)."""
    model = _model(hybrid_cfg, per_sample=False)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        _packed(model, _samples(), with_bounds=True)


def test_many_short_samples_in_two_rows_each_as_if_alone(hybrid_cfg) -> None:
    """Two rows of several short samples: up to four sample starts inside one 64-token chunk of
    the recurrence (their -30 decays add up in its running sums), boundaries in the second row
    (cu_seq_lens offsets across rows), a sample over a chunk's end, the rows' right padding."""
    model = _model(hybrid_cfg, per_sample=True)
    rows = [[5, 3, 9, 30, 20], [70, 11, 2]]  # row 2 ends with padding: 83 of 87 tokens
    width = 87
    g = torch.Generator().manual_seed(2)
    samples = [[torch.randint(5, 1000, (1, n), generator=g) for n in row] for row in rows]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(samples):
        at = 0
        for s in row:
            n = s.shape[1]
            ids[r, at : at + n], positions[r, at : at + n] = s[0], torch.arange(n)
            at += n
            bounds.append(r * width + at)
        if at < width:  # padding: the last segment of the row reaches its end
            bounds[-1] = (r + 1) * width
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.no_grad():
        packed = model(**model_inputs(ids, None, positions, cu, width)).logits
        for r, row in enumerate(samples):
            at = 0
            for s in row:
                n = s.shape[1]
                alone = model(input_ids=s, position_ids=torch.arange(n)[None]).logits
                # fp32; a sample sits at another offset of the 64-token chunks than alone, so
                # the chunked recurrence rounds differently (seen: 3e-4 at most; a leak: ~8).
                torch.testing.assert_close(
                    packed[r : r + 1, at : at + n], alone, rtol=1e-3, atol=1e-3
                )
                at += n


@pytest.mark.parametrize("peft", ["qlora-nf4", "lora-int8"])
def test_a_quantized_base_packs_the_linear_attention_projections_and_trains(peft: str) -> None:
    """peft.method=qlora (NF4) or lora-int8 (LLM.int8) on the hybrid: bitsandbytes quantizes
    every projection of the linear-attention layers too (in_proj_qkv, in_proj_z, in_proj_a/b,
    out_proj: nn.Linear), the adapters train through them, and a packed row still gives each
    sample as if alone."""
    from memtune.rank.model import is_quantized_layer

    cfg = to_run_config(
        compose_cfg(
            [
                "model=tiny-qwen3.5",
                f"peft={peft}",
                "peft.dropout=0",
                "trainer.precision=fp32",
                "trainer.activation_checkpointing=false",
            ]
        )
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    model = _model(cfg, per_sample=True)
    mixer = next(m for n, m in model.named_modules() if n.endswith("layers.0.linear_attn"))
    quantized = {  # an adapted layer's bitsandbytes module is its peft wrapper's base_layer
        n.removesuffix(".base_layer").split(".")[-1]
        for n, m in mixer.named_modules()
        if is_quantized_layer(m)
    }
    assert quantized == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
    (logits, _, grads), _ = _packed(model, _samples(), with_bounds=True)
    alone_logits, _, _ = _alone(model, _samples())
    torch.testing.assert_close(logits, alone_logits, rtol=1e-3, atol=1e-3)
    lora = [g for n, g in grads.items() if "linear_attn" in n and "lora_A" in n]
    assert lora and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in lora)
