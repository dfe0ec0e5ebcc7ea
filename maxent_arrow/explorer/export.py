"""A selection of the explorer (a step's groups, as filtered) to a Hugging Face dataset folder.

The folder is what the Hub stores for a Parquet dataset: ``data/<split>-00000-of-00001.parquet``
and a dataset card, ``README.md``, whose YAML header names the split's files. It is written
locally, under the directory ``maxent-arrow view --export-dir DIR`` was given (never inside the
store), atomically (a temporary folder renamed), and the same selection names the same folder.
``datasets.load_dataset(folder)`` reads it; ``huggingface-cli upload`` pushes it as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxent_arrow.arrow import lists as L
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, MissingExtraError
from maxent_arrow.explorer.data import History, RunData

__all__ = ["check_export_dir", "dataset_card", "export_groups", "export_wandb"]


def check_export_dir(out: str | os.PathLike[str], store_root: Any) -> Path:
    """``out`` resolved; refused when it is inside the store (the explorer writes nothing
    there) or exists and is not a directory."""
    path = Path(out).expanduser().resolve()
    if isinstance(store_root, Path):
        root = store_root.resolve()
        if path == root or root in path.parents:
            raise ArgumentError(f"--export-dir {out}: inside the store {root}; choose another")
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"--export-dir {out}: exists and is not a directory")
    return path


def dataset_card(info: dict[str, Any], table: pa.Table) -> str:
    """The dataset card: YAML header (the split's files), what the selection is, its columns."""
    split = info["split"]
    lines = [
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        f"  - split: {split}",
        f"    path: data/{split}-*.parquet",
        "tags:",
        "- reinforcement-learning",
        "- grpo",
        "- maxent-arrow",
        "---",
        "",
        f"# {info['name']}",
        "",
        f"Prompt groups exported by `maxent-arrow view` from the rollout store `{info['run']}`: "
        f"{info['kind']} step {info['step']} ({info['history']} history), {table.num_rows} group "
        f"rows, {info['completions']} completions.",
        "",
        f"Selection: `{json.dumps(info['filters'], sort_keys=True)}`.",
        "",
        "One row per prompt group (its K completions in list columns). Load it with "
        '`datasets.load_dataset("path/to/this/folder")`; push it with '
        "`huggingface-cli upload REPO path/to/this/folder --repo-type dataset`.",
        "",
        "## Columns",
        "",
        "| column | type | meaning |",
        "|---|---|---|",
    ]
    for field in table.schema:
        try:
            doc = R.column(field.name).doc
        except KeyError:
            prefix = R.prefix_of(field.name)
            doc = prefix.doc if prefix else ""
        doc = " ".join(doc.split()).replace("|", "\\|")
        lines.append(f"| `{field.name}` | `{field.type}` | {doc} |")
    return "\n".join(lines) + "\n"


def _selection(
    data: RunData, step: int, kind: str, history: History, rows: list[dict[str, Any]]
) -> pa.Table:
    """The group rows ``rows`` (dicts with rank, group_index and attempt) of ``step``."""
    if not rows:
        raise ArgumentError("export: the selection is empty")
    table = data.store(history).read(steps=step, kind=kind)
    attempts = data.row_attempts(step, kind, history)
    where = {
        (r, g, attempts[i][0] if i < len(attempts) else ""): i
        for i, (r, g) in enumerate(
            zip(table.column("rank").to_pylist(), table.column("group_index").to_pylist())
        )
    }
    positions = [where[(r["rank"], r["group_index"], r["attempt"])] for r in rows]
    return table.take(L.int64_array(positions))


def _name(data: RunData, step: int, kind: str, history: History, groups: int, filters) -> str:
    key = json.dumps([data.uri, step, kind, history, sorted(filters.items())], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{Path(str(data.store().root)).name}-{kind}-step{step}-{groups}groups-{digest}"


def export_wandb(
    data: RunData,
    out: Path,
    *,
    step: int,
    kind: str,
    history: History,
    rows: list[dict[str, Any]],
    filters: dict[str, str],
) -> Path:
    """The selection as a W&B table (one row per completion) in an offline W&B run under
    ``out/wandb`` (``wandb sync`` uploads it); the run's directory. Needs the ``view-wandb``
    extra."""
    try:
        import wandb
    except ImportError:
        raise MissingExtraError("wandb", "view-wandb") from None
    chosen = _selection(data, step, kind, history, rows)
    name = _name(data, step, kind, history, len(rows), filters)
    groups = chosen.to_pylist()
    functions = list(dict.fromkeys(n for g in groups for n in g.get("reward_names") or []))
    columns = [*R.ROW_KEY, "attempt", "completion", "prompt", "text", "total_util", "advantage"]
    columns += [f"reward_{f}" for f in functions]
    table_rows = []
    for g, picked in zip(groups, rows):
        prompt = g.get("prompt") or json.dumps(g.get("prompt_messages"), default=str)
        names = g.get("reward_names") or []
        for i, text in enumerate(g.get("completions") or []):
            values = (g.get("reward_values") or [])[i] if g.get("reward_values") else []
            by_name = dict(zip(names, values or []))
            table_rows.append(
                [g["step"], g["rank"], g["kind"], g["group_index"], picked["attempt"], i, prompt,
                 text, (g.get("total_utils") or [None] * (i + 1))[i],
                 (g.get("advantages") or [None] * (i + 1))[i],
                 *(by_name.get(f) for f in functions)]
            )  # fmt: skip
    target = out / "wandb"
    target.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        mode="offline",
        dir=str(out),
        project="maxent-arrow-view",
        name=name,
        config={"run": data.uri, "step": step, "kind": kind, "history": history,
                "filters": filters},
        settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
    )  # fmt: skip
    try:
        run.log({"groups": wandb.Table(columns=list[Any](columns), data=table_rows)})
    finally:
        run.finish()
    return Path(run.dir).parent


def export_groups(
    data: RunData,
    out: Path,
    *,
    step: int,
    kind: str,
    history: History,
    rows: list[dict[str, Any]],
    filters: dict[str, str],
) -> Path:
    """Write the group rows ``rows`` (dicts with rank, group_index and attempt, from the step
    page) of ``step`` as a dataset folder under ``out``; its path."""
    chosen = _selection(data, step, kind, history, rows)
    name = _name(data, step, kind, history, len(rows), filters)
    target = out / name
    if target.exists():  # the same selection: already written
        return target
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out))
    try:
        (tmp / "data").mkdir()
        split = "train" if kind == "train" else kind
        pq.write_table(chosen, tmp / "data" / f"{split}-00000-of-00001.parquet")
        completions = sum(len(c or []) for c in chosen.column("completions").to_pylist())
        info = {"name": name, "run": data.uri, "step": step, "kind": kind, "history": history,
                "filters": filters, "split": split, "completions": completions}  # fmt: skip
        (tmp / "README.md").write_text(dataset_card(info, chosen), encoding="utf-8")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
