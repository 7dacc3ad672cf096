"""The pieces of the non-finite guard that need no ranks (the launches are in test_launch)."""

from __future__ import annotations

import math

import pytest
import torch

from memtune.rank.loop import NonFiniteLoss, TrainResult, _note_skip, _poisoned_scale
from memtune.rank.telemetry import NullLogger


def test_an_infinite_loss_can_have_finite_gradients_so_the_scale_poisons_them() -> None:
    # The loss value is inf, but its gradient with respect to w is finite (0 + 1).
    w = torch.tensor([3.0], requires_grad=True)
    loss = torch.where(w > 0, torch.tensor(math.inf), w).sum() + w.sum()
    loss.backward(retain_graph=True)
    assert not math.isfinite(float(loss)) and torch.isfinite(w.grad).all()

    w.grad = None
    (loss * _poisoned_scale(loss, 0.5)).backward()
    assert torch.isnan(w.grad).all()


def test_the_scale_is_untouched_for_a_finite_loss() -> None:
    assert float(_poisoned_scale(torch.tensor(2.0), 0.25)) == 0.25
    assert math.isnan(float(_poisoned_scale(torch.tensor(math.nan), 0.25)))


def test_skips_are_recorded_and_too_many_in_a_row_stop() -> None:
    result = TrainResult()
    for step in (2, 3, 5, 6):
        _note_skip(step, math.nan, result, NullLogger(), "skip", max_skipped=3)
    assert result.skipped == [2, 3, 5, 6]
    with pytest.raises(NonFiniteLoss, match=r"3 steps in a row.*step 4"):
        _note_skip(7, math.nan, result, NullLogger(), "skip", max_skipped=3)


def test_stop_mode_names_the_cause() -> None:
    with pytest.raises(NonFiniteLoss, match=r"gradient norm is not finite.*untouched"):
        _note_skip(4, 1.5, TrainResult(), NullLogger(), "stop", max_skipped=10)
