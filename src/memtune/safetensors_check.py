"""Whether a safetensors file is whole, read from its header alone: what a truncated copy or a
save cut short would otherwise raise from inside safetensors (``SafetensorError: ... incomplete
metadata, file not fully covered``) in every rank, or in ``memtune merge`` / ``generate``.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (each
tensor's dtype, shape and ``data_offsets`` into the data after the header), then the data:
the file is exactly ``8 + header + the largest end offset`` bytes long. Only the header is read,
never the tensors, so checking a 15 GB checkpoint costs one small read per file. Imports nothing
of memtune's: the job side, the rank side and the verbs may all use it.
"""

from __future__ import annotations

import json
from pathlib import Path

HEADER_LIMIT = 100_000_000
"""safetensors' own bound on the header's length (its MAX_HEADER_SIZE): a larger length read
from the first 8 bytes means the file is not a safetensors file at all."""

INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index: ``weight_map`` names the shard that holds each tensor."""


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file at ``path``, in words that name it; None when
    its header reads and the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is {size} bytes long: truncated, or not a safetensors file"
            length = int.from_bytes(head, "little")
            if length > HEADER_LIMIT:
                return (
                    f"{path} is not a safetensors file (its first 8 bytes give no header "
                    "length safetensors can read)"
                )
            if 8 + length > size:
                return (
                    f"{path} is truncated: {size:,} bytes, shorter than its own header "
                    f"({8 + length:,} bytes)"
                )
            raw = f.read(length)
    except FileNotFoundError:
        return f"{path}: no such file"
    except OSError as err:
        return f"{path}: cannot read it ({err.strerror or err})"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        return f"{path}: its header is not safetensors' JSON (damaged, or not a safetensors file)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"{path}: its header gives tensor {name!r} no valid data_offsets (damaged)"
        end = max(end, offsets[1])
    expected = 8 + length + end
    if size < expected:
        return f"{path} is truncated: {size:,} bytes, its header says {expected:,}"
    if size > expected:
        return (
            f"{path} is {size:,} bytes, {size - expected:,} more than its header says "
            f"({expected:,}): damaged"
        )
    return None


def model_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model saved in ``folder``: every ``*.safetensors`` there and
    each shard its index names (which may be missing: :func:`model_weights_problem` says so).
    ValueError, in words naming the index, when the index cannot be read."""
    index = folder / INDEX
    names = {p.name for p in folder.glob("*.safetensors")}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} is not a safetensors index (no weight_map): damaged")
        names |= {str(s) for s in weight_map.values()}
    return [folder / name for name in sorted(names)]


def model_weights_problem(folder: Path) -> str | None:
    """The first damaged safetensors file of a model saved in ``folder`` (every
    ``*.safetensors`` there, and each shard its index names, which must exist); None when all
    are whole, or the model keeps its weights in another format (not checked)."""
    try:
        files = model_weight_files(folder)
    except ValueError as err:
        return str(err)
    for f in files:
        if not f.is_file():
            return f"{folder} has no {f.name}, which {INDEX} names: a shard is missing"
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            return problem
    return None


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the safetensors file at ``path``, from its header (a
    file :func:`safetensors_problem` passed)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
