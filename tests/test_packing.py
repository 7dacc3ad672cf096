"""Packing is exact: no attention across samples, positions restart, same loss as one by one."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from memtune.config import to_run_config
from memtune.config.decisions import BatchShape
from memtune.data.batching import (
    LengthGroupedSampler,
    PackedDataset,
    TokenizedDataset,
    collate_packed,
    collate_padded,
)
from memtune.data.cache import load_split, preprocess
from memtune.data.encode import load_tokenizer
from memtune.data.packing import pack_bins, step_shape
from memtune.rank.loss import model_inputs, token_loss_sum
from memtune.rank.model import load_base_model
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg, decided


def test_first_fit_decreasing_bins() -> None:
    rng = random.Random(0)
    lengths = [min(2048, int(rng.paretovariate(1.2) * 60)) for _ in range(2000)]
    bins = pack_bins(lengths, 2048)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    efficiency = sum(lengths) / (len(bins) * 2048)
    assert efficiency > 0.95, efficiency


@pytest.fixture(scope="module")
def tiny():
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    tokenizer = load_tokenizer(cfg)
    prepared = preprocess(cfg.data, tokenizer, seed=0)
    return cfg, tokenizer, load_split(prepared.dir)


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the training loop hands the model (rank/loss.CausalLMLoss)."""
    from memtune.rank.loop import MODEL_INPUTS

    return model_inputs(**{k: batch[k] for k in MODEL_INPUTS if k in batch and k != "labels"})


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa", "eager"])
def test_packed_loss_equals_one_by_one(tiny, attn: str) -> None:
    cfg, tokenizer, dataset = tiny
    model = load_base_model(cfg, decided(cfg, attention=attn)).eval()
    subset = TokenizedDataset.from_samples([dataset[i] for i in range(24)])
    packed = PackedDataset(subset, capacity=128)
    assert len(packed) < len(subset)  # several samples per row
    batch = collate_packed([packed[i] for i in range(len(packed))], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**_inputs(batch)).logits
        packed_sum = token_loss_sum(logits, batch["labels"])
        packed_count = int((batch["labels"][:, 1:] != -100).sum())

        single_sum, single_count = torch.zeros(()), 0
        for i in range(len(subset)):
            s = collate_padded([subset[i]], tokenizer.pad_token_id)
            out = model(input_ids=s["input_ids"]).logits
            single_sum += token_loss_sum(out, s["labels"])
            single_count += int((s["labels"][:, 1:] != -100).sum())
            # The sample's logits inside its packed row equal its logits alone.
            row, at = _locate(packed, i)
            n = s["input_ids"].shape[1]
            torch.testing.assert_close(logits[row, at : at + n], out[0], rtol=1e-5, atol=1e-5)
    assert packed_count == single_count
    torch.testing.assert_close(
        packed_sum / packed_count, single_sum / single_count, rtol=1e-5, atol=1e-5
    )
    assert batch["real_tokens"] == sum(subset.lengths)


def _locate(packed: PackedDataset, sample: int) -> tuple[int, int]:
    for row, members in enumerate(packed.bins):
        at = 0
        for j in members:
            if j == sample:
                return row, at
            at += packed.base.lengths[j]
    raise KeyError(sample)


def test_packed_rows_restart_positions_and_mask_boundaries(tiny) -> None:
    _, tokenizer, dataset = tiny
    packed = PackedDataset(TokenizedDataset.from_samples([dataset[i] for i in range(8)]), 64)
    row = packed[0]
    batch = collate_packed([row], tokenizer.pad_token_id)
    starts = [0]
    for s in row[:-1]:
        starts.append(starts[-1] + len(s.input_ids))
    pos = batch["position_ids"][0].tolist()
    assert [pos[a] for a in starts] == [0] * len(starts)
    # The first token of every sample is never a target of the previous one.
    assert all(batch["labels"][0, a] == -100 for a in starts)


