"""Where memtune's own files are, and what a path names: facts every process shares, imported
by the job side and the rank side alike (so this module imports nothing of memtune's)."""

from __future__ import annotations

import re
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout memtune runs from (``pip install -e .``): ``conf/``, ``ds_configs/`` and
``constraints.txt`` are found there, the bundled data in the package (ASSETS_DIR)."""

CONF_DIR = SOURCE_ROOT / "conf"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def is_local_source(path: str) -> bool:
    """Whether a data or model name is a path on this machine (else a hub name)."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
"""A data file's suffixes: a name ending so (or in a compressed one's) is a file."""
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
"""A compressed file's suffixes (memtune.data.readers.COMPRESSED's, which the readers refuse)."""
_HUB_DATASET = re.compile(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?")


def hub_dataset(path: str) -> tuple[str, str] | None:
    """A data source that names a Hugging Face hub dataset, as ``(name, split)``:
    ``OWNER/NAME`` or ``OWNER/NAME:SPLIT`` (the split ``train`` unless given). None for a path
    on this machine, and for a name no hub dataset has (a data file's suffix, a folder on the
    way): a file that is not there. Before, ``data/trian.jsonl`` was asked of the hub, ~30 s of
    retries ending in a traceback."""
    if is_local_source(path) or not _HUB_DATASET.fullmatch(path):
        return None
    name, _, split = path.partition(":")
    if "/" in name and Path(name.split("/")[0]).is_dir():
        return None  # data/trian with a folder data/ here: a path, not OWNER/NAME
    suffixes = [x.lower() for x in Path(name).suffixes]
    if any(x in DATA_SUFFIXES or x in COMPRESSED_SUFFIXES for x in suffixes):
        return None
    return name, split or "train"
