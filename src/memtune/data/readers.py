"""Read training records from files or datasets into one shape: a list of chat messages.

Formats
- ``alpaca``: instruction / input / output, optional ``system`` and ``history``
  (``[[user, assistant], ...]`` turns before this one).
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI style) or
  ShareGPT's ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``. An
  assistant turn may carry ``reasoning_content`` (its thinking, rendered by the qwen3 and
  qwen3_5 templates).
- ``text``: ``{"text": ...}`` for plain continued pre-training (every token is a label).

Sources: ``.jsonl``, ``.json`` (an array), ``.parquet``, a folder written by
``datasets.Dataset.save_to_disk``, or a hub dataset name (where the hub is reachable).
Every bad record raises :class:`RecordError` with file, line (or row) and field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtune.paths import is_local_source

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


@dataclass
class Record:
    where: str
    messages: list[dict[str, str]] | None = None
    """system?, then alternating user / assistant turns, ending with an assistant turn."""
    text: str | None = None


def iter_raw(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record) from any supported source, in file order."""
    p = Path(path).expanduser()
    if not is_local_source(path):
        yield from _iter_hub(path)
        return
    if p.is_dir():
        yield from _iter_dataset_dir(p)
    elif p.suffix == ".parquet":
        yield from _iter_parquet(p)
    elif p.suffix == ".json":
        yield from _iter_json_array(p)
    else:
        yield from _iter_jsonl(p)


def _iter_jsonl(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        f = p.open("rb")
    except OSError as err:
        raise RecordError(str(p), f"cannot read ({err.strerror})") from err
    with f:
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
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                yield where, RecordError(where, f"invalid JSON ({err.msg}, column {err.colno})")


def _iter_json_array(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecordError(str(p), f"cannot read ({err})") from err
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError(f"{p}:{err.lineno}", f"invalid JSON ({err.msg})") from err
    if not isinstance(records, list):
        raise RecordError(str(p), "expected a JSON array of records (or use .jsonl)")
    for i, rec in enumerate(records):
        yield f"{p} record {i}", rec


def _iter_parquet(p: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(p)
    for i, rec in enumerate(table.to_pylist()):
        yield f"{p} row {i}", rec


def _iter_dataset_dir(p: Path) -> Iterator[tuple[str, Any]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(p))
    if hasattr(ds, "keys"):  # a DatasetDict: take its train split
        if "train" not in ds:
            raise RecordError(str(p), f"a DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    for i, rec in enumerate(ds):
        yield f"{p} row {i}", rec


def _iter_hub(name: str) -> Iterator[tuple[str, Any]]:
    from datasets import load_dataset

    ds = load_dataset(name, split="train")
    for i, rec in enumerate(ds):
        yield f"{name} row {i}", rec


def _string(rec: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    value = rec.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}, not a string"
        raise RecordError(where, f"field {key!r} is {what}")
    return value


def parse(raw: Any, fmt: str, where: str) -> Record:
    if isinstance(raw, RecordError):
        raise raw
    if not isinstance(raw, dict):
        raise RecordError(where, f"expected an object, got a {type(raw).__name__}")
    if fmt == "text":
        text = _string(raw, "text", where)
        if not text.strip():
            raise RecordError(where, "field 'text' is empty")
        return Record(where, text=text)
    messages = _alpaca_messages(raw, where) if fmt == "alpaca" else _chat_messages(raw, where)
    _check_turns(messages, where)
    return Record(where, messages=messages)


def _alpaca_messages(rec: dict[str, Any], where: str) -> list[dict[str, str]]:
    instruction = _string(rec, "instruction", where)
    extra = _string(rec, "input", where, required=False)
    output = _string(rec, "output", where)
    system = _string(rec, "system", where, required=False)
    messages = [{"role": "system", "content": system}] if system else []
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
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return messages


def _chat_messages(rec: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "messages" in rec:
        key, role_key, text_key = "messages", "role", "content"
    elif "conversations" in rec:
        key, role_key, text_key = "conversations", "from", "value"
    else:
        raise RecordError(where, "field 'messages' (or ShareGPT 'conversations') is missing")
    turns = rec[key]
    if not isinstance(turns, list) or not turns:
        raise RecordError(where, f"field {key!r} must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(where, f"field {at!r} is not an object")
        role = turn.get(role_key)
        if role not in ROLE_ALIASES:
            roles = ", ".join(sorted(ROLE_ALIASES))
            raise RecordError(
                where, f"field '{at}.{role_key}' is {role!r}; expected one of {roles}"
            )
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise RecordError(where, f"field '{at}.{text_key}' is missing or not a string")
        message = {"role": ROLE_ALIASES[role], "content": content}
        reasoning = turn.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str) or message["role"] != "assistant":
                raise RecordError(
                    where, f"field '{at}.reasoning_content' must be a string, on an assistant turn"
                )
            message["reasoning_content"] = reasoning  # rendered by data.template=qwen3 / qwen3_5
        messages.append(message)
    return messages


def _check_turns(messages: list[dict[str, str]], where: str) -> None:
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise RecordError(where, "no user / assistant turns")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise RecordError(
                where,
                f"turn {i} is {m['role']!r}, expected {expected!r} (turns alternate "
                "user / assistant after an optional system message)",
            )
    if body[-1]["role"] != "assistant":
        raise RecordError(where, "the last turn is not an assistant reply: nothing to learn")
    for i, m in enumerate(body):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError(where, f"assistant reply {i // 2} is empty")


def read_source(path: str, fmt: str) -> Iterator[Record | RecordError]:
    """Parsed records of one source; a bad record is yielded as its error, in order."""
    for where, raw in iter_raw(path):
        try:
            yield parse(raw, fmt, where)
        except RecordError as err:
            yield err
