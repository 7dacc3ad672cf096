"""A base checkpoint's files, checked before any rank starts (launcher.prepare).

A download cut short, a weights file deleted, a config.json edited to another size or another
architecture, a folder saved without its tokenizer: each would otherwise end inside the ranks
(safetensors' "invalid header length", a state-dict size mismatch on every rank and a broken
pipe between them) or, worse, train: transformers loads what matches, drops the tensors the
class has no place for and draws the ones the weights lack at random, with a warning the ranks'
logs bury. Here each is one line naming the file and what is wrong.

What is read: every safetensors file's header (memtune.safetensors_check: every tensor's
name, shape and byte range; never a tensor), its size against the bytes the header needs,
and the model transformers would build from config.json, on the meta device (no memory, ~2 s
for a 7B), whose parameter names and shapes the headers are held to. Names are compared only
where the checkpoint uses the class's own names for most of its tensors: a multimodal
checkpoint read as its language model, a mixture's experts stored one by one (transformers
fuses them while loading) or pre-quantized weights are left to the loader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memtune.config.schema import ConfigError
from memtune.safetensors_check import model_weight_files, model_weights_problem, tensor_shapes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""A folder with none of these has no tokenizer: transformers then builds an empty one, and
every record tokenizes to nothing (the data step reports 0 samples, not why)."""


MIXTURE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
"""A config field that makes a mixture of experts (transformers' names across families)."""


def check_checkpoint(folder: Path, trust_remote_code: bool = False, weights: bool = True) -> None:
    """A local checkpoint's files, before any rank loads them (module docstring): its
    weights whole and matching the model its config.json describes, and a tokenizer. A
    ConfigError naming the file and what is wrong. ``weights`` False (preprocess_only: only
    the tokenizer is needed yet): a folder without weights passes; damaged ones do not."""
    problem = model_weights_problem(folder)  # every file whole, every shard there
    if problem:
        raise ConfigError(problem)
    files = model_weight_files(folder)
    if weights and not files and not any(folder.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"{folder} has a config.json and no weights (model.safetensors, its index, or "
            "pytorch_model.bin): a download cut short, or the wrong folder?"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer files "
            "of the model this checkpoint came from into it"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(tensor_shapes(f))
    if shapes:
        problem = names_and_shapes_problem(folder, shapes, trust_remote_code)
        if problem:
            raise ConfigError(problem)


def names_and_shapes_problem(
    folder: Path, shapes: dict[str, tuple[int, ...]], trust_remote_code: bool = False
) -> str | None:
    """How the weights' tensors differ from the parameters of the model config.json describes
    (built on the meta device, as ``AutoModelForCausalLM`` builds it): shapes, tensors the
    model has no place for, parameters the weights lack. None when they agree, or when the
    checkpoint does not use the class's names for most of its tensors (module docstring)."""
    model = _meta_model(folder, trust_remote_code)
    if model is None:
        return None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shared = shapes.keys() & expected.keys()
    text = model.config.get_text_config()
    # a mixture: checkpoints store the experts one by one, transformers fuses them while
    # loading (its conversion mapping), so its names differ by design: shapes compared only
    mixture = any(getattr(text, k, None) for k in MIXTURE_FIELDS)
    if len(shared) < len(shapes) / 2 and not mixture:
        return None
    config = folder / "config.json"
    wrong = sorted(k for k in shared if shapes[k] != expected[k])
    if wrong:
        listed = [f"{k} {list(shapes[k])} (the model: {list(expected[k])})" for k in wrong]
        return (
            f"{folder}: {len(wrong)} tensors in the weights do not have the shapes {config} "
            f"gives ({_some(listed, '; ')}): config.json and the weights come from different "
            "models; put the checkpoint's own config.json back"
        )
    if mixture:
        return None
    ignored = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    extra = sorted(
        k for k in shapes.keys() - expected.keys() if not any(p.search(k) for p in ignored)
    )
    if extra:
        kind = model.config.model_type
        return (
            f"{folder}: {len(extra)} tensors in the weights have no place in the {kind} model "
            f"its config.json describes ({_some(extra)}): they would be dropped. config.json "
            "names another architecture than the weights'; put the checkpoint's own "
            "config.json back"
        )
    # the class names its tied pairs whether or not this config ties them: only a tied head
    # may be absent from the weights (an untied one would start random)
    tied = (
        set(getattr(model, "_tied_weights_keys", None) or ()) if text.tie_word_embeddings else set()
    )
    ignored = _patterns(model, "_keys_to_ignore_on_load_missing")
    lacking = sorted(
        k
        for k in expected.keys() - shapes.keys()
        if k not in tied and not any(p.search(k) for p in ignored)
    )
    if lacking:
        return (
            f"{folder}: the weights lack {len(lacking)} of the model's tensors "
            f"({_some(lacking)}): they would start "
            "random. A weights file missing from the folder, or config.json from another model?"
        )
    return None


def _some(names: list[str], sep: str = ", ") -> str:
    """The first three of ``names``, and "..." when there are more."""
    return sep.join(names[:3]) + (f"{sep}..." if len(names) > 3 else "")


def _patterns(model: Any, attribute: str) -> list[re.Pattern[str]]:
    """A transformers class's name patterns its loader ignores (``attribute``)."""
    return [re.compile(p) for p in getattr(model, attribute, None) or ()]


def _meta_model(folder: Path, trust_remote_code: bool) -> Any:
    """The model config.json describes, on the meta device; None for a pre-quantized
    checkpoint (its packed tensors have other shapes) or one transformers builds no causal
    language model from. A config.json transformers refuses is a ConfigError."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers' own checks of the fields, in its words
        text = " ".join(str(err).split())
        raise ConfigError(f"{folder}/config.json: transformers cannot read it: {text}") from None
    if getattr(config, "quantization_config", None):
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # no causal-LM class for it: the loader says what it says
        return None
