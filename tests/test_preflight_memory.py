"""The GPU preflight's free-memory refusal, as a pure function of the facts it records (no GPU
here): a card the ranks will use with less free memory than the plan's per-rank peak is refused
before launch, named with its free GiB and the processes nvidia-smi says hold it."""

from __future__ import annotations

import pytest

from memtune.launcher.preflight import (
    PreflightError,
    compute_apps_by_card,
    describe,
    planned_device_gib,
    short_cards,
)
from memtune.launcher.prepare import decide
from tests.conftest import compose_cfg


def _card(index: int, free: float, processes: list[str] | None = None) -> dict:
    return {
        "index": index,
        "name": "NVIDIA GeForce RTX 4090 D",
        "total_gib": 23.99,
        "free_gib": free,
        "sm": "89",
        "processes": processes or [],
    }


def _facts(*cards: dict) -> dict:
    return {"count": len(cards), "gpus": list(cards), "driver": "570.1", "torch": "2.13",
            "cuda": "12.8", "visible_devices": None}  # fmt: skip


def test_a_card_with_less_free_memory_than_planned_is_refused_by_name() -> None:
    desktop = ["2101 /usr/lib/xorg/Xorg (412 MiB)", "3377 /opt/other/python (9120 MiB)"]
    facts = _facts(_card(0, 23.51), _card(1, 14.02, desktop), _card(2, 23.5), _card(3, 16.0))
    line = short_cards(facts, 4, 21.37)
    assert line == (
        "the plan needs 21.37 GiB per rank, and cuda:1 NVIDIA GeForce RTX 4090 D has 14.02 GiB "
        "free of 23.99; held by 2101 /usr/lib/xorg/Xorg (412 MiB), 3377 /opt/other/python "
        "(9120 MiB); cuda:3 NVIDIA GeForce RTX 4090 D has 16.00 GiB free of 23.99: free the "
        "card(s), choose others (CUDA_VISIBLE_DEVICES), or set plan.device_gib to what is free"
    )
    assert "\n" not in line
    # only the cards the ranks use: two ranks run on cards 0 and 1, and card 3 is not named
    two = short_cards(facts, 2, 21.37)
    assert two is not None and "cuda:1" in two and "cuda:3" not in two and "cuda:0" not in two
    # every card with room (free exactly the plan's figure fits), or facts recorded before
    # free memory was: nothing to refuse
    assert short_cards(facts, 1, 21.37) is None
    assert short_cards(_facts(_card(0, 21.37)), 1, 21.37) is None
    old = _facts(_card(0, 1.0))
    del old["gpus"][0]["free_gib"]
    assert short_cards(old, 1, 21.37) is None
    assert issubclass(PreflightError, RuntimeError)  # reported like a config error


def test_the_preflight_says_each_cards_free_memory() -> None:
    record = {"facts": _facts(_card(0, 14.02)), "checks": {}, "reasons": []}
    assert "  cuda:0 NVIDIA GeForce RTX 4090 D · 24.0 GiB (14.0 free) · sm_89" in describe(
        record, 1
    )


def test_nvidia_smis_compute_apps_by_card_without_the_preflight_itself() -> None:
    text = (
        "GPU-58a6d1a6-0b1c-4c1e-9d2e-111111111111, 2101, /usr/lib/xorg/Xorg, 412 MiB\n"
        "GPU-58a6d1a6-0b1c-4c1e-9d2e-111111111111, 777, python -m memtune.launcher, 300 MiB\n"
        "GPU-22222222-0b1c-4c1e-9d2e-222222222222, 3377, /opt/a,b/python, 9120 MiB\n"
        "No running processes found\n"
    )
    assert compute_apps_by_card(text, own_pid=777) == {
        # torch names a card by its uuid without nvidia-smi's "GPU-"
        "58a6d1a6-0b1c-4c1e-9d2e-111111111111": ["2101 /usr/lib/xorg/Xorg (412 MiB)"],
        "22222222-0b1c-4c1e-9d2e-222222222222": ["3377 /opt/a,b/python (9120 MiB)"],
    }
    assert compute_apps_by_card("", own_pid=1) == {}


@pytest.mark.parametrize("experiment", ["qwen2.5-7b-4x4090-qlora", "qwen2.5-7b-4x4090-lora"])
def test_the_figure_compared_is_the_plans_per_rank_peak(experiment: str) -> None:
    from memtune.config import to_run_config

    fitted = decide(to_run_config(compose_cfg([f"experiment={experiment}"])), say=False)
    planned = fitted.plan
    peak = planned_device_gib(planned)
    loading = planned.loading.device_gib if planned.loading is not None else 0.0
    # the card is seen with the preflight's own CUDA context on it: the plan's context row is
    # the rank's, which takes its place
    assert planned.gib()["CUDA context + workspaces"] == pytest.approx(1.3)
    assert peak == pytest.approx(max(planned.total_gib - 1.3, loading))
    assert 10 < peak <= 23.99  # the shipped experiment fits its 24 GB cards by the plan
    # a 16 GB card under the 24 GB experiment is refused; a free 24 GB card is not
    assert short_cards(_facts(_card(0, 15.6)), 1, peak) is not None
    assert short_cards(_facts(_card(0, 23.6)), 1, peak) is None
