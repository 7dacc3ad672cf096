"""Training on images (issue #49 items 3 and 4): tiny vision-language models of the released
classes, and what the planner counts of them.

The models are tiny ones of the real classes (memtune.tools.tiny.build_vision_language:
Qwen3-VL with deepstack, Qwen2.5-VL with windowed attention, Qwen3.5 with its linear
attention), saved with save_pretrained and loaded through memtune's own loading code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memtune.config import RunConfig, to_run_config
from memtune.config.architecture import resolve_architecture
from memtune.tools.tiny import build_vision_language
from tests.conftest import compose_cfg

FAMILIES = ("qwen3_vl", "qwen2_5_vl", "qwen3_5")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl-models")
    return {kind: build_vision_language(root / kind, kind) for kind in FAMILIES}


def vl_cfg(base: Path, *overrides: str) -> RunConfig:
    template = "qwen3_5" if base.name == "qwen3_5" else "chatml"
    cfg = to_run_config(
        compose_cfg(
            [
                "model=local",
                f"model.name_or_path={base}",
                f"data.template={template}",
                "peft.dropout=0",  # the same masks alone and packed
                "trainer.precision=fp32",
                "trainer.activation_checkpointing=false",
                *overrides,
            ]
        )
    )
    return resolve_architecture(cfg)[0]


def test_the_plan_counts_the_language_model_of_the_released_class(bases: dict[str, Path]) -> None:
    """Qwen3-VL's and Qwen2.5-VL's language models have no causal-LM class of their own: the
    planner counts them as Qwen3's and Qwen2's (memory.counts.TEXT_STAND_INS). The counts are
    those of the released class without its tower."""
    from transformers import AutoModelForImageTextToText

    from memtune.memory.counts import count_params

    for kind in ("qwen3_vl", "qwen2_5_vl"):
        cfg = vl_cfg(bases[kind])
        model = AutoModelForImageTextToText.from_pretrained(bases[kind])
        text = sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}")
        assert count_params(cfg).base == text, kind
