"""A step's selection exported from the browser to a Hugging Face dataset folder (Parquet
under data/ and a dataset card), read back with ``datasets.load_dataset``; export off without
``--export-dir``, refused inside the store; the store unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import fingerprint, served  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402


def test_a_filtered_step_exports_to_a_dataset_folder(browser, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    root = tmp_path / "store"
    stores.demo_like_store(root, steps=3)
    out = tmp_path / "exports"
    before = fingerprint(root)
    with served(root, "--export-dir", str(out)) as (url, _proc):
        with browser.open(url + "/step/0?kind=train&status=trained") as page:
            page.click("#export")
            page.wait_for_selector("#exported")
            folder = Path(page.inner_text("#folder"))
            card = page.inner_text("#card")
            browser.screenshot(page, "explorer_export")
        # The same selection again: the same folder, not a second one.
        with browser.open(url + "/step/0?kind=train&status=trained") as page:
            page.click("#export")
            page.wait_for_selector("#exported")
            assert Path(page.inner_text("#folder")) == folder
    assert fingerprint(root) == before
    assert folder.parent == out.resolve() and [p.name for p in out.iterdir()] == [folder.name]
    assert card.startswith("---\nconfigs:") and "| `total_utils` |" in card
    assert (folder / "README.md").read_text() == card + ("" if card.endswith("\n") else "\n")
    loaded = datasets.load_dataset(str(folder), split="train")
    stored = RolloutStore(root).read(steps=0, kind="train").to_pylist()
    want = [r for r in stored if r["group_index"] != stores.DROPPED_GROUP]  # status=trained
    assert loaded.num_rows == len(want) == stores.GROUPS - 1
    assert [r["group_index"] for r in loaded] == [r["group_index"] for r in want]
    assert [r["completion_ids"] for r in loaded] == [r["completion_ids"] for r in want]
    assert (
        loaded[0]["prompt_messages"] is None and loaded[1]["prompt_messages"][0]["role"] == "system"
    )


def test_export_is_off_without_a_directory_and_refused_inside_the_store(tmp_path):
    import urllib.error
    import urllib.request

    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2, resume=False)
    with served(root) as (url, _proc):
        try:
            urllib.request.urlopen(url + "/export/step/0?kind=train")
            raise AssertionError("export answered without --export-dir")
        except urllib.error.HTTPError as exc:
            assert exc.code == 403 and "--export-dir" in exc.read().decode()
    out = subprocess.run(
        [sys.executable, "-m", "maxent_arrow.cli", "view", str(root), "--port", "0",
         "--export-dir", str(root / "exports")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "inside the store" in out.stderr
    assert not (root / "exports").exists()
    # Another site's page cannot make the explorer write an export (a link, an image there).
    exports = tmp_path / "exports"
    with served(root, "--export-dir", str(exports)) as (url, _proc):
        request = urllib.request.Request(
            url + "/export/step/0?kind=train", headers={"Sec-Fetch-Site": "cross-site"}
        )
        try:
            urllib.request.urlopen(request)
            raise AssertionError("a cross-site export was answered")
        except urllib.error.HTTPError as exc:
            assert exc.code == 403 and "another site" in exc.read().decode()
    assert not exports.exists() or not any(exports.iterdir())


def test_a_selection_exports_to_an_offline_wandb_table(browser, tmp_path):
    import json

    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2, resume=False)
    out = tmp_path / "exports"
    before = fingerprint(root)
    with served(root, "--export-dir", str(out)) as (url, _proc):
        with browser.open(url + "/step/1?kind=train&status=dropped") as page:
            page.click("#export-wandb")
            page.wait_for_selector("#exported", timeout=120_000)
            run_dir = Path(page.inner_text("#folder"))
    assert fingerprint(root) == before
    assert run_dir.parent == (out / "wandb").resolve() and run_dir.name.startswith("offline-run")
    assert list(run_dir.glob("run-*.wandb"))
    (table,) = run_dir.glob("files/media/table/groups_*.table.json")
    logged = json.loads(table.read_text())
    group = RolloutStore(root).read(steps=1, kind="train").to_pylist()[stores.DROPPED_GROUP]
    assert len(logged["data"]) == stores.K  # the one dropped group's completions
    at = {c: i for i, c in enumerate(logged["columns"])}
    assert [r[at["text"]] for r in logged["data"]] == group["completions"]
    assert [r[at["reward_accuracy"]] for r in logged["data"]] == [
        v[0] for v in group["reward_values"]
    ]
