"""Read training records from files or datasets into one shape: a list of chat messages.

Formats
- ``alpaca``: instruction / input / output, optional ``system`` and ``history``
  (``[[user, assistant], ...]`` turns before this one).
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI style) or
  ShareGPT's ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``, with an
  optional ``system`` beside the turns (ShareGPT's system prompt, as LLaMA-Factory has it;
  a record with it and a system turn too is bad). Either key style may be under either name:
  a list's first turn says which. Tool use in OpenAI's and ShareGPT's shapes (a ``tools``
  list, ``tool_calls``, ``tool`` / ``observation`` / ``function_call`` turns) is read as
  :mod:`memtune.data.tool_calls` says. An assistant turn may carry ``reasoning_content`` (its
  thinking, rendered by the qwen3 and qwen3_5 templates). Images, in user turns, in either of
  the two shapes people have:

  - Qwen's / Hugging Face's: a user turn's ``content`` is a list of parts,
    ``{"type": "image", "image": PATH}`` and ``{"type": "text", "text": ...}``;
  - ShareGPT's (LLaMA-Factory's): ``<image>`` placeholders in the text and an ``images`` list
    beside the turns, one image per placeholder, in order.

  An image is a path (relative to the data file's folder, or absolute), or bytes in a column
  (a ``datasets`` Image feature: ``{"bytes": ..., "path": ...}``). The turn's text gets the
  chat templates' ``<|vision_start|><|image_pad|><|vision_end|>`` where each image is, and
  :attr:`Record.images` the images in that order (read and resized later, when encoding:
  :mod:`memtune.data.vision`).
- ``text``: ``{"text": ...}`` for plain continued pre-training (every token is a label).
- ``preference``: a prompt with a preferred (``chosen``) and a dispreferred (``rejected``)
  reply, for the preference objectives (trainer.objective=dpo, ipo, simpo, orpo). The shapes
  Hugging Face preference datasets come in (TRL's "standard" and "conversational" ones):

  - strings: ``{"prompt": str, "chosen": str, "rejected": str}``, optional ``"system"``;
    the prompt is one user turn.
  - implicit prompt: ``chosen`` and ``rejected`` are whole conversations (message lists,
    OpenAI or ShareGPT keys) that share every turn but the last, an assistant reply. A string
    ``prompt`` next to them is taken as a copy of their first user turn and not read, as TRL
    reads it (HuggingFaceH4/ultrafeedback_binarized carries one).
  - explicit prompt: ``prompt`` is a message list and ``chosen`` / ``rejected`` are what
    follows it: the reply turn(s) as a message list, or the reply as a string.

  A pair is :attr:`Record.pair`; a pair whose replies are the same is a bad record
  (:class:`IdenticalReplies`): it has nothing to prefer.

Sources: ``.jsonl``, ``.json`` (an array), ``.parquet``, a folder written by
``datasets.Dataset.save_to_disk``, or a hub dataset name (where the hub is reachable), all
uncompressed (a compressed file is refused by its format, with the command that undoes it).
Every bad record raises :class:`RecordError` with file, line (or row) and field; a source that
cannot be read as a whole (a cut parquet file, a folder that is not a whole ``datasets``
folder) raises it with the file's name alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from memtune.data import tool_calls
from memtune.data.vision import (
    IMAGE_PLACEHOLDER,
    SHAREGPT_PLACEHOLDER,
    VISION_TOKENS,
    ImageRef,
)
from memtune.paths import hub_dataset

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}


class RecordError(ValueError):
    """One unusable record; ``where`` is ``file:line`` (or ``file row N``)."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


class IdenticalReplies(RecordError):
    """A preference pair whose chosen and rejected replies are the same: a bad record like any
    other (data.on_bad_record), told apart so that the counts can say how many were this —
    in a scraped preference set they are usually many, and a sign of a broken export."""


class WrongFormat(RecordError):
    """A record shaped as another format's (a ShareGPT file read as alpaca), before any record
    of its source was read well: the whole file is usually so, and skipping such records
    (data.on_bad_record=skip) would skip them all. After one, it is one stray record
    (:func:`read_source`), said as the field it lacks (``stray``)."""

    def __init__(self, where: str, message: str, stray: str):
        super().__init__(where, message)
        self.stray = stray


FORMAT_MARKS = {
    "preference": ("chosen", "rejected"),
    "alpaca": ("instruction",),
    "messages": ("messages", "conversations"),
    "text": ("text",),
}
"""The keys that make a record one format's: any of them (preference: both), the most
specific first (a LLaMA-Factory preference record has 'conversations' and both replies)."""


