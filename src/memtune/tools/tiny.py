"""Synthesize a tiny Qwen model and its tokenizer, for demos and tests.

Nothing can be downloaded here, so the demo model is built from its transformers config class
(``model_type`` qwen2, qwen3, qwen3_5_text, ...) with a fixed seed, saved with
``save_pretrained`` and then read back by the ranks through exactly the ``from_pretrained`` path
a real checkpoint takes. Its tokenizer is a byte-level BPE trained on the bundled demo data,
with Qwen's special tokens (and Qwen3's ``<think>`` / ``</think>`` for a qwen3 model) and a
ChatML chat template — or, given ``tokenizer_dir``, a real tokenizer copied from there (the
tests use Qwen's own). With a tower (model.vision: a ``vision_config``), the released
vision-language class is built, with its tower, Qwen's vision tokens and a preprocessor_config.json
(the image demo's model, conf/model/tiny-qwen3.5-vl.yaml, and the tests' Qwen3-VL and
Qwen2.5-VL).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memtune.config import ASSETS_DIR, ConfigError
from memtune.data.vision import PREPROCESSOR_CONFIG, family_image_processor
from memtune.filesystem import (
    follow_umask,
    host_pid_prefix,
    make_dirs,
    owned_temp_dir,
    refused_by,
    remove_left_by_dead,
    safetensors_write_errors,
    sibling_lock,
)
from memtune.integrity import MANIFEST, Store
from memtune.quiet import no_progress_bars

# Qwen2.5-Instruct's specials: pad is <|endoftext|>, an assistant turn ends with <|im_end|>.
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
THINK_TOKENS = ["<think>", "</think>"]  # Qwen3's: single tokens of their own

# ChatML as Qwen2.5 renders it, minus its implicit default system prompt: a system message
# appears only when the config gives one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_CORPUS = ASSETS_DIR / "demo_alpaca.jsonl"
_MARKER = "memtune_synth.json"
_BUILDER_VERSION = 2
"""2: the build sealed with a manifest (builds of 1 are replaced as older builds of ours)."""

DEMO_MODEL = Store("demo model", 1)
"""A synthesized model's folder, sealed with its manifest and verified on every launch that
uses it: a damaged one is set aside as ``.damaged-NAME.XXXX`` beside it and built again."""


def _fingerprint(
    architecture: dict[str, Any], tokenizer_dir: Path | None, vision: dict[str, Any]
) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(architecture, sort_keys=True).encode())
    if vision:  # (a text model's fingerprint as before towers: its build is kept)
        h.update(json.dumps(vision, sort_keys=True).encode())
    h.update(TOKENIZER_CORPUS.read_bytes())
    if tokenizer_dir is not None:
        for name in sorted(p.name for p in tokenizer_dir.iterdir() if p.is_file()):
            h.update(name.encode() + (tokenizer_dir / name).read_bytes())
    h.update(f"{_BUILDER_VERSION}".encode())
    return h.hexdigest()[:16]


def _corpus_texts() -> list[str]:
    texts = []
    for line in TOKENIZER_CORPUS.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        texts.append(f"user\n{rec['instruction']}\n\n{rec['input']}\nassistant\n{rec['output']}\n")
    return texts


def build_tokenizer(
    vocab_size: int, think_tokens: bool = False, extra_special: list[str] | None = None
):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[
            *SPECIAL_TOKENS,
            *(THINK_TOKENS if think_tokens else []),
            *(extra_special or []),
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, *(extra_special or [])],
        model_max_length=32768,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


class NotOurs(ConfigError):
    """A directory memtune would build a demo model in holds something it did not make (a
    config error: the job says it in one line before anything starts)."""


def is_synthesized(path: str | Path) -> bool:
    """Whether ``path`` is a demo model memtune built (it carries memtune's marker, or the
    manifest memtune seals it with: a build whose marker was lost is still memtune's)."""
    return (Path(path) / _MARKER).is_file() or DEMO_MODEL.is_ours(Path(path))


def _damage(path: Path, fingerprint: str) -> str | None:
    """What is wrong with memtune's build at ``path``; None for a sound build, of this
    fingerprint or an older one (an older build without a manifest, from before manifests, is
    replaced like any older build, not reported)."""
    if _current(path, fingerprint) or (path / MANIFEST).is_file():
        return DEMO_MODEL.problem(path)
    return None


def _current(path: Path, fingerprint: str) -> bool:
    marker = path / _MARKER
    try:
        return json.loads(marker.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def synthesize(
    path: str | Path,
    architecture: dict[str, Any],
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    vision: dict[str, Any] | None = None,
) -> Path:
    """Build model + tokenizer at ``path`` unless an identical build is already there; with
    ``vision`` (model.vision: a vision_config), the vision-language class with its tower.

    memtune replaces only what it built: an existing ``path`` without memtune's marker file is
    refused (:class:`NotOurs`), never deleted. The build goes to a temporary sibling that is
    renamed into place, under a lock, so a crash leaves no half-written model and two processes
    building the same model both end with it (the second finds the first's build).
    """
    path = Path(path)
    tok_dir = None if tokenizer_dir is None else Path(tokenizer_dir)
    vision = dict(vision or {})
    fingerprint = _fingerprint(architecture, tok_dir, vision)
    if _current(path, fingerprint) and DEMO_MODEL.problem(path) is None:
        return path  # before importing transformers: ~2 s of every start of the demo
    make_dirs(path.parent)
    with sibling_lock(path):  # one build at a time, across processes
        if _current(path, fingerprint) and DEMO_MODEL.problem(path) is None:
            return path  # another process built it while this one waited
        if path.exists() and not is_synthesized(path):
            raise NotOurs(
                f"{path} exists and memtune did not build it (no {_MARKER} in it): memtune "
                "builds demo models only where nothing is, and never replaces a directory it "
                "did not make"
            )
        problem = _damage(path, fingerprint) if path.exists() else None
        if problem is not None:
            try:
                aside = DEMO_MODEL.set_aside(path)
            except OSError as err:
                raise ConfigError(
                    f"demo model {path} is damaged ({problem}) and cannot be set aside "
                    f"({err.strerror}{refused_by(path, err)}): point MEMTUNE_CACHE_DIR at a "
                    "folder memtune can write"
                ) from None
            print(DEMO_MODEL.damaged_line(path, problem, aside, "building it again"), flush=True)
        _build(path, architecture, vision, seed, tok_dir, fingerprint)
    return path


ASIDE = ".{}.old-"
"""An older build set aside while the new one is renamed into place, then removed:
``.NAME.old-<host>-<pid>-XXXXXXXX``. A kill between the two leaves it (a whole model, one per
kill); the next build removes it (:func:`remove_left_by_dead`). It is not locked as the build's
own dir is (a rename onto it would leave the lock behind on the empty dir it replaced): the
build lock, which the next build holds while it looks, rules out a live writer of it, in this
PID namespace or another, so the dead pid is enough."""


def _build(
    path: Path,
    architecture: dict[str, Any],
    vision: dict[str, Any],
    seed: int,
    tok_dir: Path | None,
    fingerprint: str,
) -> None:
    # Under the build lock: a build killed before its rename left its model beside it, one
    # killed between setting the older build aside and removing it that older build.
    remove_left_by_dead(path.parent, f".{path.name}.", f"a build of {path.name}")
    remove_left_by_dead(path.parent, ASIDE.format(path.name), f"the replaced build of {path.name}")
    tmp = owned_temp_dir(path.parent, f".{path.name}.")
    old = None
    try:
        with _write_errors_named(tmp, path):
            if vision:
                _write_vision_language(tmp, architecture, vision, seed)
            else:
                _write_text(tmp, architecture, seed, tok_dir)
            (tmp / _MARKER).write_text(json.dumps({"fingerprint": fingerprint, "seed": seed}))
            DEMO_MODEL.seal(tmp)  # last: a build without its manifest is never used
        follow_umask(tmp)  # mkdtemp's 0700, safetensors' 0600: a shared cache needs the umask's
        if path.exists():  # an older build of ours (synthesize checked the marker): set aside
            old = Path(
                tempfile.mkdtemp(prefix=host_pid_prefix(ASIDE.format(path.name)), dir=path.parent)
            )
            os.replace(path, old)  # onto the empty dir just made
        os.replace(tmp, path)
    finally:
        for ours in (tmp, old):
            if ours is not None and ours.exists():
                shutil.rmtree(ours, ignore_errors=True)


@contextlib.contextmanager
def _write_errors_named(tmp: Path, path: Path) -> Iterator[None]:
    """A write into the build's ``tmp`` that fails (a full disk) as an OSError named for the
    model's ``path``, not its temporary sibling (removed by then): the caller's full-disk line
    names what the user can act on. The weights' SafetensorError is such an OSError too (it
    passed the caller's handling: the start it stopped was a traceback). An error of a file
    read from elsewhere (tokenizer_dir) keeps its own name."""
    try:
        with safetensors_write_errors(tmp):
            yield
    except OSError as err:
        if err.filename is not None and not str(err.filename).startswith(str(tmp)):
            raise
        raise type(err)(err.errno, err.strerror, str(path)) from err


def _write_text(path: Path, architecture: dict[str, Any], seed: int, tok_dir: Path | None) -> None:
    """A text model of ``architecture`` (a causal-LM class) and its tokenizer, into ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_type = architecture.get("model_type", "qwen2")
    if tok_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        think = model_type.startswith("qwen3")  # Qwen3 and Qwen3.5 have think tokens
        tokenizer = build_tokenizer(int(architecture["vocab_size"]), think)
    arch = {k: v for k, v in architecture.items() if k != "model_type"}
    config = AutoConfig.for_model(
        model_type,
        **arch,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with no_progress_bars():  # one tiny shard: a bar would only be noise
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)


VISION_SPECIAL_TOKENS = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
"""The Qwen VL tokens (memtune.data.vision), single special tokens of a tiny model's BPE."""

TINY_VISION_LANGUAGE = {
    "qwen3_5": "tiny-qwen3.5-vl",
    "qwen3_vl": "tiny-qwen3-vl",
    "qwen2_5_vl": "tiny-qwen2.5-vl",
}
"""The tiny vision-language model of each family memtune trains on images: its model group
(conf/model/), whose ``architecture`` and ``vision`` are the one place its widths, depths and
tower are set (the real patch, merge and temporal sizes, mRoPE proportions, deepstack and
windows)."""


def tiny_vision_architecture(model_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The architecture and the tower (model.vision) of the tiny ``model_type`` (a
    :data:`TINY_VISION_LANGUAGE` key), as its model group composes them."""
    from omegaconf import OmegaConf

    from memtune.config import compose

    model = OmegaConf.to_container(
        compose([f"model={TINY_VISION_LANGUAGE[model_type]}"]).model, resolve=True
    )
    assert isinstance(model, dict)
    return dict(model["architecture"]), dict(model["vision"])


def build_vision_language(path: str | Path, model_type: str, seed: int = 0) -> Path:
    """A tiny vision-language checkpoint of ``model_type`` (a :data:`TINY_VISION_LANGUAGE`
    key) at ``path``, as its model group builds it in memtune's cache, written in place (tests
    build it in a folder of their own)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_vision_language(path, *tiny_vision_architecture(model_type), seed)
    return path


def _write_vision_language(
    path: Path, architecture: dict[str, Any], vision: dict[str, Any], seed: int
) -> None:
    """The released vision-language class (``AutoModelForImageTextToText``) of
    ``architecture`` with the tower ``vision``, random weights from ``seed``, saved with
    ``save_pretrained`` beside a byte-level BPE with Qwen's specials and vision tokens and a
    preprocessor_config.json, so that every loader reads it as it reads a released checkpoint.
    The class's model type is the language model's without ``_text`` (qwen3_5_text: qwen3_5)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from memtune.config.architecture import VISION_LANGUAGE_TYPES

    text = dict(architecture)
    model_type = str(text["model_type"]).removesuffix("_text")
    if model_type not in VISION_LANGUAGE_TYPES:
        raise ConfigError(
            f"model.vision is set, and model.architecture's model_type is {text['model_type']}: "
            "memtune builds tiny vision-language models of "
            f"{', '.join(VISION_LANGUAGE_TYPES)} only (model_type qwen3_5_text, qwen3_vl_text or "
            "qwen2_5_vl_text)"
        )
    tie = bool(text.pop("tie_word_embeddings", False))
    tokenizer = build_tokenizer(
        int(text["vocab_size"]),
        think_tokens=model_type.startswith("qwen3"),
        extra_special=VISION_SPECIAL_TOKENS,
    )
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_SPECIAL_TOKENS}
    text |= {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    config = AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config={"out_hidden_size": text["hidden_size"], **vision},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with no_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # the family's image settings (its mean and std), at the tiny models' pixel limits
    preprocessor = family_image_processor(model_type, vision, tiny=True)
    preprocessor["image_processor_type"] = "Qwen2VLImageProcessor"
    (path / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor, indent=2) + "\n")
