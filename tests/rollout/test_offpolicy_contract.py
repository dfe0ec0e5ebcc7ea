"""The off-policy data contract (``docs/arrow-layout.md``, "Off-policy data"): policy versions,
version runs, log-prob semantics, sampling parameters, kept-token sets and top-k log-probs,
filled through ``RolloutBatch.from_parts``, stored, read back by plain readers, and refused
with the field and position named when malformed."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from maxent_arrow import GenerationBatch, Ragged, RolloutBatch, RolloutStore
from maxent_arrow.arrow import (
    KEPT_IDS_TYPE,
    decode_gaps,
    encode_gaps,
    find_in_sets,
    first_bad_gap,
    token_sets,
)
from maxent_arrow.errors import LayoutError, SchemaError


def _generation(token_ids: list[list[list[int]]]) -> GenerationBatch:
    """Groups of completions whose completion info carries the generator's token ids."""
    prompts = [f"p{g}" for g in range(len(token_ids))]
    completions = [[f"c{g}.{i}" for i in range(len(rows))] for g, rows in enumerate(token_ids)]
    info = [
        [{"token_ids": ids, "finish_reason": "stop", "token_count": len(ids)} for ids in rows]
        for rows in token_ids
    ]
    return GenerationBatch(prompts, [str(g) for g in range(len(token_ids))], completions,
                           [[{} for _ in rows] for rows in token_ids], info)  # fmt: skip


def _kept_fixture(rng, groups: int, k: int, tokens: int, vocab: int, top_k: int):
    """Every token's kept set: ``top_k`` distinct ids (the ids of the top k of i.i.d. logits),
    the sampled token one of them."""
    n = groups * k * tokens
    logits = rng.standard_normal((n, vocab)).astype(np.float32) if vocab <= 4096 else None
    if logits is not None:
        kept = np.argpartition(logits, -top_k, axis=1)[:, -top_k:]
    else:  # a random top_k-subset per token without an n x vocab matrix
        kept = np.sort(rng.integers(0, vocab - top_k + 1, size=(n, top_k)), axis=1)
        kept = kept + np.arange(top_k)
        kept = rng.permuted(kept, axis=1)  # given unsorted: from_parts sorts
    sampled = kept[np.arange(n), rng.integers(0, top_k, size=n)]
    ids = sampled.reshape(groups, k, tokens).tolist()
    return ids, kept


def test_the_contract_round_trips_through_a_store_and_plain_readers(tmp_path):
    rng = np.random.default_rng(0)
    ids, kept = _kept_fixture(rng, groups=3, k=2, tokens=5, vocab=50, top_k=6)
    n = 6
    topk_ids = [[[int(t), 1] for t in row] for g in ids for row in g]
    topk_logp = [[[-0.5, -1.5] for _ in row] for g in ids for row in g]
    batch = RolloutBatch.from_parts(
        7,
        generation=_generation(ids),
        policy_version=5,
        policy_versions=[5, 5, 4, 5, 3, 5],
        version_runs=([[0], [], [0, 3], [], [0, 2], []], [[5], [], [4, 5], [], [3, 4], []]),
        logp_semantics="processed",
        sampling={"temperature": 0.7, "top_p": [0.8] * n, "top_k": 6, "min_p": 0.0},
        kept_token_ids=Ragged(torch.from_numpy(kept.reshape(-1)),
                              torch.arange(0, kept.size + 1, kept.shape[1])),  # fmt: skip
        topk=(topk_ids, topk_logp),
    )
    store = RolloutStore.create(tmp_path / "run")
    store.append(batch)
    (path,) = store.committed_files("groups")
    # pyarrow, reading the file alone: the ids decode to each token's set, ascending.
    table = pq.read_table(path)
    got, offsets = token_sets(table.column("kept_token_ids").combine_chunks())
    assert np.array_equal(got.reshape(kept.shape), np.sort(kept, axis=1))
    assert np.array_equal(offsets, np.arange(0, kept.size + 1, kept.shape[1]))
    assert pa.types.is_large_list(table.schema.field("kept_token_ids").type.value_type.value_type)
    # DuckDB on the same file: versions, semantics, sampling parameters, version runs, top-k.
    con = duckdb.connect()
    rows = con.execute(
        "SELECT unnest(completion_policy_version) v, unnest(behavior_logp_semantics) s, "
        "unnest(sampling_temperature) t, unnest(sampling_top_p) p, unnest(sampling_top_k) k, "
        "unnest(sampling_min_p) m, unnest(version_run_versions) r "
        f"FROM read_parquet('{path}') ORDER BY group_index"
    ).fetchall()
    assert [r[0] for r in rows] == [5, 5, 4, 5, 3, 5]
    assert {r[1:6] for r in rows} == {("processed", 0.7, 0.8, 6, 0.0)}
    assert [r[6] for r in rows] == [[5], [], [4, 5], [], [3, 4], []]
    # A running sum of the gaps in SQL is the set.
    first = con.execute(
        "SELECT list_reduce(list_slice(kept_token_ids[1][1], 1, 2), lambda a, b: a + b) "
        f"FROM read_parquet('{path}') WHERE group_index = 0"
    ).fetchone()
    assert first is not None and first[0] == sorted(kept[0])[1]
    top = con.execute(f"SELECT topk_token_logp[1][1] FROM read_parquet('{path}') LIMIT 1")
    assert top.fetchone() == ([-0.5, -1.5],)
    # And replay gives the batch back with them.
    (back,) = list(store.replay())
    versions = back.column("completion_policy_version")
    assert versions is not None and versions.to_pylist() == [[5, 5], [4, 5], [3, 5]]


