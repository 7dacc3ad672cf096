"""Whether a folder holds a whole LoRA adapter, checked before anything loads it: the one check
``peft.init_from``, ``memtune merge`` and ``memtune generate`` share, so a damaged adapter is
one line naming its file instead of a JSONDecodeError, a SafetensorError in every rank, or
huggingface_hub's "Repo id must be in the form ..." (peft's answer to a folder without weights).

Reads ``adapter_config.json`` and the weights' safetensors header only, never the tensors, and
imports neither peft nor torch: train.py's checks before launch run it.
"""

from __future__ import annotations

import json
from pathlib import Path

from memtune.safetensors_check import safetensors_problem

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
OLD_WEIGHTS = "adapter_model.bin"
"""peft's pickled weights (older peft, or safe_serialization=False): peft still reads them; their
contents are not checked."""


def adapter_problem(folder: Path, weights_required: bool = False) -> str | None:
    """What keeps peft from loading the adapter in ``folder``, in words naming the file; None
    when it is whole: ``adapter_config.json`` parses, and is a LoRA config (peft_type LORA, a
    positive r, target modules) peft can read; the weights file exists and its safetensors
    header reads, the file as long as the header says. ``weights_required``: only
    adapter_model.safetensors will do (not peft's older adapter_model.bin)."""
    config_file = folder / CONFIG
    if not folder.is_dir():
        return f"{folder}: no such directory"
    if not config_file.is_file():
        return f"{folder} has no {CONFIG}: not an adapter"
    try:
        saved = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        return (
            f"{config_file} is not valid JSON ({err.msg} at line {err.lineno} column "
            f"{err.colno}): damaged"
        )
    except (OSError, UnicodeDecodeError) as err:
        return f"{config_file}: cannot read it ({err})"
    problem = _lora_config_problem(saved)
    if problem:
        return f"{config_file}: {problem}"
    weights = folder / WEIGHTS
    if not weights.is_file():
        if not weights_required and (folder / OLD_WEIGHTS).is_file():
            return None
        return f"{folder} has no {WEIGHTS} (the adapter's weights): saved only in part"
    return safetensors_problem(weights)


def _lora_config_problem(saved: object) -> str | None:
    """What in an adapter_config.json's contents peft cannot load as a LoRA adapter."""
    if not isinstance(saved, dict):
        return f"holds a JSON {type(saved).__name__}, not an adapter's settings"
    kind = saved.get("peft_type")
    if kind != "LORA":
        said = "no peft_type" if kind is None else f"peft_type {kind!r}"
        return f"{said}, not a LoRA adapter's settings (peft_type LORA)"
    r = saved.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        return f"r is {r!r}, not a positive whole number"
    alpha = saved.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return f"lora_alpha is {alpha!r}, not a number"
    targets = saved.get("target_modules")
    if not isinstance(targets, (str, list)) and not saved.get("target_parameters"):
        return "names no target_modules (the layers the adapter is for)"
    return None
