"""TRL's micro-batch split of each training round, recorded beside the round and read back.

TRL shuffles every generation batch before it cuts it into ``steps_per_generation``
micro-batches (``_prepare_inputs``: :func:`~.trl_contract.next_shuffle`), with the global
generator, so which completions share a micro-batch is a draw. A loss normalised per
micro-batch (``loss_type="bnpo"``), a batch-level normalisation at gradient accumulation
above 1, and the order of every sum depend on it; the stored tokens alone do not say it.

The recorder (:mod:`.trl`) draws the permutation TRL is about to draw, at the end of each
training round, and records it as one row of the record table ``trl_split``
(:data:`SPLIT_TABLE`, :func:`split_rows`; appended with the round's step, through the commit
log, so a resume supersedes it with the round): the round's ``step``, ``rank``, ``kind`` and
``round`` (its place among the step's rounds), and ``order``, TRL's permutation of the
process's rows of the round (row ``j`` of the shuffled batch is row ``order[j]`` of the round
in store order: group by group, each group's completions in order). The store-fed trainer
(:mod:`.trl_replay`) reads them back (:func:`recorded_splits`) and gives TRL a stored round
in the order under which TRL's own shuffle yields the recorded split (:func:`presplit`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import StoreError
from maxent_arrow.store import ReadOnlyStore

__all__ = ["ROUND_KEY", "SPLIT_TABLE", "SplitKey", "presplit", "recorded_splits", "split_rows"]

SPLIT_TABLE = "trl_split"
# A round of the store: its unit (step, rank, kind) and its round in the unit.
ROUND_KEY = (*R.UNIT_KEY, "round")
SplitKey = tuple[int, int, str, int]


def split_rows(step: int, rank: int, orders: Sequence[np.ndarray]) -> pa.Table:
    """The ``trl_split`` rows of one step's training rounds on one process: ``orders[r]`` is
    the permutation TRL drew for round ``r`` (its rows in store order)."""
    n = len(orders)
    key = [
        pa.array([step] * n, pa.int64()),
        pa.array([rank] * n, pa.int32()),
        pa.array(["train"] * n, pa.string()),
        pa.array(range(n), pa.int32()),
    ]
    order = pa.array(
        [np.asarray(o, dtype=np.int32) for o in orders],
        pa.list_(pa.field("item", pa.int32(), nullable=False)),
    )
    return pa.table([*key, order], names=[*ROUND_KEY, "order"])


def recorded_splits(store: ReadOnlyStore) -> dict[SplitKey, np.ndarray]:
    """Every recorded split of the store's effective history, by round (empty for a store
    recorded before splits were: TRL's shuffle then draws a new one). A permutation that is
    not one raises :class:`~maxent_arrow.errors.StoreError` naming its round."""
    if SPLIT_TABLE not in store.record_names():
        return {}
    table = store.read_records(SPLIT_TABLE)
    keys = zip(*(table.column(name).to_pylist() for name in ROUND_KEY), strict=True)
    out: dict[SplitKey, np.ndarray] = {}
    for key, order in zip(keys, table.column("order").to_pylist(), strict=True):
        values = np.asarray(order, dtype=np.int64)
        if not np.array_equal(np.sort(values), np.arange(len(values))):
            raise StoreError(
                f"{SPLIT_TABLE}: the order of step {key[0]}, rank {key[1]}, {key[2]} round "
                f"{key[3]} is not a permutation of its {len(values)} rows"
            )
        out[(int(key[0]), int(key[1]), str(key[2]), int(key[3]))] = values
    return out


def presplit(order: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """The row order to give TRL so that its shuffle, which will draw ``drawn``
    (:func:`~.trl_contract.next_shuffle`), yields the recorded ``order``: TRL's shuffled row
    ``j`` is given row ``drawn[j]``, which is then stored row ``order[j]``."""
    if len(order) != len(drawn):
        raise StoreError(
            f"{SPLIT_TABLE}: a recorded split of {len(order)} rows for a batch of {len(drawn)}"
        )
    index = np.empty(len(order), dtype=np.int64)
    index[np.asarray(drawn, dtype=np.int64)] = order
    return index
