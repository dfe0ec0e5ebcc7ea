"""Benchmark: Arrow columns to torch, and Arrow token columns to padded ids + mask.

(a) Column -> torch, N = 10^3 .. 10^7 float64 samples. Ours: ``arrow_to_torch`` (what a
    record's ``tensor(name)`` calls: checks, then DLPack over the Arrow buffer). Best peer, and
    the floor of a zero-copy view: a bare ``torch.from_dlpack(column)``. Naive baseline: what
    the seed does with its Python lists, ``torch.tensor(python_list)``. Context: a memcpy of
    the N * 8 bytes. Targets: ours within 1.3x the bare DLPack call, and flat in N (ours at
    the largest N within 3x of ours at the smallest).

(b) Arrow ``list<int32>`` token column -> right-padded int64 ids + bool mask, for
    4096 rows x 128..512 tokens and 256 rows x 750..3000 tokens (uniform lengths).
    Ours: ``Ragged.from_arrow(column).to_padded(pad, dtype=torch.int64)`` (fresh outputs), and
    with ``out=`` buffers reused from the last call (context). Naive baseline (seed style,
    from the Python lists the seed holds): ``pad_sequence([torch.tensor(x) for x in lists])``
    and a mask from the lengths. Best peer: the fastest of three things a user who has the
    Arrow column would write: a numpy mask scatter (``mask = arange(W) < lengths[:, None];
    ids[mask] = values``), ``pad_sequence(torch.split(values, lengths))`` over zero-copy
    views, and a jagged nested tensor's ``to_padded_tensor`` (with ``max_seqlen``). Floor:
    one memcpy of the output bytes (ids + mask) into a preallocated, already-touched buffer.
    Targets: >= 30x the baseline, >= 1x the best peer, <= 3x the floor, for both shapes.

Every figure is the median of interleaved repeats (the machine may be shared), and all ratios
come from the same run. torch runs on one thread (``--threads N`` to change it). Run
``python benchmarks/bench_ragged.py [--quick] [--json PATH]``; the exit status is 1 when a
target is missed (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Figure, custom, faster_than, within  # noqa: E402

from maxent_arrow import Ragged  # noqa: E402
from maxent_arrow.arrow import arrow_to_torch  # noqa: E402

TARGET_VS_BASELINE = 30.0
TARGET_VS_PEER = 1.0
TARGET_VS_FLOOR = 3.0
TARGET_VS_DLPACK = 1.3
FLAT_LIMIT = 3.0  # ours at the largest N within this factor of ours at the smallest
CALLS = 1000  # (a) times this many calls per sample: one call is ~1 us
PAD = 0  # the numpy peer relies on it (np.zeros)
VOCAB = 151_936


def memcpy(nbytes: int) -> Callable[[], None]:
    """The floor: one memcpy of ``nbytes`` into a preallocated, already-touched buffer."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    # The closure keeps both arrays alive (it copies between their buffers by address).
    return lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)


def calls(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(CALLS):
            fn()

    return run


# ---------------------------------------------------------------------------- (a)
def column_to_torch(bench: harness.Bench, sizes: list[int]) -> None:
    print("(a) column -> torch (float64 samples)")
    rng = np.random.default_rng(0)
    ours_at: list[float] = []
    for n in sizes:
        column = pa.array(rng.normal(size=n))
        python_list = column.to_pylist()  # what the seed holds
        tensor = arrow_to_torch(column)
        assert tensor.data_ptr() == column.buffers()[1].address, "not zero-copy"
        assert torch.equal(tensor, torch.tensor(python_list, dtype=torch.float64))
        # Ours and the bare DLPack call are timed in their own loop: right after the
        # baseline, which walks N Python floats and evicts the caches, their first touches of
        # torch's and pyarrow's code would hide that the call itself does no O(N) work.
        views = harness.measure(
            {
                "ours": calls(lambda c=column: arrow_to_torch(c)),
                "peer": calls(lambda c=column: torch.from_dlpack(c)),
            },
            bench.repeats(15, 5),
        )
        reps = bench.repeats(9, 3) if n <= 10**6 else bench.repeats(3, 2)
        copies = harness.measure(
            {
                "baseline": lambda lst=python_list: torch.tensor(lst, dtype=torch.float64),
                "memcpy": memcpy(n * 8),
            },
            reps,
        )
        ours, peer = views["ours"].scaled(1 / CALLS), views["peer"].scaled(1 / CALLS)
        ours_at.append(ours.median)
        last = n == sizes[-1]
        targets = [within("peer", TARGET_VS_DLPACK)]
        if last:
            growth = ours_at[-1] / ours_at[0]
            label = f"ours at N={sizes[-1]:.0e} / at N={sizes[0]:.0e}"
            targets.append(custom(label, growth, "<=", FLAT_LIMIT))
        dlpack = Figure(peer, "bare `torch.from_dlpack(col)`")
        bench.row(
            f"column → torch, {n:,} float64 samples",
            ours=Figure(ours, "`arrow_to_torch` (checked, zero copy)"),
            baseline=Figure(copies["baseline"], "`torch.tensor(list)`"),
            peer=dlpack,
            floor=dlpack,
            targets=targets,
            note=f"peer = floor (zero copy); a memcpy of the bytes: "
            f"{harness.fmt_value(copies['memcpy'].median)}",
            reason="a few Python checks (type, nulls) on top of the DLPack call: a per-call "
            "constant, swamped by noise at this size",
            detail=not last,
        )
        print(f"    N={n:>10,}: ours {harness.fmt_value(ours.median)}, "
              f"from_dlpack {harness.fmt_value(peer.median)}")  # fmt: skip


# ---------------------------------------------------------------------------- (b)
def token_column(rng: np.random.Generator, rows: int, lo: int, hi: int) -> pa.Array:
    lengths = rng.integers(lo, hi + 1, rows)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))


