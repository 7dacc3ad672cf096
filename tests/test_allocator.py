"""CUDA's caching allocator with expandable segments (trainer.expandable_segments; decisions.json
``cuda_alloc_conf``): decided by the job from the setting and its environment, carried to every
rank by decisions.json, put in a rank's environment before anything starts CUDA, never over
settings the rank's environment has."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memtune.config import to_run_config
from memtune.config.decisions import DecisionError, Decisions, cuda_alloc_conf
from memtune.rank.worker import use_cuda_allocator
from tests.conftest import compose_cfg, decided

EXPANDABLE = "expandable_segments:True"


@pytest.mark.parametrize(
    ("overrides", "env", "expected"),
    [
        ([], {}, EXPANDABLE),
        (["trainer.expandable_segments=false"], {}, ""),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "max_split_size_mb:128"),
        (["trainer.expandable_segments=false"], {"PYTORCH_ALLOC_CONF": "x:1"}, "x:1"),
        # both set: torch reads PYTORCH_ALLOC_CONF first
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}, "b:2"),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": ""}, EXPANDABLE),  # set but empty: nothing given
    ],
)
def test_decided_from_the_setting_and_the_environment(
    overrides: list[str], env: dict[str, str], expected: str
) -> None:
    assert cuda_alloc_conf(to_run_config(compose_cfg(overrides)), env) == expected


def test_decisions_json_holds_it_and_an_older_file_reads_as_torchs_defaults() -> None:
    d = decided(to_run_config(compose_cfg([])))
    raw = d.as_dict()
    assert raw["cuda_alloc_conf"] == d.cuda_alloc_conf and Decisions.from_dict(raw) == d
    del raw["cuda_alloc_conf"]
    assert Decisions.from_dict(raw).cuda_alloc_conf == ""
    with pytest.raises(DecisionError, match=r"cuda_alloc_conf must be a string \(got 3\)"):
        Decisions.from_dict({**raw, "cuda_alloc_conf": 3})


def test_a_rank_sets_it_only_where_nothing_is_set() -> None:
    env: dict[str, str] = {}
    assert use_cuda_allocator(EXPANDABLE, env) == "expandable segments"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    # a hostfile rank on another node: the job's own settings arrive by decisions.json
    remote: dict[str, str] = {}
    assert use_cuda_allocator("max_split_size_mb:64", remote) == (
        "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64"
    )
    assert remote == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    mine = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    said = use_cuda_allocator(EXPANDABLE, mine)
    assert mine == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}  # the rank's own, untouched
    assert said == (
        "PYTORCH_ALLOC_CONF=max_split_size_mb:64 (this rank's environment; decided: "
        "expandable segments)"
    )
    same = {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert use_cuda_allocator(EXPANDABLE, same) == "expandable segments"
    none: dict[str, str] = {}
    assert use_cuda_allocator("", none) == "torch's defaults" and none == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_torch_runs_expandable_segments_on_a_gpu() -> None:
    """What a rank sets before CUDA starts is what torch's allocator then runs with."""
    code = (
        "import torch\n"
        "from memtune.rank.worker import use_cuda_allocator\n"
        "use_cuda_allocator('expandable_segments:True')\n"
        "x = torch.empty(1 << 24, device='cuda')\n"
        "print(any(s.get('is_expandable') for s in torch.cuda.memory_snapshot()))\n"
    )
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
