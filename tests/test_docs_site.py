"""The built documentation site as a reader gets it: every page rendered by headless Chromium
(Debian's package), every link of every page resolving to a page and an anchor that exists, and
screenshots of the home page and of one long page checked for their layout.

Run by ``make docs-check`` (after ``make docs``; .ci/run runs it), marked ``browser`` and left
out of ``make test``: it needs Chromium, which ``make docs-check`` installs with apt when
missing. The screenshots are left in outputs/docs-check/ to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.browser

SHOTS = ROOT / "outputs" / "docs-check"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    return out


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("no chromium: make docs-check installs Debian's (apt-get install chromium)")
    return found


def _run(chromium: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


class _Page(HTMLParser):
    """The ids and link targets of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        if tag == "a" and a.get("href"):
            self.links.append(a["href"] or "")
        if tag == "link" and a.get("rel") in ("prev", "next", "stylesheet") and a.get("href"):
            self.links.append(a["href"] or "")


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def test_every_link_of_every_page_resolves(site: Path) -> None:
    # 404.html is served at any missing path, so its links are site-absolute (/install.html)
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 20
    parsed = {p: _parse(p) for p in pages}
    broken = []
    for page, html in parsed.items():
        for href in html.links:
            url = urlparse(href)
            if url.scheme or href.startswith("//"):
                continue  # outside the site (none is fetched)
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
                continue
            if url.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_every_page_renders_in_chromium(site: Path, chromium: str) -> None:
    """Each page through the browser, its scripts run: the page's article with its title."""
    failed = []
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue
        dom = _run(chromium, "--virtual-time-budget=3000", "--dump-dom", page.as_uri()).stdout
        article = re.search(
            r'<article class="md-content__inner[^"]*"[^>]*>(.*?)</article>', dom, re.S
        )
        if not article or "<h1" not in article.group(1) or len(article.group(1)) < 500:
            failed.append(str(page.relative_to(site)))
        elif 'class="md-header' not in dom or "md-nav" not in dom:
            failed.append(f"{page.relative_to(site)} (no header or navigation)")
    assert not failed, failed


def _screenshot(chromium: str, page: Path, name: str, width: int, height: int) -> object:
    from PIL import Image

    SHOTS.mkdir(parents=True, exist_ok=True)
    out = SHOTS / name
    run = _run(chromium, f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri())
    assert out.exists(), run.stderr
    return Image.open(out).convert("RGB")


def _ink(image: object, box: tuple[int, int, int, int]) -> float:
    """The share of dark (text) pixels in a box of the image."""
    histogram = image.crop(box).convert("L").histogram()  # type: ignore[attr-defined]
    return sum(histogram[:140]) / sum(histogram)


def _is_header(image: object, width: int) -> bool:
    """The top bar in the theme's primary colour (indigo) across the page."""
    for x in range(0, width, max(1, width // 16)):
        r, g, b = image.getpixel((x, 10))  # type: ignore[attr-defined]
        if not (b > 150 and r < 110 and g < 120):
            return False
    return True


def test_the_home_page_lays_out_as_three_columns(site: Path, chromium: str) -> None:
    shot = _screenshot(chromium, site / "index.html", "home.png", 1280, 900)
    assert _is_header(shot, 1280)
    assert _ink(shot, (40, 100, 250, 880)) > 0.01  # the navigation, on the left
    assert _ink(shot, (296, 100, 984, 880)) > 0.02  # the README's text, in the middle
    assert _ink(shot, (1024, 100, 1240, 300)) > 0.005  # its table of contents, on the right
    assert _ink(shot, (250, 100, 290, 880)) < 0.002  # a gutter between them: nothing overlaps


def test_a_long_page_is_text_from_top_to_bottom_and_fits_a_phone(site: Path, chromium: str) -> None:
    page = site / "memory.html"
    tall = _screenshot(chromium, page, "memory.png", 1280, 6000)
    assert _is_header(tall, 1280)
    for top in range(100, 5800, 800):  # no stretch of the page is empty or pushed aside
        assert _ink(tall, (296, top, 984, top + 800)) > 0.01, top
    phone = _screenshot(chromium, page, "memory-phone.png", 400, 1200)
    assert _is_header(phone, 400)
    # the navigation folds away: the text starts at the left edge and spans the screen
    assert _ink(phone, (0, 60, 60, 1200)) > 0.005
    assert _ink(phone, (300, 60, 400, 1200)) > 0.003
