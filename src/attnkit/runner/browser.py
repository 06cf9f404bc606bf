"""Check an HTML page of attnkit in a real browser (headless Chromium) and keep a screenshot.

``check_page(path)`` loads a copy of the page with a small script appended that waits for every image to
decode and measures the layout at a 1280 px wide viewport, reads the verdict from the DOM Chromium dumps
(``--dump-dom``), and, if asked, saves a full-page screenshot of the page itself (``--screenshot``). The
copy lives in a temporary directory; the page is not modified.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

__all__ = ["BrowserCheck", "check_page", "find_chromium", "CHROMIUM_NAMES"]

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
_MARK = "attnkit-browser-check"

# Runs in the page after it loaded: decode every image, then report broken images and elements wider than the
# viewport (the page scrolls sideways, or an element sticks out of the body), as JSON in a <pre>.
_SCRIPT = (
    """
<script>
(async () => {
  const images = Array.from(document.images);
  const broken = [];
  await Promise.all(images.map(async (img, i) => {
    try { await img.decode(); } catch (e) { }
    if (!(img.complete && img.naturalWidth > 0 && img.naturalHeight > 0)) """
    """broken.push(img.alt || ('image ' + i));
  }));
  const width = window.innerWidth;
  const scrollers = (el) => { for (let p = el.parentElement; p; p = p.parentElement) {
    const s = getComputedStyle(p).overflowX; """
    """if (s === 'auto' || s === 'scroll' || s === 'hidden') return true; }
    return false; };
  const wide = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.right > width + 1 && !scrollers(el)) wide.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
      + ' right=' + Math.round(r.right));
  }
  const out = document.createElement('pre');
  out.id = '%s';
  out.textContent = JSON.stringify({
    viewport_width: width, scroll_width: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight, images: images.length, broken: broken,
    wide: wide.slice(0, 20), title: document.title });
  document.body.appendChild(out);
})();
</script>
""" % _MARK
)


@dataclass
class BrowserCheck:
    """What Chromium saw: image count, the images that did not decode, the page's scroll width against the
    viewport, elements sticking out of it, and the screenshot written (if any)."""

    page: Path
    viewport_width: int
    scroll_width: int
    height: int
    images: int
    broken: list[str] = field(default_factory=list)
    wide: list[str] = field(default_factory=list)
    title: str = ""
    screenshot: Optional[Path] = None

    @property
    def overflows(self) -> bool:
        return self.scroll_width > self.viewport_width or bool(self.wide)

    @property
    def ok(self) -> bool:
        return not self.broken and not self.overflows

    def problems(self) -> list[str]:
        out = [f"image did not decode: {b}" for b in self.broken]
        if self.scroll_width > self.viewport_width:
            out.append(f"page is {self.scroll_width} px wide in a {self.viewport_width} px viewport")
        out += [f"element sticks out of the viewport: {w}" for w in self.wide]
        return out


def find_chromium() -> Optional[str]:
    """The path of a Chromium/Chrome executable on ``PATH`` (or ``$ATTNKIT_CHROMIUM``), else ``None``."""
    explicit = os.environ.get("ATTNKIT_CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(chromium: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    base = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
            "--no-first-run", "--disable-dev-shm-usage", "--allow-file-access-from-files"]
    with tempfile.TemporaryDirectory(prefix="attnkit-chromium-") as profile:
        return subprocess.run([*base, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                              timeout=timeout)


def check_page(page: Union[str, os.PathLike], screenshot: Optional[Union[str, os.PathLike]] = None,
               width: int = 1280, timeout: float = 120.0) -> BrowserCheck:
    """Load ``page`` in headless Chromium at ``width`` px and return what it saw; with ``screenshot``, also
    save a full-page PNG of it there. Raises ``FileNotFoundError`` when no Chromium is installed."""
    page = Path(page).resolve()
    if not page.is_file():
        raise FileNotFoundError(f"{str(page)!r} does not exist")
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError(
            "no Chromium found (install the Debian package `chromium`, or set ATTNKIT_CHROMIUM)"
        )
    text = page.read_text(encoding="utf-8")
    probe = text.replace("</body>", _SCRIPT + "</body>") if "</body>" in text else text + _SCRIPT
    with tempfile.TemporaryDirectory(prefix="attnkit-page-") as scratch:
        copy = Path(scratch) / page.name
        copy.write_text(probe, encoding="utf-8")
        for _attempt in range(5):  # a loaded machine sometimes gets the DOM dumped before the probe ran
            proc = _run(chromium, [f"--window-size={width},900", "--virtual-time-budget=10000", "--dump-dom",
                                   copy.as_uri()], timeout)
            match = re.search(rf'<pre id="{_MARK}">(.*?)</pre>', proc.stdout, re.S)
            if match is not None:
                break
    if match is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"Chromium did not report on {page} (exit {proc.returncode}): {tail}")
    seen = json.loads(html.unescape(match.group(1)))
    result = BrowserCheck(page=page, viewport_width=seen["viewport_width"], scroll_width=seen["scroll_width"],
                          height=seen["height"], images=seen["images"], broken=seen["broken"],
                          wide=seen["wide"], title=seen["title"])
    if screenshot is not None:
        target = Path(screenshot).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        height = max(600, min(int(result.height) + 40, 16000))
        proc = _run(chromium, [f"--window-size={width},{height}", "--virtual-time-budget=10000",
                               f"--screenshot={target}", page.as_uri()], timeout)
        if not target.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"Chromium wrote no screenshot of {page} (exit {proc.returncode}): {tail}")
        result.screenshot = target
    return result
