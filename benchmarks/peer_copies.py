"""The rows of a writer-built store in the peers' formats: Lance, Delta, pyarrow's defaults.

Each copy is written from the store's own rows, read through our reader
(``ReadOnlyStore.read``, a few hundred steps at a time, in store order: step, rank, kind,
group index), one row per group with the store's list columns, by the peer's own writer with
its defaults: ``lance.write_dataset``, ``deltalake.write_deltalake``, ``pq.write_table``. So
a peer's figure is of the same rows a user would have written with it, not of our files.

Copies are kept beside their store (``<store>.lance-<version>``, ``<store>.delta-<version>``,
``<store>.parquet-default-<version>``, with the peer's version in the name) and made once;
a ``.done`` file beside each marks it complete.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.store import ReadOnlyStore

__all__ = ["delta_copy", "lance_copy", "parquet_default_copy", "store_rows"]

CHUNK_STEPS = 500


def store_rows(root: Path, *, chunk_steps: int = CHUNK_STEPS) -> pa.RecordBatchReader:
    """Every group row of the store at ``root``, in store order, as a stream of batches."""
    store = ReadOnlyStore(root)
    steps = store.steps()
    schema = store.schema("groups")
    order = [(c, "ascending") for c in R.ROW_KEY]

    def batches() -> Iterator[pa.RecordBatch]:
        for i in range(0, len(steps), chunk_steps):
            table = store.read(steps=steps[i : i + chunk_steps]).sort_by(order)
            yield from table.cast(schema).to_batches()

    return pa.RecordBatchReader.from_batches(schema, batches())


def _made(dest: Path, write: Callable[[Path], None], what: str) -> Path:
    done = dest.with_name(dest.name + ".done")
    if done.exists() and dest.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
    t0 = time.perf_counter()
    print(f"writing {what} of the store's rows: {dest}", flush=True)
    write(dest)
    done.write_text("ok\n")
    print(f"  written in {time.perf_counter() - t0:.0f} s", flush=True)
    return dest


def lance_copy(root: Path) -> Path:
    """The store's rows as a Lance dataset (``lance.write_dataset``, its defaults)."""
    import lance

    dest = root.with_name(f"{root.name}.lance-{lance.__version__}")
    return _made(dest, lambda d: lance.write_dataset(store_rows(root), str(d)), "a Lance copy")


def delta_copy(root: Path) -> Path:
    """The store's rows as a Delta table (``deltalake.write_deltalake``, its defaults)."""
    import deltalake

    dest = root.with_name(f"{root.name}.delta-{deltalake.__version__}")
    return _made(
        dest, lambda d: deltalake.write_deltalake(str(d), store_rows(root)), "a Delta copy"
    )


def parquet_default_copy(root: Path) -> Path:
    """The store's rows as one Parquet file written by ``pq.write_table`` with its defaults
    (row groups of up to 1Mi rows, no page index, dictionary encoding on, snappy)."""
    import pyarrow.parquet as pq

    def write(dest: Path) -> None:
        reader = store_rows(root)
        with pq.ParquetWriter(dest, reader.schema) as writer:
            # One table: pq.write_table's defaults, not a row group per batch.
            writer.write_table(reader.read_all())

    dest = root.with_name(f"{root.name}.parquet-default-{pa.__version__}.parquet")
    return _made(dest, write, "pyarrow's default Parquet")
