"""Trainer ingestion: a :class:`~maxent_arrow.ScoreBatch` from Arrow group rows in one
vectorised pass, optionally built on the GPU after one pinned copy of the ragged bytes.

Input is one row per prompt group (the v1 group table, :mod:`maxent_arrow.arrow.schema`): a
``pyarrow`` RecordBatch or Table, any object with a ``.groups`` record batch (a
``RolloutBatch``), or the seed's :class:`~maxent_arrow.GenerationBatch` (token ids in its
completion info, prompts as text). Flat order is prompt-major (sample ``i = g*K + k``).

- Prompt ids come from the stored ``prompt_ids`` column; prompts stored only as text go
  through a :class:`~maxent_arrow.ingest.prompt_cache.PromptCache` (one batched tokenizer call for
  the misses; never silently empty, semantics §6 item 3). They are repeated per sample and
  head-truncated to ``max_prompt_len`` with numpy index arithmetic (no loop over samples).
- Completion ids stay ragged (a zero-copy torch view of the Arrow child buffer) until one
  :meth:`Ragged.to_padded` builds ``completion_ids``; the attention mask is EOS-aware (a token
  counts up to and including the first EOS, semantics §1).
- With a CUDA ``device`` (or an ``accelerate.Accelerator``), the ragged bytes are copied into
  pinned memory, sent with ``non_blocking=True``, and padded on the device: padding never
  crosses PCIe.
- A :class:`ScoreBatchWorkspace` passed as ``workspace=`` keeps the output buffers from one
  call to the next (a trainer building one ``ScoreBatch`` per step): on CPU the build is then
  a few passes over memory that is already mapped, about 2x a memcpy of the output
  (``benchmarks/bench_ingest.py``); fresh pages cost about as much as the writes themselves.

On CPU every pass runs in numpy, single-threaded: torch's parallel kernels wait for a free core
on a busy machine (a 2M-value ``min`` measured 12 ms with two threads on a loaded 2-core
machine, 0.1 ms in numpy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import Ragged, list_offsets, single_array
from maxent_arrow.arrow.ragged import prefix_mask
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ingest.prompt_cache import PromptCache
from maxent_arrow.types import GenerationBatch, ScoreBatch

__all__ = [
    "build_score_batch",
    "ScoreBatchWorkspace",
    "resolve_pad_token_id",
    "resolve_device",
    "ragged_to_device",
]

_IDS = pa.list_(pa.field("item", pa.int32(), nullable=False))
_UNSET: Any = object()


def resolve_pad_token_id(
    tokenizer: Any = None, pad_token_id: int | None = None, *, vocab_size: int | None = None
) -> int:
    """The seed's pad-token rules (semantics §2.8).

    ``pad_token_id`` if given, else the tokenizer's pad, else its EOS, else 0. A pad id at or
    beyond the vocabulary (``vocab_size``, default the tokenizer's) is replaced by the EOS id,
    or ``vocab_size - 1`` without one.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = pad_token_id
    if pad is None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos if eos is not None else 0
    vocab = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
    if vocab is not None and pad >= int(vocab):
        pad = eos if eos is not None and eos < int(vocab) else int(vocab) - 1
    if int(pad) < 0:
        raise LayoutError(f"pad_token_id: expected >= 0, got {pad}")
    return int(pad)


def resolve_device(device: Any = None, accelerator: Any = None) -> torch.device:
    """The device to build on: the accelerator's when one is given, else ``device``, else CPU."""
    if accelerator is not None:
        return torch.device(accelerator.device)
    return torch.device(device) if device is not None else torch.device("cpu")


def ragged_to_device(ragged: Ragged, device: torch.device) -> Ragged:
    """Send the ragged bytes (values, offsets) to ``device``; from pinned memory on CUDA.

    Pinning is one host copy into page-locked memory; the host-to-device copies then run
    asynchronously (``non_blocking=True``) on the current stream, so later device work is
    ordered after them with no host synchronisation.
    """
    if device.type == "cpu":
        return ragged.to(device) if ragged.device != device else ragged
    if device.type == "cuda" and ragged.device.type == "cpu":
        ragged = ragged.pin_memory()
        return ragged.to(device, non_blocking=ragged.is_pinned())
    return ragged.to(device)


class ScoreBatchWorkspace:
    """Output buffers that :func:`build_score_batch` writes into, kept from one call to the next.

    A trainer that builds one ``ScoreBatch`` per step passes the same workspace every step: the
    completion ids and attention mask, the per-sample prompt ids and the scratch of the build
    are then written into memory allocated once (and grown, by a quarter at least, when a step
    needs more), not into fresh pages, which cost about as much as the writes themselves.

    Like torch's ``out=``, a ``ScoreBatch`` built with a workspace views its buffers: it is
    valid until the next call with the same workspace, which overwrites it. Build a batch you
    keep beyond the step (one you store, for instance) without a workspace. One workspace per
    device and per thread; its buffers live where each batch is built.

    Examples
    --------
    >>> workspace = ScoreBatchWorkspace()
    >>> for rows in steps:  # doctest: +SKIP
    ...     batch = build_score_batch(rows, pad_token_id=0, max_prompt_len=256,
    ...                               slice_size=16, workspace=workspace)
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        fill: int | None = None,
    ) -> torch.Tensor:
        """A contiguous ``shape`` view of the buffer ``name`` (allocated or grown on demand).

        ``fill`` initialises a buffer when it is allocated, for contents that never change
        (the all-ones prompt mask); otherwise the contents are whatever the last use left.
        """
        device = torch.device(device)
        numel = 1
        for size in shape:
            numel *= int(size)
        have = self._buffers.get(name)
        if have is None or have.dtype != dtype or have.device != device or have.numel() < numel:
            grown = 0 if have is None or have.dtype != dtype else have.numel() + have.numel() // 4
            have = torch.empty(max(numel, grown), dtype=dtype, device=device)
            if fill is not None:
                have.fill_(fill)
            self._buffers[name] = have
        return have[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer (the next build allocates them again)."""
        self._buffers.clear()

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._buffers))
        return f"ScoreBatchWorkspace({self.nbytes / 2**20:.1f} MiB: {names})"


