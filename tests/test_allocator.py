"""CUDA's caching allocator with expandable segments (trainer.expandable_segments; decisions.json
``cuda_allocator``): decided by the job from the setting and its environment, put in a rank's
environment before anything starts CUDA, never over settings the environment has."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memtune.config import to_run_config
from memtune.config.decisions import DecisionError, Decisions, cuda_allocator
from memtune.rank.worker import use_cuda_allocator
from tests.conftest import compose_cfg, decided


@pytest.mark.parametrize(
    ("overrides", "env", "expected"),
    [
        ([], {}, "expandable"),
        (["trainer.expandable_segments=false"], {}, "torch"),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "environment"),
        (["trainer.expandable_segments=false"], {"PYTORCH_ALLOC_CONF": "x:1"}, "environment"),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": ""}, "expandable"),  # set but empty: nothing given
    ],
)
def test_decided_from_the_setting_and_the_environment(
    overrides: list[str], env: dict[str, str], expected: str
) -> None:
    assert cuda_allocator(to_run_config(compose_cfg(overrides)), env) == expected


def test_decisions_json_holds_it_and_an_older_file_reads_as_torchs_defaults() -> None:
    d = decided(to_run_config(compose_cfg([])))
    raw = d.as_dict()
    assert raw["cuda_allocator"] == d.cuda_allocator and Decisions.from_dict(raw) == d
    del raw["cuda_allocator"]
    assert Decisions.from_dict(raw).cuda_allocator == "torch"
    with pytest.raises(DecisionError, match=r"cuda_allocator is 'big', not one of torch \|"):
        Decisions.from_dict({**raw, "cuda_allocator": "big"})


def test_a_rank_sets_it_only_where_nothing_is_set() -> None:
    env: dict[str, str] = {}
    assert use_cuda_allocator("expandable", env) == "expandable segments"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    said = use_cuda_allocator("expandable", mine)
    assert mine == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}  # the user's, untouched
    assert said == "PYTORCH_ALLOC_CONF=max_split_size_mb:64 (the environment's)"
    none: dict[str, str] = {}
    assert use_cuda_allocator("torch", none) == "torch's defaults" and none == {}
    lost: dict[str, str] = {}
    assert "did not reach this rank" in use_cuda_allocator("environment", lost) and lost == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_torch_runs_expandable_segments_on_a_gpu() -> None:
    """What a rank sets before CUDA starts is what torch's allocator then runs with."""
    code = (
        "import torch\n"
        "from memtune.rank.worker import use_cuda_allocator\n"
        "use_cuda_allocator('expandable')\n"
        "x = torch.empty(1 << 24, device='cuda')\n"
        "print(any(s.get('is_expandable') for s in torch.cuda.memory_snapshot()))\n"
    )
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
