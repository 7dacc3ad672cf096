"""The GPU check's profile phases put each operator in one kind by what it is and where it
runs (bench/gpu_check/profile.py); the phases themselves run in .ci/run's dry run."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def profile():
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import profile as module

    return module


def test_each_operator_has_one_kind_by_shape_and_scope(profile) -> None:
    kind, r, vocab = profile.kind_of, 16, 152064
    assert kind("aten::mm", [[2048, 3584], [3584, 18944]], set(), r, vocab) == "base GEMMs"
    assert kind("aten::mm", [[2048, 3584], [3584, 16]], set(), r, vocab) == "LoRA GEMMs"
    assert kind("aten::mm", [[512, 3584], [3584, 152064]], set(), r, vocab) == "loss head"
    assert kind("aten::_log_softmax", [], set(), r, vocab) == "loss head"
    assert kind("aten::bernoulli_", [[2048, 3584]], set(), r, vocab) == "LoRA dropout"
    assert kind("aten::_flash_attention_forward", [], set(), r, vocab) == "attention"
    assert kind("aten::rsqrt", [], set(), r, vocab) == "norms and elementwise"
    assert kind("aten::copy_", [], set(), r, vocab) == "copies"
    assert kind("nccl:all_reduce", [], set(), r, vocab) == "communication"
    # the scope decides first: a GEMM in the recompute, anything in the optimizer step
    recompute = {"autograd::engine::evaluate_function: X", profile.SCOPE_RECOMPUTE}
    assert kind("aten::mm", [[2048, 3584], [3584, 16]], recompute, r, vocab).startswith("recompute")
    optimizer = {profile.SCOPE_OPTIMIZER}
    assert kind("aten::_foreach_mul_", [], optimizer, r, vocab) == "optimizer and ZeRO"
    assert kind("dequantize_4bit", [], set(), r, vocab) == "4-bit dequantization"