def test_a_store_written_before_the_contract_reads_with_the_columns_absent(tmp_path):
    """A batch without any contract argument (nor policy_version) stores none of them."""
    ids, _ = _kept_fixture(np.random.default_rng(1), groups=2, k=2, tokens=3, vocab=30, top_k=4)
    store = RolloutStore.create(tmp_path / "run")
    store.append(RolloutBatch.from_parts(0, generation=_generation(ids)))
    (batch,) = list(store.replay())
    assert batch.column("completion_policy_version") is None
    assert batch.column("kept_token_ids") is None


def test_gap_codes_decode_to_the_sorted_sets_and_refuse_duplicates():
    rng = np.random.default_rng(2)
    sizes = rng.integers(0, 9, size=200)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    sets = [rng.choice(1000, size=s, replace=False) for s in sizes]
    flat = np.concatenate(sets)
    gaps = encode_gaps(flat, offsets)
    assert np.array_equal(decode_gaps(gaps, offsets), np.concatenate([np.sort(s) for s in sets]))
    twice = flat.copy()
    j = int(np.flatnonzero(sizes >= 2)[0])
    twice[offsets[j] + 1] = twice[offsets[j]]
    with pytest.raises(LayoutError, match=f"twice in set {j}"):
        encode_gaps(twice, offsets)
    negative = flat.copy()
    k = int(np.flatnonzero(sizes >= 2)[1])
    negative[offsets[k] + 1] = -3
    with pytest.raises(LayoutError, match=f"a negative id in set {k}$"):
        encode_gaps(negative, offsets)
    # The stored rule, on gap codes: a first id >= 0, every later gap >= 1.
    assert first_bad_gap(gaps, offsets) is None
    broken = gaps.copy()
    broken[offsets[j] + 1] = 0  # an id twice
    assert first_bad_gap(broken, offsets) == offsets[j] + 1
    below = gaps.copy()
    below[offsets[k]] = -1  # a negative first id
    assert first_bad_gap(below, offsets) == offsets[k]
    below[offsets[k] + 1] = 0  # a later break in the same set: the first one is named
    assert first_bad_gap(below, offsets) == offsets[k]


