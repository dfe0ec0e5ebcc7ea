"""A real headless browser for the tests: Debian's ``chromium`` driven by Playwright.

Playwright's own browser download fails here (no network beyond the package registries), so
the browser is the system's (``apt-get install chromium``; ``.ci/run`` installs it when
missing) and Playwright is only the driver (``pip install 'maxent-arrow[browser]'``).

- :func:`available` says whether both are there, and why not;
- :class:`Browser` opens pages at a given viewport (1280 x 900 by default), in a fresh
  profile per launch (:func:`launch`), and saves full-page screenshots as PNG files under
  :data:`ARTIFACTS` (``tests/artifacts/``, git-ignored), where they stay after the run for
  a person to look at;
- the ``browser`` fixture (``tests/conftest.py``) launches one per test session; without
  Chromium or Playwright its tests are skipped, except under CI (``CI`` set), where that is
  a failure.

The report tests use it, and so can any test of a page the project writes (the explorer).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
# Flags Chromium needs in a container without a display, a GPU or a network.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def chromium_path() -> str | None:
    """The system's Chromium executable, or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def available() -> tuple[bool, str]:
    """Whether a browser can be launched here; the reason when not."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False, "playwright is not installed (pip install 'maxent-arrow[browser]')"
    if chromium_path() is None:
        return False, "no chromium on PATH (apt-get install chromium)"
    return True, ""


def artifact_path(name: str) -> Path:
    """Where a test's screenshot ``name`` is saved (the directory is created)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return ARTIFACTS / (safe if safe.endswith(".png") else safe + ".png")


class Browser:
    """One headless Chromium; :meth:`open` gives Playwright pages."""

    def __init__(self, browser: Any):
        self._browser = browser

    @contextmanager
    def open(
        self, target: str | os.PathLike[str], *, width: int = 1280, height: int = 900
    ) -> Iterator[Any]:
        """A Playwright ``Page`` with ``target`` (a file path or a URL) loaded at a
        ``width`` x ``height`` viewport, every image decoded; closed afterwards."""
        url = str(target)
        if "://" not in url:
            url = Path(url).resolve().as_uri()
        context = self._browser.new_context(viewport={"width": width, "height": height})
        try:
            page = context.new_page()
            page.goto(url, wait_until="load")
            # `load` waits for the images to arrive; this waits for them to be decoded.
            page.wait_for_function(
                "Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)"
            )
            yield page
        finally:
            context.close()

    @staticmethod
    def screenshot(page: Any, name: str) -> Path:
        """A full-page PNG of ``page`` under :data:`ARTIFACTS`; its path."""
        path = artifact_path(name)
        page.screenshot(path=str(path), full_page=True)
        return path


@contextmanager
def launch() -> Iterator[Browser]:
    """Start Chromium headless; stop it afterwards. Playwright gives each launch a fresh
    profile (its own temporary ``--user-data-dir``), so no state carries between runs."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise RuntimeError("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable, headless=True, args=list(CHROMIUM_ARGS)
        )
        try:
            yield Browser(browser)
        finally:
            browser.close()
