"""Known third-party noise is dropped at its logger, and only it (memtune.quiet, installed by
``import memtune`` in every memtune process, the ranks included)."""

from __future__ import annotations

import logging

import pytest
import torch

import memtune  # noqa: F401 (installs the filters, as in every rank)
from memtune import quiet


def test_bitsandbytes_int8_cast_notice_is_dropped_and_its_other_warnings_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """bitsandbytes 0.50.2 logs this through its module's logger on every LLM.int8 matmul of a
    bf16 run on GPUs (autograd/_functions.py, MatMul8bitLt.forward): the same call here."""
    from bitsandbytes.autograd import _functions

    assert quiet._installed
    assert _functions.logger.name == "bitsandbytes.autograd._functions"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            _functions.logger.warning(
                "MatMul8bitLt: inputs will be cast from %s to float16 during quantization",
                torch.bfloat16,
            )
        _functions.logger.warning("MatMul8bitLt: something else")
    assert [r.getMessage() for r in caplog.records] == ["MatMul8bitLt: something else"]
