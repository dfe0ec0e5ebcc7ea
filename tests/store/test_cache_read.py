"""The checked read of an IPC cache copy: copy and check in one pass (issue 23, part 5).

A checked read copies the frame and the columns it serves into memory of the reader's own in
pieces of ``READ_PIECE`` bytes and feeds each piece to a streaming XXH3-64 as it lands. These
tests flip real bytes of a real cache file on disk, in the first, a middle and the last piece
of a column, and in the frame at both ends of the file; the digests the read checks are the
ones a plain reader computes (``xxhash`` over the buffers ``pyarrow`` maps); and a batch whose
cache file another program truncates under it is still read to the end (a real subprocess).
"""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import xxhash
from fault_harness import env

from maxent_arrow import RolloutStore, StoreError
from maxent_arrow.errors import ArgumentError
from maxent_arrow.store import ReplaySampler
from maxent_arrow.store.io.cache import READ_PIECE
from maxent_arrow.testing import make_batch

COLUMN = "ref_token_logp"


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store of one step whose token columns span several pieces each."""
    root = tmp_path_factory.mktemp("cache-read") / "s"
    store = RolloutStore.create(root, cache=True, compact_every=None)
    batch = make_batch(0, groups=96, k=(8, 8), max_tokens=2048)
    store.append(batch)
    (path,) = (root / "cache").glob("*.arrow")
    return root, batch, path, path.read_bytes()


def _buffer_ranges(path, name: str) -> list[tuple[int, int]]:
    """The file ranges (offset, length) of a column's buffers, as plain pyarrow maps them."""
    mapped = pa.memory_map(str(path)).read_buffer()
    column = ipc.open_file(mapped).get_batch(0).column(name)
    ranges = [(b.address - mapped.address, b.size) for b in column.buffers() if b is not None]
    del column, mapped
    return ranges


