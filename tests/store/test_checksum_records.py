"""The checksums a store records and checks (``store/storage/checksums.py``), against outside
references on real files: zlib, ``google_crc32c`` and ``xxhash`` over the bytes themselves,
real Parquet files written by pyarrow (column chunks, dictionary pages, several row groups),
real sealed step files and real group files of a real store, each damaged on disk by one byte.

Written for the mutation run of issue 37 (``make mutate``, ``docs/mutation.md``): each test
names the behaviour the survivors of that run showed untested."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from maxent_arrow.errors import StoreError
from maxent_arrow.store.storage import checksums as C
from maxent_arrow.store.storage.backend import LocalBackend
from maxent_arrow.store.storage.names import STORE_META_KEY
from maxent_arrow.testing import loose_store

RNG = np.random.default_rng(37)
DATA = RNG.integers(0, 256, 300_000, dtype=np.uint8).tobytes()


def _crc32c(data: bytes) -> int:
    return google_crc32c.value(data)


# ---------------------------------------------------------------------------- whole buffers
def test_crc32_of_any_buffer_is_zlibs_unsigned_crc_of_its_bytes():
    words = np.frombuffer(DATA[:4000], dtype=np.uint32)
    assert C.crc32_of(words) == zlib.crc32(DATA[:4000]) & 0xFFFFFFFF
    assert C.crc32_of(b"123456789") == 0xCBF43926
    assert C.crc32_of(pa.py_buffer(DATA)) == zlib.crc32(DATA)


def test_crc32c_of_any_buffer_matches_google_crc32c_and_continues_a_value():
    assert C.crc32c_of(b"123456789") == 0xE3069283
    for buffer in (DATA, pa.py_buffer(DATA), bytearray(DATA), memoryview(DATA)):
        assert C.crc32c_of(buffer) == _crc32c(DATA)
    words = np.frombuffer(DATA[:4000], dtype=np.uint32)
    assert C.crc32c_of(words) == _crc32c(DATA[:4000])
    head = C.crc32c_of(DATA[:1000])
    assert C.crc32c_of(DATA[1000:], head) == _crc32c(DATA)


def test_xxh3_of_pieces_is_the_digest_of_their_concatenation():
    pieces = [DATA[:10], pa.py_buffer(DATA[10:5000]), memoryview(DATA[5000:9000])]
    assert C.xxh3_of(pieces) == xxhash.xxh3_64(DATA[:9000]).intdigest()
    assert C.xxh3_of([]) == xxhash.xxh3_64(b"").intdigest()
    stream = C.xxh3_stream()
    stream.update(DATA[:3])
    stream.update(DATA[3:20])
    assert stream.intdigest() == xxhash.xxh3_64(DATA[:20]).intdigest()


def test_checksum_names_each_algorithm_and_refuses_an_unknown_one():
    assert C.checksum(DATA, "crc32") == zlib.crc32(DATA)
    assert C.checksum(DATA, "crc32c") == _crc32c(DATA)
    with pytest.raises(StoreError, match=r"unknown checksum algorithm 'md5'.*'crc32', 'crc32c'"):
        C.checksum(DATA, "md5")


def test_a_background_check_runs_in_its_own_thread_and_gives_its_result_or_its_error():
    seen = []

    def work():
        seen.append(threading.current_thread())
        return C.crc32_of(DATA)

    wait = C.in_background(work)
    assert wait() == zlib.crc32(DATA)
    (thread,) = seen
    assert thread is not threading.current_thread()
    assert thread.name == "maxent-arrow-check" and thread.daemon

    def fails():
        raise StoreError("chunk damaged")

    with pytest.raises(StoreError, match="^chunk damaged$"):
        C.in_background(fails)()
    none = C.in_background(lambda: None)
    assert none() is None


# ---------------------------------------------------------------------------- CRC algebra
@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_the_crc_of_a_range_follows_from_the_running_crcs_at_its_ends(algorithm):
    """For ranges of every length from 0 bytes to all of them (each bit of the length: the
    zero-feeding operators up to 2^18), the CRC derived from the two running CRCs is the
    CRC of the bytes of the range."""
    checksum = (lambda b: zlib.crc32(b)) if algorithm == "crc32" else _crc32c
    lengths = [0, 1, 2, 3, 7, 8, 255, 256, 1000, 4097, 65_537, 131_072, 262_143, 299_000]
    for length in lengths:
        start = (length * 7) % (len(DATA) - length + 1)
        before = checksum(DATA[:start])
        after = checksum(DATA[: start + length])
        got = C.crc_between(before, after, length, algorithm)
        assert got == checksum(DATA[start : start + length]), (length, start)
    # (the default algorithm is CRC-32)
    assert C.crc_between(zlib.crc32(DATA[:5]), zlib.crc32(DATA[:50]), 45) == zlib.crc32(DATA[5:50])


# ---------------------------------------------------------------------------- sealed files
@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    """A real store of three appends: sealed step files, group files with chunk CRC32Cs."""
    root = tmp_path_factory.mktemp("checksums") / "run"
    loose_store(root, 3)
    return root


def _step_file(root: Path) -> bytes:
    return sorted((root / "steps").glob("*.parquet"))[0].read_bytes()


def test_a_sealed_step_file_checks_and_any_flipped_byte_does_not(store_root):
    data = _step_file(store_root)
    assert C.check_seal(data) is True
    assert C.check_seal(pa.py_buffer(data)) is True
    at = data.rfind(b"maxent-crc32=") + len(b"maxent-crc32=")
    for offset in (0, 4, len(data) // 3, len(data) // 2, at - 20, at + 8, len(data) - 5):
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        assert C.check_seal(bytes(damaged)) is False, offset
    # the stored value itself: another hex value, or no hex at all
    other = bytearray(data)
    other[at : at + 8] = b"%08x" % (int(data[at : at + 8], 16) ^ 1)
    assert C.check_seal(bytes(other)) is False
    garbled = bytearray(data)
    garbled[at : at + 8] = b"zzzzzzzz"
    assert C.check_seal(bytes(garbled)) is False


def test_a_seal_is_found_in_the_tail_it_is_said_to_lie_in_and_beyond_it(store_root):
    data = _step_file(store_root)
    from_end = len(data) - data.rfind(b"maxent-crc32=")
    assert C.check_seal(data, tail=from_end + 8) is True
    assert C.check_seal(data, tail=from_end) is True
    # a tail too short for the seal: everything is searched
    assert C.check_seal(data, tail=from_end - 1) is True
    assert C.check_seal(data, tail=4) is True
    damaged = bytearray(data)
    damaged[10] ^= 0x01
    assert C.check_seal(bytes(damaged), tail=from_end + 8) is False
    assert C.check_seal(bytes(damaged), tail=4) is False
    assert C.check_seal(data, tail=len(data) * 2) is True


def test_a_file_without_a_seal_is_none_and_one_whose_marker_is_damaged_is_false(store_root):
    group = sorted((store_root / "groups").glob("*.parquet"))[0].read_bytes()
    assert C.check_seal(group) is None
    assert C.check_seal(group, tail=100) is None
    data = _step_file(store_root)
    at = data.rfind(b"maxent-crc32=")
    broken = data[:at] + b"maxent-crc33=" + data[at + len(b"maxent-crc32=") :]
    assert C.SEAL_KEY in broken
    assert C.check_seal(broken) is False
    assert C.check_seal(broken, tail=64) is False


def test_seal_patches_the_crc_of_the_bytes_with_the_placeholder_zeroed():
    body = b"PAR1" + DATA[:500] + C.SEAL_PLACEHOLDER + b"PAR1"
    sealed = C.seal(body)
    assert len(sealed) == len(body)
    start = len(b"PAR1") + 500 + len(b"maxent-crc32=")
    assert sealed[start : start + 8] == b"%08x" % zlib.crc32(body)
    assert sealed[:start] == body[:start] and sealed[start + 8 :] == body[start + 8 :]
    assert C.check_seal(sealed) is True
    # a placeholder at the very start of the data is sealed like any other
    first = C.seal(C.SEAL_PLACEHOLDER + b"rest")
    assert first[len(b"maxent-crc32=") :][:8] == b"%08x" % zlib.crc32(C.SEAL_PLACEHOLDER + b"rest")
    assert C.check_seal(first) is True
    # the last placeholder is the one patched
    two = C.SEAL_PLACEHOLDER + b"--" + C.SEAL_PLACEHOLDER
    assert C.seal(two).startswith(C.SEAL_PLACEHOLDER + b"--maxent-crc32=")
    assert C.seal(two) != two
    with pytest.raises(StoreError, match="seal: no checksum placeholder in the file"):
        C.seal(b"PAR1 no seal PAR1")


# ---------------------------------------------------------------------------- column chunks
def _parquet(tmp_path: Path, row_groups: int = 1) -> tuple[Path, bytes, pq.FileMetaData]:
    """A real Parquet file: a dictionary-encoded string column beside plain ones, one nested
    column with a dotted name, ``row_groups`` row groups of 40 rows."""
    n = 40 * row_groups
    table = pa.table(
        {
            "step": pa.array(np.arange(n, dtype=np.int64)),
            "kind": pa.array(["train", "eval"] * (n // 2)),
            "my.score": pa.array([[float(i), float(i) / 2] for i in range(n)]),
            "my": pa.array(RNG.random(n)),
        }
    )
    path = tmp_path / "file.parquet"
    pq.write_table(table, path, row_group_size=40, use_dictionary=["kind"], compression="zstd")
    data = path.read_bytes()
    return path, data, pq.read_metadata(path)


def test_chunk_ranges_tile_the_bytes_between_the_magic_and_the_footer(tmp_path):
    """The ranges of all chunks, dictionary pages included, cover the data part of the file
    exactly: from byte 4 (after ``PAR1``) to the footer, without gap or overlap."""
    _, data, metadata = _parquet(tmp_path, row_groups=3)
    ranges = C.chunk_ranges(metadata)
    assert len(ranges) == 3
    assert all(set(rg) == {"step", "kind", "my.score.list.element", "my"} for rg in ranges)
    spans = sorted(span for rg in ranges for span in rg.values())
    at = 4
    for offset, length in spans:
        assert offset == at and length > 0
        at += length
    f_offset, f_length = C.footer_range(len(data), metadata)
    assert at == f_offset
    assert f_offset + f_length == len(data)
    assert data[f_offset - 4 : f_offset] != b"PAR1" and data[-4:] == b"PAR1"
    assert int.from_bytes(data[-8:-4], "little") == metadata.serialized_size == f_length - 8
    kind = metadata.row_group(0).column(1)
    assert kind.has_dictionary_page
    assert ranges[0]["kind"][0] == kind.dictionary_page_offset < kind.data_page_offset


def test_chunk_crcs_from_write_boundaries_equal_those_read_back(tmp_path):
    """The chunk record of a file written through the backend (running CRCs at each write
    boundary) is the record read back byte range by byte range, for both algorithms, and
    only CRC32C records name their algorithm."""
    path, data, metadata = _parquet(tmp_path, row_groups=2)
    backend = LocalBackend(tmp_path / "store")
    backend.makedirs("groups")
    pending = backend.write_temp(
        "groups/copy.parquet",
        produce=lambda sink: pq.write_table(pq.read_table(path), sink, row_group_size=40),
    )
    written = (tmp_path / "store" / pending.temp).read_bytes()
    meta = pq.read_metadata(pa.py_buffer(written))
    reads: list[tuple[int, int]] = []

    def read_range(offset, length):
        reads.append((offset, length))
        return written[offset : offset + length]

    for algorithm, bounds in (("crc32", pending.boundaries), ("crc32c", pending.boundaries_c)):
        by_boundaries = C.chunk_crcs(meta, len(written), bounds, read_range, algorithm)
        assert reads == []  # every chunk starts and ends on a write boundary
        by_reading = C.chunk_crcs(meta, len(written), [], read_range, algorithm)
        assert reads  # nothing to derive from: each range read
        reads.clear()
        assert by_boundaries == by_reading
        for rg in by_reading["row_groups"]:
            for offset, length, crc in rg.values():
                assert crc == C.checksum(written[offset : offset + length], algorithm)
        f_offset, f_length, f_crc = by_reading["footer"]
        assert (f_offset, f_length) == C.footer_range(len(written), meta)
        assert f_crc == C.checksum(written[f_offset:], algorithm)
        assert by_reading["row_group_rows"] == [40, 40]
        assert ("algorithm" in by_reading) == (algorithm == "crc32c")
        if algorithm == "crc32c":
            assert by_reading["algorithm"] == "crc32c"
    # the default is CRC-32, and a range with only one end on a boundary is read
    start = C.chunk_ranges(meta)[0]["step"][0]
    half = C.chunk_crcs(meta, len(written), [(start, zlib.crc32(written[:start]))], read_range)
    assert half == C.chunk_crcs(meta, len(written), pending.boundaries, read_range)
    assert reads


def test_row_groups_of_a_row_range_are_those_that_hold_its_rows():
    record = {"row_group_rows": [3, 4, 5]}
    assert C.row_groups_of(record, 0, 3) == [0]
    assert C.row_groups_of(record, 0, 4) == [0, 1]
    assert C.row_groups_of(record, 2, 2) == [0, 1]
    assert C.row_groups_of(record, 3, 1) == [1]
    assert C.row_groups_of(record, 3, 4) == [1]
    assert C.row_groups_of(record, 6, 2) == [1, 2]
    assert C.row_groups_of(record, 7, 5) == [2]
    assert C.row_groups_of(record, 0, 12) == [0, 1, 2]
    assert C.row_groups_of(record, 12, 3) == []
    assert C.row_groups_of({"footer": [0, 0, 0]}, 0, 1) is None


def test_a_chunk_belongs_to_a_column_by_its_whole_name_dots_included():
    assert C.chunk_of("my", ["my"])
    assert C.chunk_of("my.score.list.element", ["my.score"])
    assert C.chunk_of("my.score.list.element", ["my"])  # more chunks, never fewer
    assert not C.chunk_of("myscore", ["my"])
    assert not C.chunk_of("my", ["my.score"])
    assert not C.chunk_of("step", [])
    assert C.chunk_of("step", ["kind", "step"])
    assert C.covered("anything.at.all", None)
    assert C.covered("step", {"step"})
    assert C.covered("prompt_ids.list.element", {"prompt_ids"})
    assert C.covered("my.score.list.element", frozenset({"my.score"}))
    assert not C.covered("my.score.list.element", {"my.scores"})
    assert not C.covered("step", {"kind"})
    assert not C.covered("stepx", {"step"})


def _group_record(root: Path, index: int = 0) -> tuple[Path, dict]:
    import json

    step = sorted((root / "steps").glob("*.parquet"))[index]
    meta = json.loads(pq.read_metadata(step).metadata[STORE_META_KEY])
    return root / "groups" / meta["group_file"], meta["chunks"]


def _reader(path: Path, log: list | None = None):
    def read_ranges(ranges):
        data = path.read_bytes()
        if log is not None:
            log.extend(ranges)
        return [data[offset : offset + length] for offset, length in ranges]

    return read_ranges


def test_a_clean_group_file_checks_reading_only_the_footer_and_the_chunks_asked_for(store_root):
    path, record = _group_record(store_root)
    assert record["algorithm"] == "crc32c"
    read: list[tuple[int, int]] = []
    C.check_chunks("g", record, _reader(path, read), ["step", "advantages"])
    footer = tuple(record["footer"][:2])
    wanted = {tuple(v[:2]) for k, v in record["row_groups"][0].items() if k in ("step",)}
    wanted |= {
        tuple(v[:2]) for k, v in record["row_groups"][0].items() if k.startswith("advantages.")
    }
    assert read[0] == footer
    assert set(read[1:]) == wanted and len(read) == len(wanted) + 1
    read.clear()
    C.check_chunks("g", record, _reader(path, read), None)
    assert len(read) == 1 + len(record["row_groups"][0])
    read.clear()
    C.check_chunks("g", record, _reader(path, read), [])
    assert read == [footer]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_chunk_is_named_by_file_column_offset_and_crcs(tmp_path):
    root = tmp_path / "run"
    loose_store(root, 1)
    path, record = _group_record(root)
    offset, length, crc = record["row_groups"][0]["step"]
    _flip(path, offset + length // 2)
    C.check_chunks("g", record, _reader(path), ["advantages"])  # not a column it reads
    with pytest.raises(StoreError) as caught:
        C.check_chunks("groups/x.parquet", record, _reader(path), ["step"])
    got = C.crc32c_of(path.read_bytes()[offset : offset + length])
    assert str(caught.value) == (
        f"groups/x.parquet: column chunk step at byte {offset}: CRC32C {got:08x}, expected "
        f"{crc:08x} (corrupt)"
    )
    # the footer is checked whatever the columns
    f_offset = record["footer"][0]
    _flip(path, offset + length // 2)
    _flip(path, f_offset + 10)
    with pytest.raises(StoreError, match=r"column chunk \(footer\) at byte"):
        C.check_chunks("g", record, _reader(path), [])


def test_a_chunk_cut_short_is_named_a_truncated_file(store_root):
    path, record = _group_record(store_root)
    data = path.read_bytes()
    cut = record["row_groups"][0]["step"][0] + 2

    def short(ranges):
        return [data[:cut][offset : offset + length] for offset, length in ranges]

    with pytest.raises(StoreError, match=r"^g: column chunk step is cut short \(truncated file\)$"):
        C.check_chunks("g", {**record, "footer": [0, 4, C.crc32c_of(data[:4])]}, short, ["step"])


def test_a_crc32_record_is_checked_with_crc32_and_named_so(tmp_path):
    """An older store's record (no ``algorithm``: CRC-32) is checked with CRC-32."""
    path, data, metadata = _parquet(tmp_path)

    def read_range(offset, length):
        return data[offset : offset + length]

    record = C.chunk_crcs(metadata, len(data), [], read_range)
    assert "algorithm" not in record
    C.check_chunks("old", record, _reader(path), None)
    offset, length, _ = record["row_groups"][0]["my"]
    _flip(path, offset + length - 1)
    with pytest.raises(StoreError, match=r"^old: column chunk my at byte \d+: CRC-32 [0-9a-f]{8}"):
        C.check_chunks("old", record, _reader(path), ["my"])
    with pytest.raises(StoreError):
        C.check_chunks("old", record, _reader(path), ["my.score", "my"])
    C.check_chunks("old", record, _reader(path), ["my.score"])  # the dotted column only