def test_cu_seq_lens_mark_every_sample_and_row_padding(tiny) -> None:
    _, tokenizer, dataset = tiny
    packed = PackedDataset(TokenizedDataset.from_samples([dataset[i] for i in range(12)]), 64)
    rows = [packed[i] for i in range(3)]
    batch = collate_packed(rows, tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    expected = []
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            expected.append(r * width + at)
            at += len(s.input_ids)
        if at < width:
            expected.append(r * width + at)  # the row's padding: a segment of its own
    bounds = [*expected, len(rows) * width]
    assert batch["cu_seq_lens"].tolist() == bounds
    assert batch["cu_seq_lens"].dtype == torch.int32  # what flash_attn_varlen_func takes
    assert int(batch["max_length"]) == max(b - a for a, b in itertools.pairwise(bounds))


def test_sdpa_varlen_gradients_equal_the_dense_mask(tiny) -> None:
    """Training through sdpa_varlen (per-sample SDPA, no mask) gives the gradients of
    transformers' sdpa with its dense block-diagonal mask, packed and right-padded."""
    cfg, tokenizer, dataset = tiny
    subset = [dataset[i] for i in range(20)]
    packed = PackedDataset(TokenizedDataset.from_samples(subset), capacity=128)
    batches = {
        "packed": collate_packed([packed[i] for i in range(3)], tokenizer.pad_token_id),
        "padded": collate_padded(subset[:6], tokenizer.pad_token_id),
    }
    assert not bool(batches["padded"]["attention_mask"].all())  # some rows are padded
    grads: dict[str, dict[str, list[torch.Tensor]]] = {}
    for attn in ("sdpa", "sdpa_varlen"):
        model = load_base_model(cfg, decided(cfg, attention=attn)).train()
        for kind, batch in batches.items():
            model.zero_grad()
            loss = token_loss_sum(model(**_inputs(batch)).logits, batch["labels"])
            loss.backward()
            grads.setdefault(kind, {})[attn] = [p.grad.clone() for p in model.parameters()]
    # Two SDPA kernels (masked vs causal) sum in different orders: fp32 rounding, relative to
    # each gradient's size (a summed loss makes some entries large).
    for kind, by_attn in grads.items():
        for dense, varlen in zip(by_attn["sdpa"], by_attn["sdpa_varlen"], strict=True):
            assert float((varlen - dense).norm() / dense.norm()) < 1e-5, kind


def test_sdpa_varlen_builds_no_dense_mask(tiny) -> None:
    from transformers.masking_utils import create_causal_mask

    cfg, tokenizer, dataset = tiny
    packed = PackedDataset(TokenizedDataset.from_samples([dataset[i] for i in range(12)]), 64)
    batch = collate_packed([packed[i] for i in range(2)], tokenizer.pad_token_id)
    masks = {}
    for attn in ("sdpa", "sdpa_varlen"):
        model = load_base_model(cfg, decided(cfg, attention=attn))
        embeds = model.get_input_embeddings()(batch["input_ids"])
        masks[attn] = create_causal_mask(
            model.config, embeds, None, None, position_ids=batch["position_ids"]
        )
    n = batch["input_ids"].shape[1]
    assert masks["sdpa"].shape == (2, 1, n, n)  # what a 131,072-token row would make 16 GiB
    assert masks["sdpa_varlen"] is None


def test_sdpa_varlen_refuses_left_padding(tiny) -> None:
    from memtune.rank.attention import row_segments

    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        row_segments(2, 4, None, mask)
    assert row_segments(2, 4, None, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])) == [
        [(0, 3)],
        [(0, 2)],
    ]
    with pytest.raises(ValueError, match="spans rows 0 and 1"):
        row_segments(2, 4, torch.tensor([0, 3, 6, 8], dtype=torch.int32), None)


def test_the_varlen_attentions_refuse_bidirectional_attention() -> None:
    """Both attend causally within each sample whatever they are asked: a vision tower's
    attention (its module's is_causal False, or is_causal=False given) is refused, not run
    causal (memtune gives the towers sdpa; the guard keeps it so)."""
    from memtune.rank import attention

    q = torch.randn(1, 2, 4, 8)
    tower = torch.nn.Module()
    tower.is_causal = False
    for forward in (attention.sdpa_varlen_forward, attention.torch_varlen_forward):
        with pytest.raises(ValueError, match="attends causally only"):
            forward(tower, q, q, q, None)
        with pytest.raises(ValueError, match="attends causally only"):
            forward(torch.nn.Module(), q, q, q, None, is_causal=False)


