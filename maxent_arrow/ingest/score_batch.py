"""Trainer ingestion: a :class:`~maxent_arrow.ScoreBatch` from Arrow group rows in one
vectorised pass, optionally built on the GPU after one pinned copy of the ragged bytes.

Input is one row per prompt group (the v1 group table, :mod:`maxent_arrow.arrow.schema`): a
``pyarrow`` RecordBatch or Table, any object with a ``.groups`` record batch (a
``RolloutBatch``), or the seed's :class:`~maxent_arrow.GenerationBatch` (token ids in its
completion info, prompts as text). Flat order is prompt-major (sample ``i = g*K + k``).

- Prompt ids come from the stored ``prompt_ids`` column; prompts stored only as text go
  through a :class:`~maxent_arrow.prompt_cache.PromptCache` (one batched tokenizer call for
  the misses; never silently empty, semantics §6 item 3). They are repeated per sample and
  head-truncated to ``max_prompt_len`` with numpy index arithmetic (no loop over samples).
- Completion ids stay ragged (a zero-copy torch view of the Arrow child buffer) until one
  :meth:`Ragged.to_padded` builds ``completion_ids``; the attention mask is EOS-aware (a token
  counts up to and including the first EOS, semantics §1).
- With a CUDA ``device`` (or an ``accelerate.Accelerator``), the ragged bytes are copied into
  pinned memory, sent with ``non_blocking=True``, and padded on the device: padding never
  crosses PCIe.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import Ragged, list_offsets
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ingest.prompt_cache import PromptCache
from maxent_arrow.types.rewards import GenerationBatch, ScoreBatch

__all__ = ["build_score_batch", "resolve_pad_token_id", "resolve_device", "ragged_to_device"]

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
    column = batch.column(name)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column


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
    prompt_ids: pa.Array, group_offsets: np.ndarray, max_prompt_len: int
) -> pa.RecordBatch:
    """Each group's prompt repeated for its samples, head-truncated: the ``prompt_ids`` and
    ``prompt_attention_mask`` columns of the ``ScoreBatch`` layout (its prompt entries)."""
    values = np.asarray(prompt_ids.flatten().cast(pa.int32()).to_numpy(zero_copy_only=False))
    offsets = list_offsets(prompt_ids)
    glen = np.minimum(np.diff(offsets), max_prompt_len)
    sizes = np.diff(group_offsets)
    slen = np.repeat(glen, sizes)
    soff = np.zeros(len(slen) + 1, dtype=np.int64)
    np.cumsum(slen, out=soff[1:])
    total = int(soff[-1])
    # Source of sample token t: group start + t, i.e. (group start - sample start) + output index.
    shift = np.repeat(offsets[:-1], sizes) - soff[:-1]
    gather = np.repeat(shift, slen) + np.arange(total, dtype=np.int64)
    sample_values = values[gather]
    arrow_offsets = pa.array(soff.astype(np.int32 if total < 2**31 else np.int64))
    make = pa.ListArray if total < 2**31 else pa.LargeListArray
    ids = make.from_arrays(arrow_offsets, pa.array(sample_values, pa.int32()))
    masks = make.from_arrays(arrow_offsets, pa.array(np.ones(total, dtype=np.int8)))
    return pa.RecordBatch.from_arrays([ids, masks], names=["prompt_ids", "prompt_attention_mask"])


# ---------------------------------------------------------------------------- completions
def _eos_lengths(ragged: Ragged, eos_token_id: int | None) -> torch.Tensor:
    """Tokens per row up to and including the first EOS (the whole row without one)."""
    lengths = ragged.lengths()
    if eos_token_id is None or ragged.num_values == 0:
        return lengths
    # Only the EOS hits are located (searchsorted on the offsets), not every token's row.
    if ragged.device.type == "cpu":
        hits = torch.from_numpy(np.flatnonzero(ragged.values.numpy() == eos_token_id))
    else:
        hits = torch.nonzero(ragged.values == eos_token_id).flatten()
    first = lengths.clone()
    if hits.numel():
        rows = torch.searchsorted(ragged.offsets, hits, right=True) - 1
        first.scatter_reduce_(0, rows, hits - ragged.offsets[rows] + 1, reduce="amin")
    return first


def _prefix_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``int64 [rows, width]``, ones then zeros: 1 where the column is < the row's length."""
    rows = lengths.numel()
    if lengths.device.type == "cpu":
        # A run-length decode writes each int64 cell once (no bool temporary, no compare).
        counts = np.empty(2 * rows, dtype=np.int64)
        counts[0::2] = lengths.numpy()
        counts[1::2] = width - counts[0::2]
        pattern = np.tile(np.array([1, 0], dtype=np.int64), rows)
        return torch.from_numpy(np.repeat(pattern, counts).reshape(rows, width))
    columns = torch.arange(width, device=lengths.device)
    return (columns < lengths[:, None]).to(torch.int64)


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
    entries = _sample_prompts(prompt_ids, group_offsets, max_prompt_len)

    ragged = Ragged.from_arrow(samples)
    if ragged.num_values and int(ragged.values.min()) < 0:
        at = int(torch.nonzero(ragged.values < 0)[0, 0])
        s = int(torch.searchsorted(ragged.offsets, at, right=True)) - 1
        raise LayoutError(
            f"completion_ids: expected token ids >= 0, got a negative id in sample {s}"
        )
    ragged = ragged_to_device(ragged, target)
    lengths = _eos_lengths(ragged, eos_token_id)
    longest = int(ragged.lengths().max()) if n else 0
    width = longest if max_completion_len is None else min(longest, int(max_completion_len))
    ids, _ = ragged.to_padded(pad_token_id, max_len=width, dtype=torch.int64)
    mask = _prefix_mask(lengths.clamp(max=width), width)
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
