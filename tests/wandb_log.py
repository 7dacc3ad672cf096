"""Read an offline wandb run (run-*.wandb) back, for tests: its history rows as dicts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER, BLOCK, REC = 7, 32768, 7


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a wandb log"
    i, pending = HEADER, b""
    while i + REC <= len(data):
        if BLOCK - i % BLOCK < REC:
            i += BLOCK - i % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i : i + REC])
        body = data[i + REC : i + REC + length]
        i += REC + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield body
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            yield pending + body
            pending = b""


def history(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def summary(path: Path) -> dict:
    """The run summary's values as the log records them (later updates win)."""
    from wandb.proto import wandb_internal_pb2

    out: dict = {}
    for raw in records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