# ---------------------------------------------------------------------------- input columns
def _group_batch(batch: Any) -> pa.RecordBatch | pa.Table:
    groups = getattr(batch, "groups", None)
    if groups is not None and not isinstance(batch, pa.Table | pa.RecordBatch):
        batch = groups
    if isinstance(batch, pa.RecordBatch | pa.Table):
        return batch
    raise SchemaError(
        "build_score_batch: expected a pyarrow RecordBatch/Table of group rows, an object with "
        f"a .groups record batch, or a GenerationBatch; got {type(batch).__name__}"
    )


def _column(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array | None:
    if name not in batch.schema.names:
        return None
    return single_array(batch.column(name))


def _first_null(array: pa.Array) -> int:
    return int(np.flatnonzero(~array.is_valid().to_numpy(zero_copy_only=False))[0])


def _completion_lists(completion_ids: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Per-sample ``list<int32>`` and the group offsets, from ``list<list<int>>``."""
    kind = completion_ids.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise SchemaError(f"completion_ids: expected list<list<int32>>, got {kind}")
    if completion_ids.null_count:
        raise LayoutError(
            f"completion_ids: expected token ids, got null at group {_first_null(completion_ids)}"
        )
    samples = completion_ids.flatten()
    if not (pa.types.is_list(samples.type) or pa.types.is_large_list(samples.type)):
        raise SchemaError(f"completion_ids: expected list<list<int32>>, got {kind}")
    if samples.null_count:
        i = _first_null(samples)
        group_offsets = list_offsets(completion_ids)
        g = int(np.searchsorted(group_offsets, i, side="right") - 1)
        raise LayoutError(
            f"completion_ids: expected token ids, got null at group {g}, sample "
            f"{i - group_offsets[g]}"
        )
    return samples, list_offsets(completion_ids)


def _from_generation(gen: GenerationBatch, tokenizer: Any):
    batch = gen.to_arrow()  # checked; the record's own batch when it came from Arrow
    completions = batch.column("completions")
    offsets = list_offsets(completions)
    n = int(offsets[-1])
    texts = completions.flatten()
    ids = None
    if "completion_info" in batch.schema.names:
        structs = batch.column("completion_info").flatten()
        ids = pc.struct_field(structs, "token_ids") if len(structs) else pa.nulls(0, _IDS)
        ids = ids.cast(_IDS)
    if ids is None:
        ids = pa.nulls(n, _IDS)
    if ids.null_count:
        missing = np.flatnonzero(~ids.is_valid().to_numpy(zero_copy_only=False))
        if tokenizer is None:
            s = int(missing[0])
            g = int(np.searchsorted(offsets, s, side="right") - 1)
            raise LayoutError(
                f"GenerationBatch.grouped_completion_info: no token_ids at group {g}, sample "
                f"{s - offsets[g]}, and no tokenizer to tokenize the completion text"
            )
        # The seed re-tokenizes from text when ids are missing; only the missing ones here.
        encoded = tokenizer(
            texts.take(pa.array(missing)).to_pylist(), add_special_tokens=False, padding=False
        )["input_ids"]
        filled = pa.array(encoded, type=_IDS)
        index = np.arange(n, dtype=np.int64)
        index[missing] = n + np.arange(len(missing))
        ids = pa.concat_arrays([ids, filled]).take(pa.array(index))
    return batch.column("prompt"), None, ids, offsets


# ---------------------------------------------------------------------------- prompts
def _prompt_ids(
    texts: pa.Array | None,
    stored: pa.Array | None,
    num_groups: int,
    tokenizer: Any,
    prompt_cache: PromptCache | None,
    max_prompt_len: int,
) -> pa.Array:
    if stored is not None and not stored.null_count:
        return stored
    missing = (
        np.arange(num_groups)
        if stored is None
        else np.flatnonzero(~stored.is_valid().to_numpy(zero_copy_only=False))
    )
    if texts is None:
        raise LayoutError(
            f"build_score_batch: group {int(missing[0])} has no prompt_ids and no prompt text"
        )
    wanted = texts.take(pa.array(missing))
    if wanted.null_count:
        g = int(missing[_first_null(wanted)])
        raise LayoutError(f"build_score_batch: group {g} has neither prompt_ids nor prompt text")
    cache = prompt_cache
    if cache is None:
        if tokenizer is None:
            raise LayoutError(
                f"build_score_batch: group {int(missing[0])} has no prompt_ids; pass "
                "tokenizer= or prompt_cache= to tokenize the prompt text (the original "
                "pipeline silently scored such prompts as empty)"
            )
        cache = PromptCache(tokenizer, max_prompt_len=max_prompt_len)
    looked = cache.lookup(wanted).cast(_IDS)
    if stored is None:
        return looked
    index = np.arange(num_groups, dtype=np.int64)
    index[missing] = num_groups + np.arange(len(missing))
    return pa.concat_arrays([stored.cast(_IDS), looked]).take(pa.array(index))


def _sample_prompts(
    prompt_ids: pa.Array,
    group_offsets: np.ndarray,
    max_prompt_len: int,
    workspace: ScoreBatchWorkspace | None,
) -> pa.RecordBatch:
    """Each group's prompt repeated for its samples, head-truncated: the ``prompt_ids`` and
    ``prompt_attention_mask`` columns of the ``ScoreBatch`` layout (its prompt entries)."""
    if prompt_ids.type.value_type != pa.int32():
        # A checked cast (an id beyond int32 raises, as before), not a silent wrap.
        list_type = pa.large_list if pa.types.is_large_list(prompt_ids.type) else pa.list_
        prompt_ids = prompt_ids.cast(list_type(pa.int32()))
    groups = Ragged.from_arrow(prompt_ids)  # nulls were filled from text before
    values, offsets = groups.values.numpy(), groups.offsets.numpy()
    raw = np.diff(offsets)
    glen = np.minimum(raw, max_prompt_len)
    sizes = np.diff(group_offsets)
    slen = np.repeat(glen, sizes)
    n = len(slen)
    soff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(slen, out=soff[1:])
    total = int(soff[-1])
    if workspace is None:
        sample_values = None
        ones = np.ones(total, dtype=np.int8)
    else:
        sample_values = workspace.buffer("prompt_ids", (total,), torch.int32).numpy()
        ones = workspace.buffer("prompt_attention_mask", (total,), torch.int8, fill=1).numpy()
    width = int(glen.max()) if len(glen) else 0
    if total and n * width <= 2 * total:
        # The groups' prompts padded to [groups, width] (head-truncated), one row per sample,
        # then each row's real tokens in order (a boolean index): ~3x faster than a gather
        # through an int64 index of every output token.
        padded = groups.to_padded(0, max_len=width)[0].numpy()
        if workspace is None:
            keep = prefix_mask(slen, width)
        else:
            keep = workspace.buffer("prompt_keep", (n, width), torch.bool).numpy()
            prefix_mask(slen, width, out=keep)
        k = int(sizes[0])
        if (sizes == k).all():
            # K samples in every group: each group's row is broadcast to them, not copied.
            per_sample = np.broadcast_to(padded[:, None, :], (len(sizes), k, width))
            keep = keep.reshape(len(sizes), k, width)
        elif workspace is None:
            per_sample = np.take(padded, np.arange(len(sizes)).repeat(sizes), axis=0)
        else:
            per_sample = workspace.buffer("prompt_rows", (n, width), torch.int32).numpy()
            # mode="clip": with out= and the default mode="raise", numpy buffers the output.
            rows = np.arange(len(sizes)).repeat(sizes)
            np.take(padded, rows, axis=0, out=per_sample, mode="clip")
        if sample_values is None:
            sample_values = per_sample[keep]
        else:
            np.copyto(sample_values, per_sample[keep])  # np.compress(out=) is ~3x slower
    else:
        # A few long prompts among short ones (or none): gather through an index instead.
        # Source of sample token t: group start + t, i.e. (group start - sample start) + t.
        shift = np.repeat(offsets[:-1], sizes) - soff[:-1]
        gather = np.repeat(shift, slen) + np.arange(total, dtype=np.int64)
        if sample_values is None:
            sample_values = np.empty(total, dtype=np.int32)
        np.take(values, gather, out=sample_values, mode="clip")
    arrow_offsets = pa.array(soff.astype(np.int32 if total < 2**31 else np.int64))
    make = pa.ListArray if total < 2**31 else pa.LargeListArray
    ids = make.from_arrays(arrow_offsets, pa.array(sample_values))
    masks = make.from_arrays(arrow_offsets, pa.array(ones))
    return pa.RecordBatch.from_arrays([ids, masks], names=["prompt_ids", "prompt_attention_mask"])


# ---------------------------------------------------------------------------- completions
def _eos_lengths(ragged: Ragged, eos_token_id: int | None) -> torch.Tensor:
    """Tokens per row up to and including the first EOS (the whole row without one)."""
    lengths = ragged.lengths()
    if eos_token_id is None or ragged.num_values == 0:
        return lengths
    # Only the EOS hits are located (a search on the offsets), not every token's row.
    if ragged.device.type == "cpu":
        offsets = ragged.offsets.numpy()
        hits = np.flatnonzero(ragged.values.numpy() == eos_token_id)
        first = lengths.numpy().copy()
        if hits.size:
            rows = np.searchsorted(offsets, hits, side="right") - 1
            # Hits are in order, so a row's first hit is where the row number changes.
            lead = np.ones(rows.size, dtype=bool)
            np.not_equal(rows[1:], rows[:-1], out=lead[1:])
            rows, hits = rows[lead], hits[lead]
            first[rows] = hits - offsets[rows] + 1
        return torch.from_numpy(first)
    hits = torch.nonzero(ragged.values == eos_token_id).flatten()
    first = lengths.clone()
    if hits.numel():
        rows = torch.searchsorted(ragged.offsets, hits, right=True) - 1
        first.scatter_reduce_(0, rows, hits - ragged.offsets[rows] + 1, reduce="amin")
    return first


def _pad_completions(
    ragged: Ragged,
    pad_token_id: int,
    width: int,
    lengths: torch.Tensor,
    workspace: ScoreBatchWorkspace | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_ids`` (int64, padded) and the EOS-aware ``completion_attention_mask`` (int64
    ``[rows, width]``, ones then zeros: 1 where the column is < the row's ``lengths``)."""
    rows, device = len(ragged), ragged.device
    if workspace is None:
        ids, real = ragged.to_padded(pad_token_id, max_len=width, dtype=torch.int64)
        mask = torch.empty((rows, width), dtype=torch.int64, device=device)
    else:
        ids = workspace.buffer("completion_ids", (rows, width), torch.int64, device)
        real = workspace.buffer("real_tokens", (rows, width), torch.bool, device)
        ragged.to_padded(pad_token_id, max_len=width, dtype=torch.int64, out=(ids, real))
        mask = workspace.buffer("completion_attention_mask", (rows, width), torch.int64, device)
    lengths = lengths.clamp(max=width)
    if device.type == "cpu":
        # `real` (every stored token) is the mask unless an EOS comes before a row's end; then
        # it is rewritten, and the bool rows are widened to int64 in one copy.
        kept = np.minimum(ragged.lengths().numpy(), width)
        if not np.array_equal(kept, lengths.numpy()):
            prefix_mask(lengths.numpy(), width, out=real.numpy())
        np.copyto(mask.numpy(), real.numpy())
    else:
        torch.lt(torch.arange(width, device=device), lengths[:, None], out=mask)
    return ids, mask


def build_score_batch(
    batch: Any,
    *,
    pad_token_id: int | None,
    max_prompt_len: int,
    slice_size: int,
    score_tail_tokens: int | None = None,
    tokenizer: Any = None,
    prompt_cache: PromptCache | None = None,
    eos_token_id: int | None = _UNSET,
    max_completion_len: int | None = None,
    device: torch.device | str | None = None,
    accelerator: Any = None,
    workspace: ScoreBatchWorkspace | None = None,
) -> ScoreBatch:
    """A ``ScoreBatch`` for the samples of ``batch``, in prompt-major flat order.

    Parameters
    ----------
    batch:
        Group rows: a RecordBatch/Table with ``completion_ids`` (list<list<int>>) and
        ``prompt_ids`` (list<int>, nulls allowed) and/or ``prompt`` text; an object with a
        ``.groups`` record batch; or a :class:`GenerationBatch` (completion ids from its
        completion info's ``token_ids``, text re-tokenized only where those are missing).
    pad_token_id:
        Pad id; ``None`` takes the tokenizer's by the seed's rules
        (:func:`resolve_pad_token_id`).
    max_prompt_len:
        Prompts keep their first ``max_prompt_len`` tokens (clamped to >= 1, as the seed).
    slice_size:
        Rows per scoring forward; ``<= 0`` means all samples (the seed's rule).
    score_tail_tokens:
        Score only the last ``score_tail_tokens`` tokens of each ``[prompt | completion]``.
    tokenizer, prompt_cache:
        Tokenize prompts that have no stored ids (through the cache, which remembers them).
    eos_token_id:
        EOS id for the EOS-aware mask (default: the tokenizer's; ``None`` disables it).
    max_completion_len:
        Keep the first ``max_completion_len`` tokens of each completion.
    device, accelerator:
        Build the tensors there (an ``accelerate.Accelerator`` decides when given); on CUDA
        the ragged ids go through pinned memory and are padded on the device.
    workspace:
        Write the outputs into these reused buffers (:class:`ScoreBatchWorkspace`): the
        result views them and is valid until the next call with the same workspace.
    """
    if eos_token_id is _UNSET:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = resolve_pad_token_id(tokenizer)
    elif tokenizer is not None:
        pad_token_id = resolve_pad_token_id(tokenizer, pad_token_id)
    max_prompt_len = max(1, int(max_prompt_len))
    if score_tail_tokens is not None and int(score_tail_tokens) <= 0:
        score_tail_tokens = None
    target = resolve_device(device, accelerator)

    if isinstance(batch, GenerationBatch):
        texts, stored, samples, group_offsets = _from_generation(batch, tokenizer)
    else:
        table = _group_batch(batch)
        completion_ids = _column(table, "completion_ids")
        if completion_ids is None:
            raise SchemaError("build_score_batch: the group rows have no 'completion_ids' column")
        samples, group_offsets = _completion_lists(completion_ids)
        stored = _column(table, "prompt_ids")
        texts = _column(table, "prompt")
    num_groups = len(group_offsets) - 1
    n = int(group_offsets[-1])
    prompt_ids = _prompt_ids(texts, stored, num_groups, tokenizer, prompt_cache, max_prompt_len)
    if len(prompt_ids) != num_groups:
        raise LayoutError(
            f"prompt_ids: expected {num_groups} rows (one per group), got {len(prompt_ids)}"
        )
    entries = _sample_prompts(prompt_ids, group_offsets, max_prompt_len, workspace)

    ragged = Ragged.from_arrow(samples)
    values = ragged.values.numpy()  # Arrow memory is on the host
    if ragged.num_values and int(values.min()) < 0:
        at = int(np.flatnonzero(values < 0)[0])
        s = int(np.searchsorted(ragged.offsets.numpy(), at, side="right")) - 1
        raise LayoutError(
            f"completion_ids: expected token ids >= 0, got a negative id in sample {s}"
        )
    longest = int(ragged.lengths().numpy().max()) if n else 0
    ragged = ragged_to_device(ragged, target)
    lengths = _eos_lengths(ragged, eos_token_id)
    width = longest if max_completion_len is None else min(longest, int(max_completion_len))
    ids, mask = _pad_completions(ragged, pad_token_id, width, lengths, workspace)
    # The prompt entries stay in Arrow (``score_batch.column("prompt_ids")``) until read.
    return ScoreBatch.from_arrow(
        entries,
        completion_ids=ids,
        completion_attention_mask=mask,
        pad_token_id=pad_token_id,
        max_prompt_len=max_prompt_len,
        slice_size=int(slice_size) if int(slice_size) > 0 else max(n, 1),
        total_sequences=n,
        score_tail_tokens=score_tail_tokens,
    )