def _flipped(path, pristine: bytes, offset: int) -> None:
    data = bytearray(pristine)
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_the_digests_checked_are_xxh3_of_the_buffers_a_plain_reader_maps(stored):
    root, batch, path, pristine = stored
    path.write_bytes(pristine)
    mapped = pa.memory_map(str(path)).read_buffer()
    read = ipc.open_file(mapped).get_batch(0)
    recorded = read.schema.metadata[b"maxent_arrow.cache_xxh3"].split(b"=", 1)[1]
    digits = [int(recorded[i : i + 16], 16) for i in range(0, len(recorded), 16)]
    assert len(digits) == 1 + read.num_columns
    for i, name in enumerate(read.schema.names):
        hasher = xxhash.xxh3_64()
        for buffer in read.column(i).buffers():
            if buffer is not None:
                hasher.update(buffer)
        assert hasher.intdigest() == digits[1 + i], name
    del read, mapped
    # The checked read serves exactly what a plain reader of the archive gives back.
    (got,) = RolloutStore(root).replay(source="cache", columns=[COLUMN, "completion_ids"])
    for name in (COLUMN, "completion_ids"):
        assert got.groups.column(name).equals(batch.groups.column(name))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_byte_flipped_in_any_piece_of_a_column_is_found_naming_file_and_column(stored, where):
    root, batch, path, pristine = stored
    ranges = _buffer_ranges(path, COLUMN)
    offset, length = max(ranges, key=lambda r: r[1])  # the values: several pieces long
    assert length > 3 * READ_PIECE, "the column must span at least four pieces"
    at = {"first": offset, "middle": offset + length // 2, "last": offset + length - 1}[where]
    _flipped(path, pristine, at)
    try:
        reopened = RolloutStore(root)
        with pytest.raises(StoreError, match=rf"{path.name}: IPC cache column '{COLUMN}': XXH3"):
            list(reopened.replay(source="cache", columns=[COLUMN]))
        # A read of other columns is served; the damaged one's bytes are never read.
        (other,) = reopened.replay(source="cache", columns=["completion_ids"])
        assert other.groups.column("completion_ids").equals(batch.groups.column("completion_ids"))
        # The sampler's read finds it too.
        sampler = ReplaySampler(reopened, record=False, source="cache", columns=[COLUMN])
        with pytest.raises(StoreError, match=rf"{path.name}: IPC cache column '{COLUMN}'"):
            sampler.sample()
    finally:
        path.write_bytes(pristine)


def test_the_mapped_source_serves_the_same_columns_checked_in_place(stored):
    """``source="mapped"``: the cache's mapping itself, no copy (its buffers lie in the
    file's mapping), the same values as the archive, and a flipped byte still found, by
    replay and by the sampler."""
    root, batch, path, pristine = stored
    path.write_bytes(pristine)
    reopened = RolloutStore(root)
    (got,) = reopened.replay(source="mapped", columns=[COLUMN, "completion_ids"])
    (archive,) = reopened.replay(source="parquet", columns=[COLUMN, "completion_ids"])
    for name in (COLUMN, "completion_ids"):
        assert got.groups.column(name).equals(archive.groups.column(name))
    # Served from the mapping: the values buffer lies in a mapping of the cache file, as
    # the kernel lists it (/proc/self/maps); the "cache" source's lies in none.
    offset, length = max(_buffer_ranges(path, COLUMN), key=lambda r: r[1])

    def in_file_mapping(address: int) -> bool:
        for line in open("/proc/self/maps").read().splitlines():
            span, *_, name = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if name.strip() == str(path.resolve()) and lo <= address < hi:
                return True
        return False

    values = got.groups.column(COLUMN).values.values.buffers()[1]
    assert values.size == length and in_file_mapping(values.address)
    (copied,) = reopened.replay(source="cache", columns=[COLUMN])
    assert not in_file_mapping(copied.groups.column(COLUMN).values.values.buffers()[1].address)
    del got, values, copied
    _flipped(path, pristine, offset + length // 2)
    try:
        reopened = RolloutStore(root)
        with pytest.raises(StoreError, match=rf"{path.name}: IPC cache column '{COLUMN}'"):
            list(reopened.replay(source="mapped", columns=[COLUMN]))
        sampler = ReplaySampler(reopened, record=False, source="mapped", columns=[COLUMN])
        with pytest.raises(StoreError, match=rf"{path.name}: IPC cache column '{COLUMN}'"):
            sampler.sample()
    finally:
        path.write_bytes(pristine)


@pytest.mark.parametrize("bad", ["mmap", 1, None])
def test_an_unknown_source_is_an_argument_error_naming_the_choices(stored, bad):
    root, *_ = stored
    with pytest.raises(ArgumentError, match=r"replay: source must be one of 'auto', 'cache'"):
        list(RolloutStore(root).replay(source=bad))
    with pytest.raises(ArgumentError, match=r"sampler: source must be one of .*'mapped'"):
        ReplaySampler(RolloutStore(root), record=False, source=bad)


@pytest.mark.parametrize("where", ["schema message", "batch message", "footer"])
def test_a_byte_flipped_in_the_frame_is_found_by_any_checked_read(stored, where):
    root, _, path, pristine = stored
    first = min(offset for offset, _ in _buffer_ranges(path, "step"))
    schema_length = int.from_bytes(pristine[12:16], "little")
    at = {
        "schema message": 16 + schema_length // 2,  # the flatbuffer of the schema
        "batch message": first - 16,  # the batch's message (its buffers' layout)
        "footer": pristine.rfind(b'"unit"') + 2,  # the footer's record of the unit
    }[where]
    _flipped(path, pristine, at)
    try:
        with pytest.raises(StoreError, match=path.name):
            list(RolloutStore(root).replay(source="cache", columns=["advantages"]))
    finally:
        path.write_bytes(pristine)


def test_a_cache_file_cut_short_is_a_store_error_not_a_crash(stored):
    root, _, path, pristine = stored
    for size in (len(pristine) // 2, len(pristine) - 1, 12):
        path.write_bytes(pristine[:size])
        try:
            with pytest.raises(StoreError, match=path.name):
                list(RolloutStore(root).replay(source="cache", columns=[COLUMN]))
        finally:
            path.write_bytes(pristine)


TRUNCATE_UNDER_SAMPLER = """
import os, sys
from maxent_arrow import RolloutStore
from maxent_arrow.store import ReplaySampler
store = RolloutStore(sys.argv[1])
sampler = ReplaySampler(store, record=False, source="cache", cache_units=0,
                        columns=["completions", "completion_ids", "ref_token_logp"])
tensors = sampler.sample().tensors()
os.truncate(sys.argv[2], 0)  # another program truncates the cache file
total = float(tensors["ref_token_logp"].values.sum()) + int(tensors["completion_ids"].values.sum())
print("READ", total == total, int(tensors["ref_token_logp"].values.numel()))
"""


def test_a_cache_file_truncated_under_a_sampled_batch_kills_no_reader(stored):
    root, batch, path, pristine = stored
    try:
        done = subprocess.run(
            [sys.executable, "-c", TRUNCATE_UNDER_SAMPLER, str(root), str(path)],
            capture_output=True,
            text=True,
            env=env(),
            timeout=120,
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        tokens = len(batch.groups.column(COLUMN).flatten().flatten())
        assert done.stdout.split() == ["READ", "True", str(tokens)]
        assert path.stat().st_size == 0  # the file was truncated under the batch
    finally:
        path.write_bytes(pristine)