@pytest.mark.parametrize("ascending", [False, True])
def test_find_in_sets_gives_each_ids_position_in_its_own_set(ascending):
    """Against a plain Python lookup: each query id's flat position in its own set (not in
    another set that holds it), -1 where its set lacks it; empty sets and no sets at all."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 6, size=300)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    sets = [rng.choice(40, size=n, replace=False) for n in sizes]
    if ascending:
        sets = [np.sort(x) for x in sets]
    flat = np.concatenate(sets)
    owner = rng.integers(0, len(sizes), size=2000)
    ids = rng.integers(0, 40, size=2000)
    expected = [
        int(offsets[t]) + list(sets[t]).index(i) if i in sets[t] else -1
        for t, i in zip(owner.tolist(), ids.tolist())
    ]
    got = find_in_sets(flat, offsets, ids, owner, ascending=ascending)
    assert got.tolist() == expected
    assert 0 < (got >= 0).sum() < len(got)  # both kinds of answer were asked for
    nothing = find_in_sets(np.zeros(0), np.zeros(3, np.int64), np.array([1, 2]), np.array([0, 1]))
    assert nothing.tolist() == [-1, -1]


def _one_group(**kw):
    ids = [[[3, 4, 5], [6, 7]]]
    return RolloutBatch.from_parts(0, generation=_generation(ids), **kw)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"kept_token_ids": [[[3, 9], [4], [5]], [[6], [7], [8]]]}, LayoutError,
         r"kept_token_ids: expected 2 token sets \(one per completion token\) at group 0, "
         r"sample 1, got 3"),
        ({"kept_token_ids": [[[3, 9], [4], [5]], [[6], [1, 2]]]}, LayoutError,
         r"the sampled token 7 is not in its kept set at group 0, sample 1, token 1"),
        ({"kept_token_ids": Ragged(torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 2, 3, 4]))},
         LayoutError, r"kept_token_ids: expected 5 rows \(one per completion token\), got 4"),
        ({"topk": ([[[3], [4], [5]], [[6], [7]]], [[[-1.0], [-1.0], [-1.0]], [[-1.0], []]])},
         LayoutError, r"topk_token_logp': expected 1 log-probs .* at group 0, sample 1, token 1"),
        ({"sampling": {"top_p": [0.9, 1.5]}}, LayoutError,
         r"'sampling_top_p': top_p out of range at group 0, sample 1: 1.5"),
        ({"sampling": {"temperature": 0.0}}, LayoutError, r"temperature out of range"),
        ({"sampling": {"top_q": 1}}, SchemaError, r"unknown parameter 'top_q'"),
        ({"logp_semantics": ["raw", "logits"]}, LayoutError,
         r"'behavior_logp_semantics': expected one of \['raw', 'processed'\] at group 0, "
         r"sample 1, got 'logits'"),
        ({"policy_versions": [1, 2, 3]}, LayoutError, r"policy_versions expected 2 rows"),
        ({"policy_versions": [1, -1]}, LayoutError,
         r"'completion_policy_version': expected >= 0 at group 0, sample 1"),
        ({"policy_versions": [2, 2], "version_runs": ([[0, 2], [0]], [[2, 1], [2]])},
         LayoutError, r"versions never decrease; not so at group 0, sample 0, run 1"),
        ({"policy_versions": [2, 2], "version_runs": ([[0, 3], [0]], [[2, 3], [2]])},
         LayoutError, r"runs start below the completion's token count; not so at group 0, "
         r"sample 0, run 1"),
        ({"policy_versions": [2, 2], "version_runs": ([[0], [0]], [[2], [1]])}, LayoutError,
         r"the first run's version is completion_policy_version; not so at group 0, sample 1"),
    ],
)  # fmt: skip
def test_bad_contract_input_is_refused_naming_field_and_position(kw, error, match):
    with pytest.raises(error, match=match):
        _one_group(**kw)


def test_a_hand_built_batch_with_an_unsorted_kept_set_is_refused_and_nothing_written(tmp_path):
    good = _one_group(kept_token_ids=[[[3, 9], [4], [5]], [[6], [7, 8]]])
    column = good.groups.column("kept_token_ids")
    # Corrupt the gaps: the second id of the first set coded as a step back.
    raw = column.to_pylist()
    raw[0][0][0] = [9, -6]
    groups = good.groups.set_column(
        good.groups.schema.get_field_index("kept_token_ids"), "kept_token_ids",
        pa.array(raw, column.type),
    )  # fmt: skip
    store = RolloutStore.create(tmp_path / "run")
    with pytest.raises(LayoutError, match=r"not ascending and gap-coded at group 0, sample 0, "
                                          r"token 0"):  # fmt: skip
        store.append(RolloutBatch(groups, good.step_row))
    assert list(store.committed_files("groups")) == []


def test_top_k_64_kept_sets_take_at_most_1_5_bytes_per_id_on_disk(tmp_path):
    """The issue's fixture: vocabulary 32k, 64 groups x 8 completions of 256 tokens, top-k 64,
    appended to a real store; the Parquet column chunks of ``kept_token_ids`` on disk."""
    rng = np.random.default_rng(3)
    groups, k, tokens, vocab, top_k = 64, 8, 256, 32_000, 64
    ids, kept = _kept_fixture(rng, groups, k, tokens, vocab, top_k)
    flat = torch.from_numpy(kept.reshape(-1).astype(np.int32))
    rows = Ragged(flat, torch.arange(0, kept.size + 1, top_k, dtype=torch.int64))
    batch = RolloutBatch.from_parts(0, generation=_generation(ids), kept_token_ids=rows,
                                    policy_version=0)  # fmt: skip
    store = RolloutStore.create(tmp_path / "run")
    store.append(batch)
    (path,) = store.committed_files("groups")
    meta = pq.ParquetFile(path).metadata
    size = sum(
        meta.row_group(r).column(c).total_compressed_size
        for r in range(meta.num_row_groups)
        for c in range(meta.num_columns)
        if meta.row_group(r).column(c).path_in_schema.startswith("kept_token_ids.")
    )
    per_id = size / kept.size
    print(f"kept_token_ids: {kept.size} ids in {size} bytes on disk: {per_id:.3f} bytes per id")
    assert per_id <= 1.5
    got, _ = token_sets(pq.read_table(path, columns=["kept_token_ids"]).column(0))
    assert np.array_equal(got.reshape(kept.shape), np.sort(kept, axis=1))


def test_kept_sets_and_versions_of_a_group_split_over_ranks_reassemble_in_order(tmp_path):
    """Two ranks each store half of one group (completion indices 2, 3 on rank 0 and 0, 1 on
    rank 1); ``reassemble`` puts the kept sets and versions back in completion order."""
    from maxent_arrow.rollout import reassemble

    store = RolloutStore.create(tmp_path / "run")
    halves = {0: ([[7, 8], [9]], [2, 3]), 1: ([[5], [6, 4]], [0, 1])}
    for rank, (tokens, index) in halves.items():
        kept = [[[t, t + 100] for t in row] for row in tokens]
        batch = RolloutBatch.from_parts(0, rank=rank, generation=_generation([tokens]),
                                        policy_versions=[10 + i for i in index],
                                        kept_token_ids=kept)  # fmt: skip
        groups = batch.groups
        for name, array in (
            ("group_id", pa.array(["g"], pa.string())),
            ("group_size", pa.array([4], pa.int32())),
            ("completion_index", pa.array([index], pa.list_(pa.field("item", pa.int32(), False)))),
        ):
            groups = groups.set_column(groups.schema.get_field_index(name), name, array)
        store.append(RolloutBatch(groups, batch.step_row))
    (row,) = reassemble(store.read(steps=0)).to_pylist()
    assert row["completion_policy_version"] == [10, 11, 12, 13]
    ids, offsets = token_sets(pa.array([row["kept_token_ids"]], type=KEPT_IDS_TYPE))
    sets = [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert sets == [[5, 105], [6, 106], [4, 104], [7, 107], [8, 108], [9, 109]]


@pytest.mark.parametrize(("density", "bound"), [(0.1, 0.5), (0.5, 1.3), (0.9, 1.0)])
def test_dense_kept_sets_are_near_a_bitmap_or_smaller(tmp_path, density, bound):
    """Random kept sets of 10 %, 50 % and 90 % of a 32k vocabulary (2 x 2 completions of 64
    tokens), stored: gap coding takes at most ``bound`` times a bitmap's bytes."""
    rng = np.random.default_rng(4)
    vocab, n_tokens = 32_000, 4 * 64
    keep = rng.random((n_tokens, vocab)) < density
    rows, ids = np.nonzero(keep)
    offsets = np.concatenate([[0], np.cumsum(keep.sum(1))])
    sampled = ids[offsets[:-1]]  # each token's first kept id
    tokens = sampled.reshape(2, 2, 64).tolist()
    batch = RolloutBatch.from_parts(0, generation=_generation(tokens), kept_token_ids=Ragged(
        torch.from_numpy(ids), torch.from_numpy(offsets)))  # fmt: skip
    store = RolloutStore.create(tmp_path / "run")
    store.append(batch)
    (path,) = store.committed_files("groups")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    size = sum(meta.column(c).total_compressed_size for c in range(meta.num_columns)
               if meta.column(c).path_in_schema.startswith("kept_token_ids."))  # fmt: skip
    bitmap = n_tokens * vocab / 8
    print(f"density {density}: {size / len(ids):.3f} bytes per id, bitmap "
          f"{bitmap / len(ids):.3f}")  # fmt: skip
    assert size <= bound * bitmap