def test_step_shape_counts_samples_and_epochs() -> None:
    lengths = [60, 60, 40, 40, 30, 20, 10, 10] * 10  # 2,700 tokens
    batch = BatchShape(global_batch=4, micro_batch=1, ranks=1, sequence_parallel=1, row_tokens=128)
    packed = step_shape(lengths, True, batch, max_steps=10)
    rows = len(pack_bins(lengths, 128))
    assert packed.items == rows and packed.samples == 80
    assert packed.samples_per_step == pytest.approx(4 * 80 / rows)
    assert packed.epochs == pytest.approx(10 * 4 / (rows // 4 * 4))
    assert packed.fill == pytest.approx(2700 / (rows * 128))
    assert "packed rows of ≤ 128 tokens" in packed.line()
    plain = step_shape(lengths, False, batch, max_steps=10)
    assert plain.samples_per_step == 4 and plain.epochs == pytest.approx(0.5)
    assert plain.line() == "a step = 4 samples; max_steps 10 ≈ 0.50 epochs of 80 samples"
    # An epoch is whole steps: the line says how many an epoch holds, and that it is not all.
    odd = step_shape([*lengths, 5, 5, 5], False, batch, max_steps=40)
    assert odd.epochs == pytest.approx(2.0)
    assert odd.line().endswith(
        "max_steps 40 ≈ 2.00 epochs of 80 of the 83 samples (an epoch is whole steps: each "
        "epoch leaves out 3 samples, drawn at random)"
    )


def test_length_grouped_sampler() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(5, 500) for _ in range(1000)]
    samplers = [LengthGroupedSampler(lengths, micro=4, world=2, rank=r, seed=3) for r in range(2)]
    per_rank = [list(s) for s in samplers]
    assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0])
    assert not set(per_rank[0]) & set(per_rank[1])
    # An epoch is every sample once (1,000 = 250 micro batches of 4 over 2 ranks): equal,
    # disjoint shares alone held with the last of the two shuffled chunks (488 samples) left out.
    assert sorted(per_rank[0] + per_rank[1]) == list(range(1000))
    batches = [per_rank[0][i : i + 4] for i in range(0, len(per_rank[0]), 4)]
    padded = sum(4 * max(lengths[i] for i in b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    assert real / padded > 0.9  # random batching of this distribution gives ~0.6
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]


class _Recorded(torch.utils.data.Dataset):
    """Items that remember being read: what a resumed run's loader reads, and collates."""

    def __init__(self, n: int):
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.read.append(i)
        return i


@pytest.mark.parametrize("grouped", [False, True])
def test_a_resumed_epoch_starts_at_its_micro_batch_and_reads_nothing_before(grouped) -> None:
    """A run resumed K micro batches into an epoch continues with the (K+1)-th, as the run it
    continues did, and its loader reads (collates, patchifies) none of the first K: they were
    read and dropped before, one by one."""
    from memtune.data.batching import GlobalOrderSampler
    from memtune.rank.worker import _batches

    n, micro, skip = 96, 4, 5
    rng = random.Random(2)
    lengths = [rng.randint(5, 500) for _ in range(n)]

    def run(skip: int) -> tuple[list[list[int]], list[int]]:
        data = _Recorded(n)
        sampler = (
            LengthGroupedSampler(lengths, micro, world=2, rank=1, seed=3)
            if grouped
            else GlobalOrderSampler(n, world=2, rank=1, seed=3, global_batch=16)
        )
        loader = torch.utils.data.DataLoader(data, batch_size=micro, sampler=sampler)
        per_epoch = len(loader)
        batches = itertools.islice(_batches(loader, sampler, skip), 2 * per_epoch - skip)
        got = [b.tolist() for b in batches]  # to the end of the second epoch
        return got, data.read

    whole, _ = run(0)
    resumed, read = run(skip)
    per_epoch = len(whole) // 2
    assert resumed == whole[skip:]  # the same batches, from the 6th on
    # Read in order from the 6th batch on: none of the first five was read.
    rest_of_epoch = [i for b in whole[skip:per_epoch] for i in b]
    assert read[: len(rest_of_epoch)] == rest_of_epoch


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch.nn.attention.varlen.varlen_attn's contract in plain SDPA (its kernel is CUDA
    only): (tokens, heads, d) in and out, causal within each cu_seq segment."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k)
    bounds = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in itertools.pairwise(bounds))
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


