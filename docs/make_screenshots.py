"""Take the README's screenshots of the explorer from the demo's run (``make screenshots``).

    python docs/make_screenshots.py [RUN]

``RUN``: a demo run directory (or its store); without it, the demo runs first (``maxent-arrow
demo --quiet`` into a new temporary directory, its defaults: the run the README describes).
The explorer is started on it for real (``maxent-arrow view RUN --port 0``) and walked in
headless Chromium (Debian's ``chromium`` driven by Playwright, as the browser tests do:
``tests/browser.py``), at 1280 px, into ``docs/images/``:

- ``explorer_overview.png``: the charts, the attempts and the config of the last step;
- ``explorer_step.png``: the last train step's groups, by reward spread;
- ``explorer_group.png``: the group of that step with the widest reward spread;
- ``explorer_tokens.png``: its best completion's tokens, decoded, coloured by log-prob.

Nothing is written to the run (the explorer only reads). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "explorer"))

# (the tests' browser harness and explorer launcher: on the path above, not installed)
from browser import available, launch  # noqa: E402  # pyright: ignore[reportMissingImports]
from viewing import served  # noqa: E402  # pyright: ignore[reportMissingImports]

from maxent_arrow.analytics.links import group_path, step_path, tokens_path  # noqa: E402
from maxent_arrow.explorer.data import RunData  # noqa: E402

IMAGES = HERE / "images"
WIDTH, HEIGHT = 1280, 900


def _store(run: Path) -> Path:
    return run / "store" if (run / "store" / "manifest.json").is_file() else run


def _demo(into: Path) -> Path:
    """The demo's run with its defaults, into ``into``."""
    out = into / "demo"
    command = [sys.executable, "-m", "maxent_arrow.cli", "demo", "--out", str(out), "--quiet"]
    print("running the demo (minutes):", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return out


def _pages(store: Path) -> dict[str, str]:
    """The page of each screenshot: the last train step, its widest group, that group's
    best completion."""
    data = RunData(store)
    step = data.overview()["steps"]["train"][-1]
    groups = data.step_groups(step, "train").rows
    widest = max(groups, key=lambda r: (r["reward_std"] or 0.0, -r["group_index"]))
    rank, index = widest["rank"], widest["group_index"]
    best = data.group(step, rank, index, "train").best or 0
    return {
        "explorer_overview.png": "/",
        "explorer_step.png": step_path(step, "train") + "&sort=reward_std&desc=1",
        "explorer_group.png": group_path(step, rank, index, "train"),
        "explorer_tokens.png": tokens_path(step, rank, index, best, "train"),
    }


def take(run: Path, images: Path = IMAGES) -> list[Path]:
    """The screenshots of the explorer on ``run``, written into ``images``; their paths."""
    ok, why = available()
    if not ok:
        raise SystemExit(f"make_screenshots: {why}")
    store = _store(run)
    images.mkdir(parents=True, exist_ok=True)
    written = []
    with served(store) as (url, _process), launch() as browser:
        for name, page_path in _pages(store).items():
            with browser.open(url + page_path, width=WIDTH, height=HEIGHT) as page:
                target = images / name
                # The first screen, as a reader sees it (a whole page can be very long).
                page.screenshot(path=str(target), full_page=False)
                written.append(target)
                print(f"wrote {target}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The README's explorer screenshots.")
    parser.add_argument("run", nargs="?", type=Path, help="a demo run (default: run the demo)")
    parser.add_argument("--images", type=Path, default=IMAGES, help="where (docs/images)")
    args = parser.parse_args(argv)
    if args.run is not None:
        take(args.run, args.images)
        return 0
    with tempfile.TemporaryDirectory(prefix="maxent-arrow-shots-") as tmp:
        take(_demo(Path(tmp)), args.images)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
