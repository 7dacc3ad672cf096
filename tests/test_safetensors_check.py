"""memtune.safetensors_check: a safetensors file's wholeness from its header alone (what
peft.init_from, memtune merge and memtune generate check before loading one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from memtune.safetensors_check import model_weights_problem, safetensors_problem


def _saved(path: Path) -> Path:
    save_file({"a": np.zeros((4, 4), dtype=np.float32), "b": np.ones(3, np.float16)}, str(path))
    return path


def test_a_whole_file_and_a_whole_model_pass(tmp_path: Path) -> None:
    assert safetensors_problem(_saved(tmp_path / "model.safetensors")) is None
    assert model_weights_problem(tmp_path) is None
    assert model_weights_problem(tmp_path / "nothing-here") is None  # no safetensors: unchecked


NOT_SAFETENSORS = "(its first 8 bytes give no header length safetensors can read)"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("cut", "{path} is truncated: {size:,} bytes, its header says {full:,}"),
        ("grown", "{path} is {size:,} bytes, 5 more than its header says ({full:,}): damaged"),
        ("short", "{path} is 3 bytes long: truncated, or not a safetensors file"),
        ("in-header", "{path} is truncated: {size:,} bytes, shorter than its own header ({head:,} "
         "bytes)"),
        ("not-json", "{path}: its header is not safetensors' JSON (damaged, or not a "
         "safetensors file)"),
        ("text", "{path} is not a safetensors file " + NOT_SAFETENSORS),
        ("offsets", "{path}: its header gives tensor 'a' no valid data_offsets (damaged)"),
    ],
)  # fmt: skip
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path: Path, damage: str, said: str) -> None:
    path = _saved(tmp_path / "model.safetensors")
    data = path.read_bytes()
    full = len(data)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    if damage == "cut":
        data = data[:-7]
    elif damage == "grown":
        data += b"\0" * 5
    elif damage == "short":
        data = data[:3]
    elif damage == "in-header":
        data = data[: 8 + length // 2]
    elif damage == "not-json":
        data = data[:8] + b"\xff" * length + data[8 + length :]
    elif damage == "text":
        data = b"version https://git-lfs.github.com/spec/v1\n"  # a Git LFS pointer
    elif damage == "offsets":
        header["a"]["data_offsets"] = [8, 4]
        raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
        data = data[:8] + raw + data[8 + length :]
    path.write_bytes(data)
    expected = said.format(path=path, size=len(data), full=full, head=8 + length)
    assert safetensors_problem(path) == expected
    assert model_weights_problem(tmp_path) == expected


def test_a_sharded_model_missing_a_shard_is_named(tmp_path: Path) -> None:
    _saved(tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert model_weights_problem(tmp_path) == (
        f"{tmp_path} has no model-00002-of-00002.safetensors, which "
        "model.safetensors.index.json names: a shard is missing"
    )