def _varlen_cases() -> dict[str, dict]:
    """Three rows of 12 tokens: packed (two samples, then padding; one sample; three), right
    padded, and neither."""
    packed = torch.tensor([0, 5, 10, 12, 24, 27, 31, 36], dtype=torch.int32)
    padded = torch.ones(3, 12, dtype=torch.long)
    padded[0, 9:] = 0
    padded[2, 4:] = 0
    real_packed = torch.ones(3, 12, dtype=torch.bool)
    real_packed[0, 10:] = False  # the row's padding segment
    return {
        "packed": {"kwargs": {"cu_seq_lens_q": packed}, "mask": None, "real": real_packed},
        "padded": {"kwargs": {}, "mask": padded, "real": padded.bool()},
        "plain": {"kwargs": {}, "mask": None, "real": torch.ones(3, 12, dtype=torch.bool)},
    }


def _reference_varlen_before_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
    """varlen_attn as torch 2.10 and 2.11 have it: no ``enable_gqa`` keyword (the GPU image's
    torch 2.11 would have raised TypeError at the keyword), so as many KV heads as query
    heads."""
    assert k.shape[1] == v.shape[1] == q.shape[1]
    return _reference_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=False
    )


@pytest.mark.parametrize("kernel", ["torch 2.12", "torch 2.11"])
@pytest.mark.parametrize("case", ["packed", "padded", "plain"])
def test_torch_varlen_attends_as_sdpa_varlen(
    monkeypatch: pytest.MonkeyPatch, case: str, kernel: str
) -> None:
    """torch_varlen's layout (the flattened tokens, the segments' bounds from a packed batch's
    cu_seq_lens or a padding mask, grouped KV heads) gives sdpa_varlen's outputs and
    gradients at every real token, with a reference in place of torch's CUDA kernel, of
    either signature (with enable_gqa, torch 2.12 on; without, 2.10-2.11: the KV heads
    repeated); and both give them as one call per KV head (attention_by_kv_head: the reference
    called once per KV head with its query heads)."""
    from memtune.rank import attention

    heads_per_call: list[int] = []

    def with_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
        heads_per_call.append(q.shape[1])
        bounds = (cu_q, cu_k, max_q, max_k)
        return _reference_varlen(
            q, k, v, *bounds, scale=scale, window_size=window_size, enable_gqa=enable_gqa
        )

    def without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        heads_per_call.append(q.shape[1])
        bounds = (cu_q, cu_k, max_q, max_k)
        return _reference_varlen_before_gqa(q, k, v, *bounds, scale=scale, window_size=window_size)

    kernel_fn = with_gqa if kernel == "torch 2.12" else without_gqa
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel_fn)
    monkeypatch.setattr(attention, "_cumulative_cache", {"key": None, "value": None})
    given = _varlen_cases()[case]
    torch.manual_seed(0)
    q0, k0, v0 = torch.randn(3, 4, 12, 8), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 8)
    real = given["real"]
    results = []
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # what transformers' attention modules carry (GQA)
    for split in (False, True):
        setattr(module, attention.SPLIT_FLAG, split)
        for forward in (attention.sdpa_varlen_forward, attention.torch_varlen_forward):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            out, _ = forward(module, q, k, v, given["mask"], scaling=0.3, **given["kwargs"])
            assert out.shape == (3, 12, 4, 8)
            weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
            (out[real] * weights[real]).sum().backward()
            results.append((out[real].detach(), q.grad, k.grad, v.grad))
    assert heads_per_call == [4, 2, 2]
    for other in results[1:]:
        for got, per_sample in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, per_sample)
    cu, longest = attention.cumulative_bounds(
        3, 12, given["kwargs"].get("cu_seq_lens_q"), given["mask"], torch.device("cpu")
    )
    expected = {
        "packed": ([0, 5, 10, 12, 24, 27, 31, 36], 12),
        "padded": ([0, 9, 12, 24, 28, 36], 12),
        "plain": ([0, 12, 24, 36], 12),
    }[case]
    assert (cu.tolist(), longest) == expected and cu.dtype == torch.int32