def _shaped_as(raw: dict[str, Any], fmt: str) -> bool:
    marks = FORMAT_MARKS[fmt]
    return all(k in raw for k in marks) if fmt == "preference" else any(k in raw for k in marks)


def _check_format(raw: dict[str, Any], fmt: str, where: str) -> None:
    """A record without ``fmt``'s keys and with another format's: named as that format's."""
    if _shaped_as(raw, fmt):
        return
    other = next((f for f in FORMAT_MARKS if f != fmt and _shaped_as(raw, f)), None)
    if other is None:
        return  # no format's keys: the reader's own message names the missing field
    keys = ", ".join(repr(k) for k in FORMAT_MARKS[other] if k in raw)
    lacks = " or ".join(repr(k) for k in FORMAT_MARKS[fmt])
    raise WrongFormat(
        where,
        f"a {other} record (it has {keys}), read as data.format={fmt}: set data.format={other}",
        f"field {lacks} is missing (the record has {other}'s {keys})",
    )


Pair = tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]
"""(prompt, chosen reply, rejected reply): the prompt is system?, then alternating user /
assistant turns ending with a user turn; each reply is one assistant message."""


@dataclass
class Record:
    where: str
    messages: list[dict[str, Any]] | None = None
    """system?, then alternating user / assistant turns, ending with an assistant turn."""
    text: str | None = None
    pair: Pair | None = None
    """format preference: the shared prompt and the two replies to it (see :data:`Pair`)."""
    images: list[ImageRef] = field(default_factory=list)
    """format messages: the images of the user turns, in the order of their placeholders
    (:data:`memtune.data.vision.IMAGE_PLACEHOLDER`) in the text."""
    tools: list[dict[str, Any]] | None = None
    """format messages and preference: the functions the conversation offers (its ``tools``),
    rendered in its system turn (:mod:`memtune.data.tool_calls`)."""

    def conversations(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A pair as the two conversations it stands for: prompt + chosen, prompt + rejected."""
        assert self.pair is not None
        prompt, chosen, rejected = self.pair
        return [*prompt, chosen], [*prompt, rejected]


def iter_raw(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record) from any supported source, in file order."""
    p = Path(path).expanduser()
    hub = hub_dataset(path)
    if hub is not None:
        yield from _iter_hub(path, *hub)
        return
    if p.is_dir():
        yield from _iter_dataset_dir(p)
    elif p.suffix == ".parquet":
        yield from _iter_parquet(p)
    elif p.suffix == ".json":
        yield from _iter_json_array(p)
    else:
        yield from _iter_jsonl(p)


COMPRESSED = {
    b"\x1f\x8b": ("gzip", ".gz", "gzip -dc"),
    b"BZh": ("bzip2", ".bz2", "bzip2 -dc"),
    b"\xfd7zXZ\x00": ("xz", ".xz", "xz -dc"),
    b"\x28\xb5\x2f\xfd": ("zstd", ".zst", "zstd -dc"),
    b"PK\x03\x04": ("zip", ".zip", "unzip -p"),
}
"""What a compressed file starts with: (its format, its usual suffix, the command that writes
it out decompressed)."""


def _refuse_compressed(p: Path, head: bytes) -> None:
    """A compressed .jsonl / .json (``head``: the file's first bytes) is refused by name, with
    the command that decompresses it.

    memtune reads them uncompressed; read as text, a gzip file's first line is "not UTF-8
    (byte 1)", which says nothing of the cause. Decompressing is one command; reading them
    compressed would also have to reach the cache key's scan for image paths, which reads a
    source's raw bytes."""
    for magic, (kind, suffix, command) in COMPRESSED.items():
        if head.startswith(magic):
            out = p.stem if p.suffix == suffix else f"{p.stem}.uncompressed{p.suffix}"
            raise RecordError(
                str(p),
                f"the file is {kind}-compressed, and memtune reads .jsonl and .json files "
                f"uncompressed: decompress it ({command} {p.name} > {out}) and give that file",
            )


def _iter_jsonl(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        f = p.open("rb")
    except OSError as err:
        raise RecordError(str(p), f"cannot read ({err.strerror})") from err
    with f:
        _refuse_compressed(p, f.read(8))
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, RecordError(where, f"not UTF-8 (byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.rstrip("\r\n"))  # a cut line: its own column
            except json.JSONDecodeError as err:
                yield where, RecordError(where, f"invalid JSON ({err.msg}, column {err.colno})")


def _iter_json_array(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise RecordError(str(p), f"cannot read ({err.strerror})") from err
    _refuse_compressed(p, raw[:8])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(str(p), f"not UTF-8 (byte {err.start})") from err
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError(f"{p}:{err.lineno}", f"invalid JSON ({err.msg})") from err
    if not isinstance(records, list):
        raise RecordError(str(p), "expected a JSON array of records (or use .jsonl)")
    for i, rec in enumerate(records):
        yield f"{p} record {i}", rec


def _iter_parquet(p: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as err:
        why = str(err).removeprefix(f"Could not open Parquet input source '{p}': ").rstrip(".")
        raise RecordError(
            str(p),
            f"cannot be read as parquet ({why}): it is cut short or not a parquet file; write "
            "it again (or copy it whole), or give a .jsonl or .json file",
        ) from None
    for i, rec in enumerate(rows):
        yield f"{p} row {i}", rec


DATASET_DIR_FILES = ("state.json", "dataset_dict.json")
"""What ``datasets.Dataset.save_to_disk`` (a Dataset / a DatasetDict) writes in its folder."""


def _iter_dataset_dir(p: Path) -> Iterator[tuple[str, Any]]:
    """A ``save_to_disk`` folder's rows. Anything else given as a folder (an empty one, a
    folder of .jsonl files, a folder named like a file), or such a folder with a file missing
    or cut, is a RecordError naming the folder: ``datasets`` says it with a traceback."""
    import pyarrow as pa
    from datasets import load_from_disk

    if not any((p / name).is_file() for name in DATASET_DIR_FILES):
        held = sorted(f.name for f in p.iterdir())
        what = (
            "it is empty"
            if not held
            else f"it holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}"
        )
        raise RecordError(
            str(p),
            f"a folder, and not one written by datasets' save_to_disk ({what}; no "
            f"{' or '.join(DATASET_DIR_FILES)}): give a .jsonl, .json or .parquet file, or "
            "such a folder (several files: data.sources)",
        )
    try:
        ds = load_from_disk(str(p))
    except FileNotFoundError as err:
        missing = err.filename or err
        raise RecordError(
            str(p),
            f"the datasets folder is incomplete: {missing} is missing; save it again with "
            "save_to_disk, or copy the folder whole",
        ) from None
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as err:
        # KeyError, TypeError: a state.json or dataset_info.json without what datasets reads
        # (its "_data_files", a field of another type): a traceback from inside datasets
        why = f"{type(err).__name__}: {err}" if isinstance(err, KeyError | TypeError) else err
        raise RecordError(
            str(p), f"the datasets folder cannot be read ({why}); save it again with save_to_disk"
        ) from None
    if hasattr(ds, "keys"):  # a DatasetDict: take its train split
        if "train" not in ds:
            raise RecordError(str(p), f"a DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    rows = _undecoded_rows(ds) if _has_images(ds.features) else iter(ds)
    for i, rec in enumerate(rows):
        yield f"{p} row {i}", rec


def _has_images(features: Any) -> bool:
    """``features`` (a datasets Features, or a part of one) holds an Image feature."""
    from datasets import Image

    if isinstance(features, Image):
        return True
    if isinstance(features, dict):
        return any(_has_images(f) for f in features.values())
    if isinstance(features, list | tuple):
        return any(_has_images(f) for f in features)
    inner = getattr(features, "feature", None)  # Sequence / List
    return inner is not None and _has_images(inner)


def _undecoded_rows(ds: Any) -> Iterator[dict[str, Any]]:
    """The rows as stored: an Image feature as ``{"bytes": ..., "path": ...}``, not decoded
    into PIL images (the encoder decodes and checks each, and the cache key hashes the bytes
    on disk)."""
    for batch in ds.with_format("arrow").iter(batch_size=1000):
        yield from batch.to_pylist()


def _iter_hub(source: str, name: str, split: str) -> Iterator[tuple[str, Any]]:
    """The rows of split ``split`` of hub dataset ``name`` (``source``: as the user wrote it).
    Any failure of ``datasets`` to load it (no such dataset or split, the hub unreachable, a
    gated one) is the source's one line, its own first line kept: it was a traceback."""
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split)
    except Exception as err:  # datasets raises many kinds: each one is this source's problem
        reason = (str(err).strip().splitlines() or [""])[0]
        raise RecordError(
            source,
            f"no such file or folder on this machine, and datasets could not load it as a "
            f"Hugging Face dataset, split {split!r} ({type(err).__name__}: {reason})",
        ) from None
    rows = _undecoded_rows(ds) if _has_images(ds.features) else iter(ds)
    for i, rec in enumerate(rows):
        yield f"{source} row {i}", rec


def _string(rec: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    value = rec.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}, not a string"
        raise RecordError(where, f"field {key!r} is {what}")
    return value


def parse(raw: Any, fmt: str, where: str, base: Path | None = None) -> Record:
    """One raw record in format ``fmt``. ``base``: the folder that image paths are relative
    to (the data file's; None: the working directory)."""
    if isinstance(raw, RecordError):
        raise raw
    if not isinstance(raw, dict):
        raise RecordError(where, f"expected an object, got a {type(raw).__name__}")
    _check_format(raw, fmt, where)
    if fmt == "text":
        text = _string(raw, "text", where)
        if not text.strip():
            raise RecordError(where, "field 'text' is empty")
        return Record(where, text=text)
    try:  # every format but text (LLaMA-Factory's alpaca has a tools column too)
        tools = tool_calls.parse_tools(raw.get("tools"))
    except tool_calls.BadField as err:
        raise RecordError(where, str(err)) from None
    _no_vision_tokens(json.dumps(tools or [], ensure_ascii=False), "tools", where)
    if fmt == "preference":
        return Record(where, pair=_preference_pair(raw, where), tools=tools)
    images: list[ImageRef] = []
    if fmt == "alpaca":
        messages = _alpaca_messages(raw, where)
    else:
        messages, images = _chat_messages(raw, where, base)
    _check_turns(messages, where)
    return Record(where, messages=messages, images=images, tools=tools)


def _alpaca_messages(rec: dict[str, Any], where: str) -> list[dict[str, Any]]:
    output = _string(rec, "output", where)
    system = _string(rec, "system", where, required=False)
    messages = [{"role": "system", "content": system}] if system else []
    messages += _alpaca_prompt(rec, where)
    return [*messages, {"role": "assistant", "content": output}]


def _alpaca_prompt(rec: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An alpaca record's turns up to its reply: ``history``, then instruction (and input)."""
    instruction = _string(rec, "instruction", where)
    extra = _string(rec, "input", where, required=False)
    messages: list[dict[str, Any]] = []
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise RecordError(where, "field 'history' must be a list of [user, assistant] pairs")
    for i, turn in enumerate(history):
        if not (isinstance(turn, list | tuple) and len(turn) == 2):
            raise RecordError(where, f"field 'history'[{i}] is not a [user, assistant] pair")
        if not all(isinstance(t, str) for t in turn):
            raise RecordError(where, f"field 'history'[{i}] holds a non-string")
        messages += [
            {"role": "user", "content": turn[0]},
            {"role": "assistant", "content": turn[1]},
        ]
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [*messages, {"role": "user", "content": user}]


def _chat_messages(
    rec: dict[str, Any], where: str, base: Path | None
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    if "messages" in rec:
        key = "messages"
    elif "conversations" in rec:
        key = "conversations"
    else:
        raise RecordError(where, "field 'messages' (or ShareGPT 'conversations') is missing")
    role_key, text_key = _key_style(rec[key], sharegpt=key == "conversations")
    images = _Images(rec.get("images"), where, base)
    messages = _turns(rec[key], key, role_key, text_key, where, images)
    images.check_all_placed()
    system = _string(rec, "system", where, required=False)
    _no_vision_tokens(system, "system", where)
    if system:  # ShareGPT's (LLaMA-Factory's) system prompt beside the turns
        if any(m["role"] == "system" for m in messages):
            raise RecordError(
                where,
                f"field 'system' is set and field {key!r} has a system turn too: give the "
                "system prompt once",
            )
        messages = [{"role": "system", "content": system}, *messages]
    return messages, images.refs


class _Images:
    """A record's images as its turns are read: each image part, and each ``<image>``
    placeholder (taking the next entry of the record's ``images`` list), becomes the chat
    templates' :data:`IMAGE_PLACEHOLDER` in the text and an :class:`ImageRef`, in order."""

    def __init__(self, listed: Any, where: str, base: Path | None):
        self.where, self.base = where, base
        self.listed: list[Any] | None = None  # the ShareGPT 'images' field, when given
        if isinstance(listed, str | bytes | dict):
            listed = [listed]
        if listed is not None and not isinstance(listed, list):
            kind = type(listed).__name__
            raise RecordError(where, f"field 'images' is a {kind}, not a list of images")
        self.listed = listed
        self.placed = 0  # placeholders met so far
        self.refs: list[ImageRef] = []

    def text(self, text: str, at: str, role: str) -> str:
        """A turn's text with its ``<image>`` placeholders placed (when the record lists
        images), checked for vision tokens only an image may place."""
        _no_vision_tokens(text, at, self.where)
        if self.listed is None or SHAREGPT_PLACEHOLDER not in text:
            return text
        pieces = text.split(SHAREGPT_PLACEHOLDER)
        out = pieces[0]
        for piece in pieces[1:]:
            k = self.placed
            self.placed += 1
            if k < len(self.listed):
                self.add(self.listed[k], f"field 'images'[{k}]", role, at)
            out += IMAGE_PLACEHOLDER + piece
        return out

    def part(self, value: Any, at: str, role: str) -> str:
        self.add(value, f"field {at!r}", role, at)
        return IMAGE_PLACEHOLDER

    def add(self, value: Any, field_name: str, role: str, at: str) -> None:
        n = len(self.refs) + 1
        if role != "user":
            raise RecordError(
                self.where,
                f"field {at!r} places image {n} in {'an' if role[0] in 'aeiou' else 'a'} {role} "
                "turn: images are read in user "
                "turns only (the model reads them; it does not write them)",
            )
        self.refs.append(_image_ref(value, n, field_name, self.where, self.base))

    def check_all_placed(self) -> None:
        if self.listed is not None and self.placed != len(self.listed):
            raise RecordError(
                self.where,
                f"the text has {self.placed} {SHAREGPT_PLACEHOLDER} placeholder"
                f"{'s' if self.placed != 1 else ''} and field 'images' lists "
                f"{len(self.listed)} image{'s' if len(self.listed) != 1 else ''}: each image "
                f"needs its {SHAREGPT_PLACEHOLDER} where it goes in a user turn",
            )


def _no_vision_tokens(text: str, at: str, where: str) -> None:
    for token in VISION_TOKENS:
        if token in text:
            raise RecordError(
                where,
                f"field {at!r} holds {token!r}, which only an image may place (give the image "
                f"as a part, or as {SHAREGPT_PLACEHOLDER} with an 'images' list)",
            )


def _image_ref(value: Any, n: int, field_name: str, where: str, base: Path | None) -> ImageRef:
    """Image ``n`` of a record from its value in ``field_name``: a path (relative to ``base``),
    bytes, or a ``datasets`` Image value ``{"bytes": ..., "path": ...}``. A file must exist."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
    if isinstance(value, bytes | bytearray):
        return ImageRef(f"image {n} (bytes in {field_name})", data=bytes(value))
    if not isinstance(value, str) or not value.strip():
        kind = "empty" if isinstance(value, str) else f"a {type(value).__name__}"
        raise RecordError(where, f"{field_name}: image {n} is {kind}, not a path or image bytes")
    if value.startswith(("http://", "https://")):
        raise RecordError(
            where,
            f"{field_name}: image {n} is a URL ({value}); memtune reads local files: "
            "download the images and give their paths",
        )
    path = Path(value.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if not path.is_file():
        raise RecordError(where, f"image {n} ({path}): no such file ({field_name})")
    return ImageRef(f"image {n} ({path})", path=path)


IMAGE_PART_TYPES = ("image", "text")


def _content_parts(parts: list[Any], at: str, role: str, where: str, images: _Images) -> str:
    """A turn's content given as a list of parts (Qwen's / Hugging Face's shape): text parts
    and image parts, in order, as the chat templates render them."""
    out = ""
    for j, part in enumerate(parts):
        here = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise RecordError(where, f"field {here!r} is not an object")
        kind = part.get("type") or ("image" if part.get("image") is not None else "text")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RecordError(where, f"field '{here}.text' is missing or not a string")
            out += images.text(text, f"{here}.text", role)
        elif kind == "image":
            keys = [k for k in ("image", "path", "url") if part.get(k) is not None]
            value = part[keys[0]] if keys else None
            if value is None:
                raise RecordError(where, f"field '{here}.image' is missing")
            out += images.part(value, f"{here}.image", role)
        else:
            raise RecordError(
                where,
                f"field '{here}.type' is {kind!r}; memtune reads parts of type "
                f"{' or '.join(IMAGE_PART_TYPES)} (video is not supported)",
            )
    return out


def _turns(
    turns: Any, key: str, role_key: str, text_key: str, where: str, images: _Images | None = None
) -> list[dict[str, Any]]:
    """The message list ``turns`` (field ``key`` of the record) in memtune's shape: role
    ``system`` / ``user`` / ``assistant`` and ``content``, ``reasoning_content`` kept.
    ``images``: the record's images (format messages), placed as the turns are read; None
    where images are not read (preference pairs: a content must be a string)."""
    if not isinstance(turns, list) or not turns:
        raise RecordError(where, f"field {key!r} must be a non-empty list")
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        at = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(where, f"field {at!r} is not an object")
        role = turn.get(role_key)
        if role in TOOL_RESULT_ROLES or role in TOOL_CALL_ROLES:
            _tool_turn(messages, turn, role, at, text_key, where)
            continue
        if role not in ROLE_ALIASES:
            _bad_role(turn, at, role_key, key, where)
        content = turn.get(text_key)
        role = ROLE_ALIASES[role]
        calls = _assistant_calls(turn, role, at, where)
        if calls is not None and content is None:
            content = ""  # OpenAI's: a reply that only calls has a null content
        if images is not None and isinstance(content, list):
            content = _content_parts(content, f"{at}.{text_key}", role, where, images)
        elif not isinstance(content, str):
            raise RecordError(where, f"field '{at}.{text_key}' is missing or not a string")
        elif images is not None:
            content = images.text(content, f"{at}.{text_key}", role)
        message: dict[str, Any] = {"role": role, "content": content}
        reasoning = turn.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str) or message["role"] != "assistant":
                raise RecordError(
                    where, f"field '{at}.reasoning_content' must be a string, on an assistant turn"
                )
            message["reasoning_content"] = reasoning  # rendered by data.template=qwen3 / qwen3_5
        if calls is not None:
            message["tool_calls"] = calls
        messages.append(message)
    return messages


def _assistant_calls(
    turn: dict[str, Any], role: str, at: str, where: str
) -> list[tool_calls.Call] | None:
    """An assistant turn's calls: OpenAI's ``tool_calls``, or its older one-call
    ``function_call``; None where it makes none."""
    # an empty list is no call: what OpenAI-style servers log on every reply that made none
    given = [k for k in ("tool_calls", "function_call") if turn.get(k) not in (None, [])]
    if not given:
        return None
    if role != "assistant":
        raise RecordError(where, f"field '{at}.{given[0]}' is on a {role} turn: only a reply calls")
    if len(given) == 2:
        raise RecordError(where, f"field {at!r} has both tool_calls and function_call: give one")
    if given[0] == "tool_calls":
        return _read_calls(tool_calls.parse_calls, turn["tool_calls"], f"{at}.tool_calls", where)
    one = turn["function_call"]
    return _read_calls(
        lambda v, a: [tool_calls.parse_call(v, a)], one, f"{at}.function_call", where
    )


def _read_calls(
    parse: Callable[[Any, str], list[tool_calls.Call]], value: Any, at: str, where: str
) -> list[tool_calls.Call]:
    """Calls read by ``parse`` from field ``at``: a bad one, or one holding an image's token,
    is a bad record naming the field."""
    try:
        calls = parse(value, at)
    except tool_calls.BadField as err:
        raise RecordError(where, str(err)) from None
    _no_vision_tokens(json.dumps(calls, ensure_ascii=False), at, where)
    return calls


def _tool_turn(
    messages: list[dict[str, Any]],
    turn: dict[str, Any],
    role: str,
    at: str,
    text_key: str,
    where: str,
) -> None:
    """A tool's result (joined to the user turn of the results right before it, as the
    templates render consecutive results) or a ShareGPT function_call turn (an assistant reply
    that only calls), added to ``messages``."""
    value = turn.get(text_key)
    if role in TOOL_CALL_ROLES:
        calls = _read_calls(tool_calls.sharegpt_calls, value, f"{at}.{text_key}", where)
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        return
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        value = "".join(p["text"] for p in value)  # OpenAI's text parts, as Qwen3.5 joins them
    if not isinstance(value, str):
        raise RecordError(
            where,
            f"field '{at}.{text_key}' (a tool result) is missing or not a string (or a list of "
            "text parts)",
        )
    _no_vision_tokens(value, f"{at}.{text_key}", where)
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not _calls(last):
        raise RecordError(
            where,
            f"field {at!r} is a tool's result after a reply that makes no call (no tool_calls, "
            "no <tool_call> in its text): a result follows the call it answers",
        )
    joined = last is not None and "tool_results" in last
    results = [*(last["tool_results"] if joined and last else []), value]
    if joined:
        messages.pop()
    messages.append(
        {"role": "user", "content": tool_calls.wrap_results(results), "tool_results": results}
    )


def _calls(message: dict[str, Any]) -> bool:
    """Whether a reply calls a tool: its tool_calls, or a call written in its text (as data
    written for Qwen's templates by hand holds one)."""
    return bool(message.get("tool_calls")) or "<tool_call>" in message["content"]


TOOL_RESULT_ROLES = ("tool", "observation", "function")
"""Roles of a tool's result (OpenAI's tool / function, ShareGPT's observation)."""
TOOL_CALL_ROLES = ("function_call", "tool_call")
"""Roles of a turn that is a call (ShareGPT's function_call): its text the call's JSON."""


def _key_style(turns: Any, sharegpt: bool) -> tuple[str, str]:
    """(role key, text key) of a message list: ShareGPT's from / value or OpenAI's role /
    content, told apart by the first turn's keys, whatever the field is named (people put
    either style under either name); ``sharegpt`` when the first turn has neither."""
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    if "from" in first:
        sharegpt = True
    elif "role" in first:
        sharegpt = False
    return ("from", "value") if sharegpt else ("role", "content")


def _bad_role(turn: dict[str, Any], at: str, role_key: str, key: str, where: str) -> NoReturn:
    """Refuse a turn whose role memtune does not read, saying why: the list mixes key styles,
    the role key is missing, or the role is unknown."""
    role = turn.get(role_key)
    other_key = "role" if role_key == "from" else "from"
    styles = {"from": "ShareGPT's from / value", "role": "OpenAI's role / content"}
    if role is None and other_key in turn:
        this_style, first_style = styles[other_key], styles[role_key]
        raise RecordError(
            where,
            f"field {at!r} has {this_style} keys and field '{key}[0]' {first_style}: a message "
            "list keeps one key style",
        )
    if role is None:
        raise RecordError(
            where,
            f"field '{at}.{role_key}' is missing: a turn has OpenAI's role / content keys or "
            "ShareGPT's from / value",
        )
    roles = ", ".join(sorted({*ROLE_ALIASES, *TOOL_RESULT_ROLES, *TOOL_CALL_ROLES}))
    raise RecordError(where, f"field '{at}.{role_key}' is {role!r}; expected one of {roles}")


def _message_list(rec: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """A preference field holding messages, OpenAI (role / content) or ShareGPT (from /
    value) keys, told apart by the first turn's keys (a record may mix the two styles across
    its fields: each is read on its own)."""
    role_key, text_key = _key_style(rec[key], sharegpt=False)
    return _turns(rec[key], key, role_key, text_key, where)


def _preference_side(rec: dict[str, Any], key: str, where: str) -> list[dict[str, Any]] | str:
    """``chosen`` or ``rejected``: a reply (a non-empty string), a message list, or one
    message (LLaMA-Factory's ShareGPT preference records: ``{"from": "gpt", "value": ...}``)."""
    value = rec.get(key)
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(where, f"field {key!r} is empty")
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        role_key, text_key = _key_style(value, sharegpt=False)
        return _turns(value, key, role_key, text_key, where)
    if value is None:
        raise RecordError(where, f"field {key!r} is missing")
    kind = type(value).__name__
    raise RecordError(
        where, f"field {key!r} is a {kind}, not a string, a message or a list of messages"
    )


def _preference_pair(rec: dict[str, Any], where: str) -> Pair:
    """Read one preference record in any of the module docstring's shapes into (prompt,
    chosen reply, rejected reply), checked: both conversations alternate and end in an
    assistant reply, they share every turn before it, and the two replies differ."""
    chosen, rejected = (_preference_side(rec, k, where) for k in ("chosen", "rejected"))
    raw_prompt = rec.get("prompt")
    prompt: list[dict[str, Any]]
    shared = next((k for k in ("conversations", "messages") if k in rec), None)
    if raw_prompt is None and shared is not None:  # LLaMA-Factory's ShareGPT preference shape
        prompt = _message_list(rec, shared, where)
    elif raw_prompt is None and "instruction" in rec:  # LLaMA-Factory's alpaca one
        prompt = _alpaca_prompt(rec, where)
    elif isinstance(raw_prompt, list):
        prompt = _message_list(rec, "prompt", where)
    elif raw_prompt is None or isinstance(raw_prompt, str):
        prompt = [{"role": "user", "content": raw_prompt}] if raw_prompt else []
    else:
        what = f"a {type(raw_prompt).__name__}"
        raise RecordError(where, f"field 'prompt' is {what}, not a string or a list of messages")

    def conversation(side: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
        if isinstance(side, str):
            return [*prompt, {"role": "assistant", "content": side}]
        if isinstance(raw_prompt, str) and side[0]["role"] != "assistant":
            return side  # the whole conversation; the string prompt is a copy of its first turn
        return [*prompt, *side]

    sides = {"chosen": conversation(chosen), "rejected": conversation(rejected)}
    system = _string(rec, "system", where, required=False)
    for key, messages in sides.items():
        if not any(m["role"] == "user" for m in messages):
            if raw_prompt is None:
                what = "is missing"
            else:
                what = "is empty" if isinstance(raw_prompt, str) else "has no user turn"
            raise RecordError(where, f"field 'prompt' {what} and field {key!r} holds no user turn")
        if system:
            if messages[0]["role"] == "system":
                raise RecordError(
                    where, f"field 'system' is set and field {key!r} has a system message too"
                )
            sides[key] = messages = [{"role": "system", "content": system}, *messages]
        _check_turns(messages, where, key)
    chosen_turns, rejected_turns = sides["chosen"], sides["rejected"]
    _check_same_prompt(chosen_turns, rejected_turns, where)
    if tool_calls.same_reply(chosen_turns[-1], rejected_turns[-1]):
        raise IdenticalReplies(
            where, "fields 'chosen' and 'rejected' are the same reply: nothing to prefer"
        )
    return chosen_turns[:-1], chosen_turns[-1], rejected_turns[-1]


def _check_same_prompt(
    chosen: list[dict[str, Any]], rejected: list[dict[str, Any]], where: str
) -> None:
    """The two conversations of a pair differ in their last reply only: the objectives compare
    two answers to one prompt, and a pair whose prompts differ compares nothing."""
    rule = "a pair shares every turn but the last reply"
    systems = [m[0]["content"] if m[0]["role"] == "system" else None for m in (chosen, rejected)]
    if systems[0] != systems[1]:
        raise RecordError(
            where, f"fields 'chosen' and 'rejected' have different system messages: {rule}"
        )
    body_c = chosen[1:] if systems[0] is not None else chosen
    body_r = rejected[1:] if systems[1] is not None else rejected
    for i, (c, r) in enumerate(zip(body_c[:-1], body_r[:-1], strict=False)):
        if c != r:
            raise RecordError(
                where,
                f"fields 'chosen' and 'rejected' differ at turn {i} ({c['role']}), before their "
                f"last reply: {rule}",
            )
    if len(body_c) != len(body_r):
        raise RecordError(
            where,
            f"field 'chosen' has {len(body_c)} turns and field 'rejected' {len(body_r)}: {rule}",
        )


def _check_turns(messages: list[dict[str, Any]], where: str, key: str | None = None) -> None:
    """Alternating user / assistant turns after an optional system message, ending in a
    non-empty assistant reply. ``key``: the record's field the conversation is (a preference
    record has two), named in the message."""
    of = f"field {key!r}: " if key else ""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise RecordError(where, f"{of}no user / assistant turns")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            what = f"{m['role']!r}" + (" (tool results)" if "tool_results" in m else "")
            raise RecordError(
                where,
                f"{of}turn {i} is {what}, expected {expected!r} (turns alternate user / "
                "assistant after an optional system message; a tool's results follow its call)",
            )
    if body[-1]["role"] != "assistant":
        raise RecordError(where, f"{of}the last turn is not an assistant reply: nothing to learn")
    for i, m in enumerate(body):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
            raise RecordError(where, f"{of}assistant reply {i // 2} is empty")


def read_source(path: str, fmt: str) -> Iterator[Record | RecordError]:
    """Parsed records of one source; a bad record is yielded as its error, in order. Image
    paths are relative to the data file's folder (a ``datasets`` folder: that folder)."""
    p = Path(path).expanduser()
    base = None if hub_dataset(path) is not None else (p if p.is_dir() else p.parent)
    read = False  # a record of this source parsed: another format's shape is one bad record
    for where, raw in iter_raw(path):
        try:
            yield parse(raw, fmt, where, base)
            read = True
        except WrongFormat as err:
            yield RecordError(err.where, err.stray) if read else err
        except RecordError as err:
            yield err
