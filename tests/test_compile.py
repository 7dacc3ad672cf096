"""trainer.compile: regional torch.compile of the decoder layers (inductor on CPU) trains the
same run as eager, under ZeRO-3 with LoRA, a checkpointed layer included (compiled inside
memtune's checkpoint, in the forward pass and in the recompute).

Not in `make test` (marker ``compile``): on a fresh machine inductor compiles its C++ kernels
for these two tests in ~2 minutes of a 2-core machine's time, an eighth of the suite's budget
for one optional switch. `make test-compile` runs them, and `.ci/run` after `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import FAST, Run, start_run

pytestmark = [pytest.mark.slow, pytest.mark.compile]


def test_compiled_layers_train_the_same_run_as_eager(zero3_run: Run, tmp_path: Path) -> None:
    compiled = start_run(
        tmp_path / "compiled",
        [
            *FAST,
            "zero=zero3",
            "launcher.num_ranks=2",
            "trainer.loss_chunk_tokens=16",
            "trainer.compile=true",
            # The first layer recomputes in backward, compiled inside memtune's checkpoint; the
            # second keeps its activations. On CPU ranks auto checkpoints none.
            "trainer.checkpoint_layers=1",
        ],
    )
    assert compiled.code == 0
    assert compiled.summary()["compiled_layers"] == 2
    assert zero3_run.summary()["compiled_layers"] == 0
    # One compile per rank for every step: each compiled forward splits at the eager attention
    # into graphs before and after it, the checkpointed layer's once without grad (forward
    # pass) and once with it (recompute): 10 graphs and 11 breaks seen per rank over 12 steps.
    # ZeRO-3's hooks inside the graph, or a graph per row width, give dozens or more.
    for probe, eager_probe in zip(compiled.probes(), zero3_run.probes(), strict=True):
        assert eager_probe["dynamo"]["graphs"] == 0
        assert 4 <= probe["dynamo"]["graphs"] <= 12, probe["dynamo"]
        assert probe["dynamo"]["graph_breaks"] <= 14, probe["dynamo"]
    # Inductor fuses the norms and the MLP's elementwise ops: fp32 rounding differs, so
    # 12 steps at lr 5e-3 agree to 1e-4, where a wrong graph (a lost LoRA weight, a skipped
    # recompute) moves the loss by far more.
    eager_losses, compiled_losses = zero3_run.losses(), compiled.losses()
    assert len(compiled_losses) == len(eager_losses) == 12
    for step, (a, b) in enumerate(zip(compiled_losses, eager_losses, strict=True), start=1):
        assert abs(a - b) < 1e-4, (step, a, b)
    eager = load_file(zero3_run.dir / "adapter" / "adapter_model.safetensors")
    ours = load_file(compiled.dir / "adapter" / "adapter_model.safetensors")
    assert eager.keys() == ours.keys()
    # Per tensor, relative to its size: single small entries drift further (1% seen) when the
    # fused kernels round differently over 12 Adam steps.
    for name in eager:
        drift = float((ours[name] - eager[name]).norm() / eager[name].norm())
        assert drift < 1e-3, (name, drift)


def test_checkpointed_layers_run_compiled_in_the_forward_and_in_the_recompute() -> None:
    """Every layer checkpointed, LoRA dropout on, one process: the compiled layers give the
    eager run's LoRA gradients (inductor draws dropout from torch's RNG, and the recompute
    replays the forward's masks), and the backward compiles graphs of its own — the recompute
    runs compiled, with grad, not eager as it would inside torch.utils.checkpoint."""
    import torch
    from torch._dynamo.utils import counters

    from memtune.rank.loss import CausalLMLoss
    from memtune.rank.model import compile_layers
    from tests.test_long_context import _assert_same, _grads, _model

    overrides = ("trainer.checkpoint_layers=all", "peft.dropout=0.2")
    cfg, model = _model(*overrides)
    want = _grads(cfg, model)
    cfg, model = _model(*overrides)
    assert compile_layers(model) == 2
    torch._dynamo.reset()
    counters.clear()
    vocab = cfg.model.architecture["vocab_size"]
    ids = torch.randint(0, vocab, (2, 96), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)  # as _grads: the same dropout masks as the eager run
    loss = CausalLMLoss(model, "chunked", 64)(input_ids=ids, labels=ids)
    forward_graphs = counters["stats"]["unique_graphs"]
    loss.backward()
    assert forward_graphs >= 1
    assert counters["stats"]["unique_graphs"] > forward_graphs, dict(counters["stats"])
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    _assert_same(want, got)
