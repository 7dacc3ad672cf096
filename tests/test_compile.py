"""trainer.compile: regional torch.compile of the decoder layers (inductor on CPU) trains the
same run as eager, under ZeRO-3 with LoRA, next to a checkpointed layer that stays eager."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from memtune.launcher.prepare import decide, given_config
from tests.conftest import FAST, Run, compose_cfg, start_run

pytestmark = pytest.mark.slow


def test_compiled_layers_train_the_same_run_as_eager(zero3_run: Run, tmp_path: Path) -> None:
    compiled = start_run(
        tmp_path / "compiled",
        [
            *FAST,
            "zero=zero3",
            "launcher.num_ranks=2",
            "trainer.loss_chunk_tokens=16",
            "trainer.compile=true",
            # The first layer recomputes in backward and so stays eager (torch.utils.checkpoint
            # turns dynamo off); the second is compiled. On CPU ranks auto checkpoints none.
            "trainer.checkpoint_layers=1",
        ],
    )
    assert compiled.code == 0
    assert compiled.summary()["compiled_layers"] == 1
    assert zero3_run.summary()["compiled_layers"] == 0
    # One compile per rank for every step: the layer's forward splits at the eager attention
    # into a graph before and one after it (4 graphs and 5 breaks seen per rank); ZeRO-3's
    # hooks inside the graph, or a graph per row width, give dozens or more.
    for probe, eager_probe in zip(compiled.probes(), zero3_run.probes(), strict=True):
        assert eager_probe["dynamo"]["graphs"] == 0
        assert 2 <= probe["dynamo"]["graphs"] <= 4, probe["dynamo"]
        assert probe["dynamo"]["graph_breaks"] <= 8, probe["dynamo"]
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


@pytest.mark.parametrize(
    ("checkpoint_layers", "said"),
    [
        ("all", "trainer.compile=true compiles nothing here: all 2 layers recompute in backward"),
        ("1", "trainer.compile: 1 of 2 layers compiled; the 1 checkpointed ones run eager"),
        ("0", None),
    ],
)
def test_the_job_says_what_compile_reaches(
    checkpoint_layers: str, said: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any rank starts: checkpointed layers run eager, so compile with every layer
    checkpointed is a switch that does nothing, and the job says so."""
    overrides = [*FAST, "trainer.compile=true", f"trainer.checkpoint_layers={checkpoint_layers}"]
    decide(given_config(compose_cfg(overrides), inputs=False))
    out = capsys.readouterr().out
    if said is None:
        assert "trainer.compile" not in out, out
    else:
        assert said in out, out
