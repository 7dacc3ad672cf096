"""Tiled MLP and offloaded activation checkpoints: the same LoRA gradients as without them, on
one process (values, dropout included) and on real ZeRO-3 ranks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from memtune.config import to_run_config
from memtune.rank import attention
from memtune.rank.layers import decoder_layers
from memtune.rank.long_context import offload_checkpoints, tile_mlps, tiles_for
from memtune.rank.loss import CausalLMLoss
from memtune.rank.model import add_lora, load_base_model
from memtune.tools.tiny import synthesize
from tests.conftest import Run, compose_cfg, decided, start_run


def _model(*overrides: str):
    cfg = to_run_config(compose_cfg(["peft=lora-all-linear", "trainer.precision=fp32", *overrides]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    torch.manual_seed(0)
    attention.register()
    d = decided(cfg, attention="sdpa_varlen")
    model = add_lora(load_base_model(cfg, d), cfg, d).train()
    with torch.no_grad():  # lora_B starts at 0, which would leave every lora_A gradient 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return cfg, model


def _grads(cfg, model, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(
        0, cfg.model.architecture["vocab_size"], (2, 96), generator=torch.Generator().manual_seed(5)
    )
    torch.manual_seed(seed)  # LoRA dropout's masks
    loss = CausalLMLoss(model, "chunked", 64)(input_ids=ids, labels=ids)
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any("mlp" in k for k in a)
    # fp32; the tiles sum each LoRA gradient in another order: 1e-6 of the largest entry.
    for name in a:
        drift = float((b[name] - a[name]).norm() / a[name].norm().clamp_min(1e-12))
        assert drift < 1e-5, (name, drift)  # lora_A's are 0 here (lora_B starts at 0): 0 too


def test_tiles_follow_the_hidden_size() -> None:
    assert tiles_for(32768, 3584) == 10 and tiles_for(100, 3584) == 1


def test_tiled_mlp_gives_the_same_lora_gradients() -> None:
    cfg, model = _model("trainer.activation_checkpointing=false", "peft.dropout=0")
    plain = _grads(cfg, model)
    assert tile_mlps(model.get_base_model(), tokens=2 * 96) == 1  # tiny hidden 256 → 1 tile
    cfg, model = _model("trainer.activation_checkpointing=false", "peft.dropout=0")
    assert tile_mlps(model.get_base_model(), tokens=4 * 256) == 4  # 192 tokens in 4 tiles
    _assert_same(plain, _grads(cfg, model))


def test_tiled_mlp_recomputes_with_the_forwards_dropout_masks() -> None:
    """Against the same tiles computed with autograd directly (the same masks drawn in the
    same order): equal only if the recompute replays the forward's RNG."""
    overrides = ("trainer.activation_checkpointing=false", "peft.dropout=0.2")
    cfg, model = _model(*overrides)
    for layer in decoder_layers(model):
        mlp, plain = layer.mlp, type(layer.mlp).forward

        def eager(x, mlp=mlp, plain=plain):
            flat = x.reshape(-1, x.shape[-1])
            return torch.cat([plain(mlp, t) for t in flat.tensor_split(3)]).view_as(x)

        mlp.forward = eager
    want = _grads(cfg, model)
    cfg, model = _model(*overrides)
    tile_mlps(model.get_base_model(), tokens=3 * 256)
    _assert_same(want, _grads(cfg, model))


@pytest.mark.parametrize("dropout", ["0", "0.2"])
def test_offloaded_checkpoints_give_the_same_lora_gradients(dropout: str) -> None:
    """Against transformers' own (non-reentrant) checkpointing of every layer, which replays
    the RNG too; the first layer's input (the frozen embedding's) needs no gradient. The
    inputs go into one host buffer a layer, exactly its bytes (the plan's host row), kept
    from step to step and grown only for a wider batch; a forward without grad in training
    mode (a live reference pass) puts nothing there."""
    overrides = ("trainer.checkpoint_layers=all", f"peft.dropout={dropout}")
    cfg, model = _model(*overrides)
    want = _grads(cfg, model)
    cfg, model = _model(*overrides)
    assert offload_checkpoints(model.get_base_model(), torch.device("cpu")) == 2
    _assert_same(want, _grads(cfg, model))
    copies = decoder_layers(model)[0]._gradient_checkpointing_func.copies
    kept = [(b.data.data_ptr(), b.data.numel()) for b in copies.buffers]
    assert [n for _, n in kept] == [2 * 96 * 256 * 4] * 2 and copies.host == []  # fp32
    _assert_same(want, _grads(cfg, model))  # a second step over the same buffers
    assert [(b.data.data_ptr(), b.data.numel()) for b in copies.buffers] == kept
    wider = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(input_ids=wider)
    assert copies.host == [] and len(copies.buffers) == 2
    CausalLMLoss(model, "chunked", 64)(input_ids=wider, labels=wider).backward()
    assert [b.data.numel() for b in copies.buffers] == [2 * 128 * 256 * 4] * 2


