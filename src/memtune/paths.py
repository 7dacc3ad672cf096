"""Where memtune's own files are, and what a path names: facts every process shares, imported
by the job side and the rank side alike (so this module imports nothing of memtune's)."""

from __future__ import annotations

from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout memtune runs from (``pip install -e .``): ``conf/``, ``ds_configs/`` and
``constraints.txt`` are found there, the bundled data in the package (ASSETS_DIR)."""

CONF_DIR = SOURCE_ROOT / "conf"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def is_local_source(path: str) -> bool:
    """Whether a data or model name is a path on this machine (else a hub name)."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()