def test_a_selective_layer_keeps_torch_varlens_attention_output() -> None:
    """Selective recompute keeps attention's output (the planner's selective_kept counts it):
    torch_varlen's too, which reaches torch's selective checkpoint as one custom operator of
    its own namespace (torch_attn), not as SDPA's; it was made again in every selective
    layer's backward, a whole attention forward the plan and the step time did not count."""
    import torch.nn.attention.varlen  # registers torch_attn::_varlen_attn

    from memtune.rank.layers import keeps_output

    assert keeps_output(torch.ops.torch_attn._varlen_attn.default)
    assert keeps_output(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not keeps_output(torch.ops.aten.silu.default)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_varlen_on_cuda_is_the_reference() -> None:
    """torch's own kernel against the reference above, bf16, a packed batch."""
    from memtune.rank import attention

    given = _varlen_cases()["packed"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, h, 12, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = given["kwargs"]["cu_seq_lens_q"].cuda()
    out, _ = attention.torch_varlen_forward(None, q, k, v, None, cu_seq_lens_q=cu)
    flat = [t.transpose(1, 2).reshape(36, t.shape[1], 64).float() for t in (q, k, v)]
    ref = _reference_varlen(
        *flat, cu, cu, 12, 12, scale=None, window_size=(-1, 0), enable_gqa=True
    ).view(3, 12, 4, 64)
    real = given["real"].cuda()
    torch.testing.assert_close(out[real].float(), ref[real], atol=2e-2, rtol=2e-2)


def test_an_attention_function_wrapped_to_split_attends_as_one_call() -> None:
    """rank.attention.splitting over an attention function of transformers' interface (its own
    SDPA function here; FlashAttention-2's under register, which CPU ranks cannot run): one
    call per KV head where the module is split, each with its query heads and the caller's mask
    and kwargs, giving one call's outputs and gradients; one call where it is not."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from bench.gpu_check.attention import attention_module
    from memtune.rank import attention

    calls: list[tuple[int, int, float]] = []

    def counted(module, q, k, v, mask, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs["scaling"]))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    split_sdpa = attention.splitting(counted)
    torch.manual_seed(0)
    q0, k0, v0 = torch.randn(2, 6, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    # a padded second row: transformers' 4D boolean mask, causal, its last 3 keys masked
    mask = torch.ones(10, 10).tril().bool().expand(2, 1, 10, 10).clone()
    mask[1, :, :, 7:] = False
    module = attention_module(6, 2)  # what the functions read of transformers' module
    results = []
    for split in (False, True):
        setattr(module, attention.SPLIT_FLAG, split)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, weights = split_sdpa(module, q, k, v, mask, scaling=0.3, dropout=0.0)
        assert out.shape == (2, 10, 6, 8) and weights is None
        (out[:, :7] * torch.linspace(-1, 1, out[:, :7].numel()).view(2, 7, 6, 8)).sum().backward()
        results.append((out[:, :7].detach(), q.grad, k.grad, v.grad))
    assert calls == [(6, 2, 0.3), (3, 1, 0.3), (3, 1, 0.3)]
    for got, one_call in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, one_call)
    sinks = {"s_aux": torch.zeros(6)}
    with pytest.raises(ValueError, match=r"does not split attention sinks"):
        split_sdpa(module, q0, k0, v0, mask, **sinks)

    def unwrapped(f) -> list:
        chain = [f]
        while hasattr(chain[-1], "__wrapped__"):
            chain.append(chain[-1].__wrapped__)
        return chain

    attention.register()  # what a rank whose decided attention is FlashAttention-2 runs
    chain = unwrapped(ALL_ATTENTION_FUNCTIONS["flash_attention_2"])
    assert chain[-1] is flash_attention_forward and len(chain) > 1
    attention.register()  # again (every rank build calls it): wrapped once, not twice
    assert len(unwrapped(ALL_ATTENTION_FUNCTIONS["flash_attention_2"])) == len(chain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_flash_attention_2_split_by_kv_head_is_one_call() -> None:
    """transformers' FlashAttention-2 as registered (flash-attn installed): one call per KV head
    gives one call's outputs and gradients, bf16, a packed batch."""
    pytest.importorskip("flash_attn")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from bench.gpu_check.attention import attention_module
    from memtune.rank import attention

    attention.register()
    flash = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    module = attention_module(4, 2)  # the GPU check's stand-in for transformers' module
    cu = _varlen_cases()["packed"]["kwargs"]["cu_seq_lens_q"].cuda()
    packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 12, "max_length_k": 12}
    torch.manual_seed(0)
    q0, k0, v0 = (torch.randn(1, h, 36, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    results = []
    for split in (False, True):
        setattr(module, attention.SPLIT_FLAG, split)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, _ = flash(module, q, k, v, None, **packed)
        out.float().square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, one_call in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, one_call, atol=2e-2, rtol=2e-2)