def test_a_recomputed_layers_output_values_are_freed_before_its_backward(monkeypatch) -> None:
    """The offloaded checkpoint backpropagates through its recomputed layer without holding
    the layer's output (tokens × hidden): every layer's output is a residual sum, its
    storage is emptied, and the gradients are still those of plain checkpointing."""
    from memtune.rank import long_context

    overrides = ("trainer.checkpoint_layers=all", "peft.dropout=0")
    cfg, model = _model(*overrides)
    want = _grads(cfg, model)
    cfg, model = _model(*overrides)
    offload_checkpoints(model.get_base_model(), torch.device("cpu"))
    outputs: list[torch.Tensor] = []
    release = long_context._release_values

    def recorded(out: torch.Tensor) -> None:
        outputs.append(out)
        release(out)

    monkeypatch.setattr(long_context, "_release_values", recorded)
    _assert_same(want, _grads(cfg, model))
    assert len(outputs) == 2 and all(o.shape == (2, 96, 256) for o in outputs)
    assert [o.untyped_storage().size() for o in outputs] == [0, 0]


def test_attention_by_kv_head_gives_the_same_lora_gradients() -> None:
    """Every layer's attention as one call per KV head (2 on the tiny model, 2 query heads
    each) with the MLP tiled and the inputs offloaded, as auto runs it: the same LoRA gradients
    (dropout's masks included) as one call."""

    def tiled_and_offloaded(by_kv_head: bool):
        cfg, model = _model("trainer.checkpoint_layers=all", "peft.dropout=0.2")
        base = model.get_base_model()
        assert attention.split_by_kv_head(base, by_kv_head) == (2 if by_kv_head else 0)
        offload_checkpoints(base, torch.device("cpu"))
        tile_mlps(base, tokens=2 * 256)
        return cfg, model

    want = _grads(*tiled_and_offloaded(False))
    cfg, model = tiled_and_offloaded(True)
    layers = decoder_layers(model.get_base_model())
    assert all(getattr(layer.self_attn, attention.SPLIT_FLAG) for layer in layers)
    _assert_same(want, _grads(cfg, model))


def test_both_together_on_the_checkpointed_layers_only() -> None:
    cfg, model = _model("trainer.activation_checkpointing=false", "peft.dropout=0")
    want = _grads(cfg, model)
    cfg, model = _model("trainer.checkpoint_layers=1", "peft.dropout=0")
    assert offload_checkpoints(model.get_base_model(), torch.device("cpu")) == 1
    tile_mlps(model.get_base_model(), tokens=2 * 256)
    _assert_same(want, _grads(cfg, model))


def test_decisions_applied_again_replace_what_was_applied() -> None:
    """rank.build.apply_layer_decisions on a model that has decisions already (the GPU check
    applies each length's to the engine it has): the layers, tiles and offload of the new
    ones, none of the old left, and the gradients of the new ones built afresh."""
    import dataclasses

    from memtune.rank.build import apply_layer_decisions
    from memtune.rank.long_context import OwnCheckpoint

    overrides = ("trainer.checkpoint_layers=all", "peft.dropout=0")
    cfg, model = _model(*overrides)
    everything = decided(cfg, tiled_mlp=True, offload_activations=True)
    # 4 rows × 128 tokens a micro batch, tiles of hidden_size (256) tokens; both layers offload
    assert apply_layer_decisions(model, everything, torch.device("cpu")) == (2, 2)
    assert apply_layer_decisions(model, everything, torch.device("cpu")) == (2, 2)  # no stacking
    funcs = [layer._gradient_checkpointing_func for layer in decoder_layers(model)]
    assert all(isinstance(f, OwnCheckpoint) and f.copies is not None for f in funcs)
    assert not any(isinstance(f.replaces, OwnCheckpoint) for f in funcs)
    one = dataclasses.replace(everything, tiled_mlp=False, offload_activations=False)
    one = one.with_recompute(1)
    assert apply_layer_decisions(model, one, torch.device("cpu")) == (0, 0)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]
    assert not any(isinstance(layer._gradient_checkpointing_func, OwnCheckpoint) for layer in
                   decoder_layers(model))  # fmt: skip
    assert all("forward" not in layer.mlp.__dict__ for layer in decoder_layers(model))
    got = _grads(cfg, model)
    cfg, fresh = _model("trainer.checkpoint_layers=1", "peft.dropout=0")
    _assert_same(_grads(cfg, fresh), got)


