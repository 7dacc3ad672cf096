"""MkDocs hooks (mkdocs.yml ``hooks:``): the site's home page is the README.

The README is the front page on the forge and on the site, written once: ``on_files`` adds it
as ``index.md`` with its links into ``docs/`` made relative to the site (``docs/memory.md`` →
``memory.md``). Links to other repository files cannot resolve on the site; the strict build
names them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def home_page(readme: str) -> str:
    """The README with its ``](docs/...)`` links relative to docs/."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config: Any) -> Files:
    text = home_page((ROOT / "README.md").read_text())
    files.append(File.generated(config, "index.md", content=text))
    return files