def test_damage_in_one_row_group_is_named_with_its_label_and_others_are_not_read(tmp_path):
    path, data, metadata = _parquet(tmp_path, row_groups=3)

    def read_range(offset, length):
        return data[offset : offset + length]

    record = C.chunk_crcs(metadata, len(data), [], read_range, "crc32c")
    offset, length, _ = record["row_groups"][1]["kind"]
    _flip(path, offset + length // 2)
    labels = ["step 0", "step 1", "step 2"]
    C.check_chunks("seg", record, _reader(path), ["kind"], row_groups=[0, 2], labels=labels)
    with pytest.raises(StoreError, match=r"^seg: column chunk row group 1 \(step 1\), kind at"):
        C.check_chunks("seg", record, _reader(path), ["kind"], row_groups=[1], labels=labels)
    with pytest.raises(StoreError, match=r"^seg: column chunk row group 1, kind at"):
        C.check_chunks("seg", record, _reader(path), ["kind"])
    with pytest.raises(StoreError, match=r"^seg: column chunk row group 1, kind at"):
        C.check_chunks("seg", record, _reader(path), ["kind"], labels=["step 0"])
    with pytest.raises(StoreError, match=r"^seg: column chunk row group 1, kind at"):
        C.check_chunks("seg", record, _reader(path), ["kind"], labels=["a", "", "c"])