@pytest.mark.slow
def test_tiled_and_offloaded_zero3_ranks_train_as_without(zero3_run: Run, runs_root) -> None:
    """2 ranks, ZeRO-3 partitioning every weight (LoRA's included): tiles gather the MLP's
    weights in each tile's forward and backward, and ZeRO reduces the LoRA gradients once,
    after the last tile."""
    from tests.conftest import FAST

    run = start_run(
        runs_root / "tiled-offloaded",
        [
            *FAST,
            "zero=zero3",
            "launcher.num_ranks=2",
            "trainer.loss_chunk_tokens=16",
            "trainer.checkpoint_layers=all",
            "trainer.tiled_mlp=on",
            "trainer.offload_activations=on",
        ],
        probe=False,
    )
    assert run.code == 0
    assert [m["train/loss"] for m in run.metrics()] == pytest.approx(zero3_run.losses(), rel=1e-5)
    # each rank's offloaded inputs held in host memory: the plan's host row, to the byte
    import json

    memory = json.loads((run.dir / "memory.json").read_text())
    host = [c for c in memory["vs_plan"] if c["measure"] == "host offload"]
    assert [c["rank"] for c in host] == [0, 1], memory["vs_plan"]
    assert all(c["measured_gib"] == c["planned_gib"] > 0 for c in host), host
    norms = [[m["train/grad_norm"] for m in r.metrics()] for r in (run, zero3_run)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    a = load_file(str(run.dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(zero3_run.dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert float((a[key] - b[key]).norm() / b[key].norm()) < 1e-4, key


@pytest.mark.slow
def test_selective_zero3_ranks_train_as_without(zero3_run: Run, runs_root) -> None:
    """2 ranks, ZeRO-3 partitioning every weight: every layer selective (its matmuls' and
    attention's outputs kept through the backward, the rest recomputed under ZeRO-3's gather
    hooks, dropout with the forward's masks) trains as keeping everything does."""
    from tests.conftest import FAST

    run = start_run(
        runs_root / "selective",
        [
            *FAST,
            "zero=zero3",
            "launcher.num_ranks=2",
            "trainer.loss_chunk_tokens=16",
            "trainer.checkpoint_layers=0",
            "trainer.selective_layers=all",
        ],
        probe=False,
    )
    assert run.code == 0 and run.decisions is not None
    assert run.decisions.checkpointing.layers == ("selective", "selective")
    assert [m["train/loss"] for m in run.metrics()] == pytest.approx(zero3_run.losses(), rel=1e-5)
    a = load_file(str(run.dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(zero3_run.dir / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert float((a[key] - b[key]).norm() / b[key].norm()) < 1e-4, key


@pytest.mark.gpu
def test_offloaded_inputs_are_page_locked_at_their_own_size_on_a_gpu() -> None:
    """On CUDA each layer's buffer is pinned in place (cudaHostRegister), its size the input's
    bytes (torch's pinned allocator would round 3 × 1,000 × 3,584 bf16 up to 32 MiB), and the
    input comes back as it went."""
    from memtune.rank.long_context import HostCopies

    copies = HostCopies(torch.device("cuda"))
    xs = [torch.randn(3, 1000, 3584, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    assert [copies.put(x) for x in xs] == [0, 1]
    assert all(b.data.is_pinned() and b.data.numel() == 3 * 1000 * 3584 * 2 for b in copies.buffers)
    assert torch.equal(copies.take(1), xs[1]) and torch.equal(copies.take(0), xs[0])
    copies.release()
    assert copies.buffers == []