def seed_style(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [torch.tensor(x, dtype=torch.int64) for x in lists]
    ids = pad_sequence(rows, batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(x) for x in lists])
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return ids, mask


def ours(column: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
    return Ragged.from_arrow(column).to_padded(PAD, dtype=torch.int64)


def numpy_peer(column: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectorised pad a numpy user writes: a broadcast mask, one boolean scatter."""
    values = column.flatten().to_numpy()
    lengths = np.diff(column.offsets.to_numpy())
    width = int(lengths.max())
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.zeros((len(lengths), width), dtype=np.int64)  # PAD is 0
    ids[mask] = values
    return torch.from_numpy(ids), torch.from_numpy(mask)


def split_peer(column: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own padding over zero-copy row views (no Python lists of ints)."""
    values = torch.from_dlpack(column.flatten()).to(torch.int64)
    lengths = np.diff(column.offsets.to_numpy())
    ids = pad_sequence(torch.split(values, lengths.tolist()), batch_first=True, padding_value=PAD)
    mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
    return ids, mask


def nested_peer(column: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
    """A jagged nested tensor padded by torch (``max_seqlen`` given: the longest row)."""
    values = torch.from_dlpack(column.flatten()).to(torch.int64)
    offsets = torch.from_numpy(column.offsets.to_numpy().astype(np.int64))
    lengths = offsets[1:] - offsets[:-1]
    nested = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=int(lengths.max()))
    ids = nested.to_padded_tensor(PAD)
    return ids, torch.arange(ids.shape[1])[None, :] < lengths[:, None]


PEERS = {
    "numpy mask scatter": numpy_peer,
    "`pad_sequence(torch.split(values))`": split_peer,
    "nested `to_padded_tensor`": nested_peer,
}


def padded_ids(bench: harness.Bench, shapes: list[tuple[int, int, int]]) -> None:
    print("\n(b) Arrow token column -> padded int64 ids + bool mask (right padding)")
    rng = np.random.default_rng(1)
    for rows, lo, hi in shapes:
        column = token_column(rng, rows, lo, hi)
        lists = column.to_pylist()
        ids, mask = ours(column)
        for name, fn in {"baseline": seed_style, **PEERS}.items():
            other = fn(lists if name == "baseline" else column)
            assert torch.equal(ids, other[0]) and torch.equal(mask, other[1]), name
        out_bytes = ids.numel() * ids.element_size() + mask.numel() * mask.element_size()
        buffers = (torch.empty_like(ids), torch.empty_like(mask))

        def reused(c=column, out=buffers):
            return Ragged.from_arrow(c).to_padded(PAD, dtype=torch.int64, out=out)

        fns = {
            "ours": lambda c=column: ours(c),
            "reused": reused,
            "baseline": lambda lst=lists: seed_style(lst),
            "floor": memcpy(out_bytes),
        }
        fns |= {name: (lambda c=column, f=fn: f(c)) for name, fn in PEERS.items()}
        t = harness.measure(fns, bench.repeats(15, 3))
        best = min(PEERS, key=lambda name: t[name].median)
        label = f"{rows} x {lo}..{hi} tokens"
        others = ", ".join(
            f"{name} {harness.fmt_value(t[name].median)}" for name in PEERS if name != best
        )
        row = bench.row(
            f"token column → padded int64 ids + mask, {label}",
            ours=Figure(t["ours"], "`Ragged.from_arrow(col).to_padded()`"),
            baseline=Figure(t["baseline"], "lists + `pad_sequence`"),
            peer=Figure(t[best], best),
            floor=Figure(t["floor"], "memcpy of the output"),
            targets=[
                faster_than("baseline", TARGET_VS_BASELINE),
                faster_than("peer", TARGET_VS_PEER),
                within("floor", TARGET_VS_FLOOR),
            ],
            note=f"fresh outputs; other peers: {others}; output "
            f"{out_bytes / 2**20:.1f} MiB, width {ids.shape[1]}",
        )
        why = {
            "baseline": f"{rows} rows: the baseline's Python work is per row, so with few long "
            "rows most of its time is the same padded copy ours makes",
            "peer": "the peer makes the same passes (a mask, a fill, one numpy scatter)",
            "floor": "a fresh output's first-touch page faults (the kernel maps and zeroes it) "
            "cost about as much as the writes; the reused-buffer row beside shows the rest",
        }
        row.reason = "; ".join(why[target.ref] for target in row.missed())
        bench.row(
            f"same, {label}, into reused `out=` buffers",
            ours=Figure(t["reused"], "`to_padded(out=(ids, mask))`"),
            floor=Figure(t["floor"], "memcpy of the output"),
            note="context: a training loop reuses its buffers",
            detail=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(parser)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: ours and the numpy peer run on one thread, and on "
        "a shared machine torch's parallel kernels wait for a busy core)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(args.threads, 1))
    bench = harness.Bench("ragged", args)
    print(f"torch {torch.__version__}, pyarrow {pa.__version__}, {torch.get_num_threads()} threads")
    if args.quick:
        sizes = [10**3, 10**4, 10**5]
        shapes = [(256, 128, 512), (32, 750, 3000)]
    else:
        sizes = [10**3, 10**4, 10**5, 10**6, 10**7]
        shapes = [(4096, 128, 512), (256, 750, 3000)]
    column_to_torch(bench, sizes)
    padded_ids(bench, shapes)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
