"""Benchmark: Arrow columns to torch, and Arrow token columns to padded ids + mask.

(a) Column -> torch, N = 10^3 .. 10^7 float64 samples. Ours: a record's column as a tensor
    (``record.tensor(name)``: ``arrow_to_torch``, DLPack over the Arrow buffer). Baseline:
    what the seed does with its Python lists, ``torch.tensor(python_list)``. Floor: a memcpy
    of the N * 8 bytes. Ours must stay flat as N grows (it copies nothing); both are printed
    per N.

(b) Arrow ``list<int32>`` token column -> right-padded int64 ids + bool mask, for
    4096 rows x 128..512 tokens and 256 rows x 750..3000 tokens (uniform lengths).
    Ours: ``Ragged.from_arrow(column).to_padded(pad, dtype=torch.int64)``.
    Baseline (seed style, starting from the Python lists the seed holds):
    ``pad_sequence([torch.tensor(x) for x in lists], batch_first=True)`` and a mask from the
    lengths. Floor: one ``memcpy`` of the output bytes (ids + mask) into a preallocated,
    already-touched buffer.

Targets: (b) >= 30x faster than the baseline and <= 3x the floor, for both shapes.

Measured while building (b): on CPU, scattering the values through the mask with numpy index
assignment is 2-3x faster than ``Tensor.masked_scatter_`` (which makes a prefix-sum pass over
the mask first), so ``Ragged.to_padded`` scatters in numpy on CPU.

Every figure is the best of several interleaved repeats (the machine may be shared), and all
ratios come from the same run. Run ``python benchmarks/bench_ragged.py [--quick]``; the exit
status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_arrow import Ragged  # noqa: E402
from maxent_arrow.arrow import arrow_to_torch  # noqa: E402

TARGET_VS_BASELINE = 30.0
TARGET_VS_FLOOR = 3.0
FLAT_LIMIT = 3.0  # ours at the largest N within this factor of ours at the smallest
PAD = 0
VOCAB = 151_936


def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function, measured round-robin so noise hits all alike."""
    for fn in fns.values():
        fn()  # warm-up: allocator, caches, lazy imports
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def memcpy(nbytes: int) -> Callable[[], None]:
    """The floor: one memcpy of ``nbytes`` into a preallocated, already-touched buffer."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    # The closure keeps both arrays alive (it copies between their buffers by address).
    return lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds:8.2f} s "


# ---------------------------------------------------------------------------- (a)
def column_to_torch(sizes: list[int], repeats: int) -> bool:
    print("(a) column -> torch (float64 samples)")
    print(
        f"{'N':>10} {'ours':>11} {'baseline':>11} {'memcpy':>11} {'vs base':>9} {'vs memcpy':>10}"
    )
    rng = np.random.default_rng(0)
    ours_times = []
    for n in sizes:
        column = pa.array(rng.normal(size=n))
        view = functools.partial(arrow_to_torch, column)
        python_list = column.to_pylist()  # what the seed holds
        tensor = view()
        assert tensor.data_ptr() == column.buffers()[1].address, "not zero-copy"
        assert torch.equal(tensor, torch.tensor(python_list, dtype=torch.float64))
        reps = repeats if n <= 10**6 else max(2, repeats // 4)
        # Ours is timed in its own loop: right after the baseline, which walks N Python
        # floats and evicts the caches, its first touches of torch's and pyarrow's code cost
        # ~60 us whatever N is, which would hide that the call itself does no O(N) work.
        t = best_of({"ours": view}, max(repeats, 20))
        t |= best_of(
            {
                "baseline": lambda lst=python_list: torch.tensor(lst, dtype=torch.float64),
                "floor": memcpy(n * 8),
            },
            reps,
        )
        ours_times.append(t["ours"])
        print(
            f"{n:>10,} {fmt(t['ours'])} {fmt(t['baseline'])} {fmt(t['floor'])} "
            f"{t['baseline'] / t['ours']:>8.0f}x {t['floor'] / t['ours']:>9.1f}x"
        )
    growth = ours_times[-1] / ours_times[0]
    flat = growth <= FLAT_LIMIT
    print(
        f"    ours at N={sizes[-1]:,} / ours at N={sizes[0]:,}: {growth:.2f}x "
        f"(flat: <= {FLAT_LIMIT:.0f}x while N grows {sizes[-1] // sizes[0]:,}x) "
        f"{'PASS' if flat else 'MISS'}"
    )
    return flat


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


def padded_ids(shapes: list[tuple[int, int, int]], repeats: int) -> bool:
    print("\n(b) Arrow token column -> padded int64 ids + bool mask (right padding)")
    print(
        f"{'shape':>22} {'ours':>11} {'baseline':>11} {'memcpy':>11} "
        f"{'vs base':>9} {'vs memcpy':>10}  targets"
    )
    rng = np.random.default_rng(1)
    ok = True
    for rows, lo, hi in shapes:
        column = token_column(rng, rows, lo, hi)
        lists = column.to_pylist()
        ids, mask = ours(column)
        base_ids, base_mask = seed_style(lists)
        assert torch.equal(ids, base_ids) and torch.equal(mask, base_mask), "outputs differ"
        out_bytes = ids.numel() * ids.element_size() + mask.numel() * mask.element_size()
        t = best_of(
            {
                "ours": lambda c=column: ours(c),
                "baseline": lambda lst=lists: seed_style(lst),
                "floor": memcpy(out_bytes),
            },
            repeats,
        )
        vs_base = t["baseline"] / t["ours"]
        vs_floor = t["ours"] / t["floor"]
        passed = vs_base >= TARGET_VS_BASELINE and vs_floor <= TARGET_VS_FLOOR
        ok &= passed
        label = f"{rows} x {lo}..{hi}"
        print(
            f"{label:>22} {fmt(t['ours'])} {fmt(t['baseline'])} {fmt(t['floor'])} "
            f"{vs_base:>8.0f}x {vs_floor:>9.2f}x  "
            f">= {TARGET_VS_BASELINE:.0f}x base, <= {TARGET_VS_FLOOR:.0f}x memcpy: "
            f"{'PASS' if passed else 'MISS'}"
        )
        print(f"{'':>22} output {out_bytes / 2**20:.1f} MiB, width {ids.shape[1]}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 15)
    print(f"torch {torch.__version__}, pyarrow {pa.__version__}, {torch.get_num_threads()} threads")
    if args.quick:
        sizes = [10**3, 10**4, 10**5]
        shapes = [(256, 128, 512), (32, 750, 3000)]
    else:
        sizes = [10**3, 10**4, 10**5, 10**6, 10**7]
        shapes = [(4096, 128, 512), (256, 750, 3000)]
    flat = column_to_torch(sizes, repeats)
    padded = padded_ids(shapes, repeats)
    print("\nall targets met" if flat and padded else "\nsome target missed")
    return 0 if (flat and padded) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
