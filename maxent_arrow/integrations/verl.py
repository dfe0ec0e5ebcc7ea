"""verl's ``DataProto`` to and from the store's group rows (``pip install
'maxent-arrow[verl]'``; written against verl 0.9).

:func:`from_dataproto` turns a rollout batch, as verl's trainer holds it after generation,
rewards and advantages, into a :class:`~maxent_arrow.rollout.RolloutBatch` that a
:class:`~maxent_arrow.store.RolloutStore` appends; :func:`to_dataproto` gives the
``DataProto`` back: the same keys, shapes, dtypes and row order, every value equal at the
positions its mask covers and the recorded pad value elsewhere, the non-tensor values equal
after JSON, and ``meta_info`` (JSON). Nothing is pickled: a non-tensor value that JSON cannot
hold (an image, a tensor, an object) is refused with a
:class:`~maxent_arrow.errors.SchemaError` naming its key and row.

The layout (verl's conventions: ``prompts`` left-padded to ``P``, ``responses``
right-padded to ``R``, ``attention_mask`` over ``[prompt | response]``):

- one row per prompt group, from the ``uid`` non-tensor key (``group_id``), in the order of
  each uid's first row; the groups need not be contiguous (``balance_batch`` reorders rows).
  ``verl_row`` (per completion) is each row's place in the ``DataProto``;
  ``completion_index`` its place in its group;
- ``prompt_ids`` (the group's prompt, un-padded; ``sample_prompt_ids`` per completion when
  the rows of a group have different prompts) and ``completion_ids`` (un-padded);
- every ``[B, R]`` tensor as a per-token column over the response's tokens
  (``attention_mask[:, P:]``): ``ref_log_prob`` -> ``ref_token_logp``, ``old_log_probs`` ->
  ``behavior_token_logp``, ``rollout_log_probs`` -> ``sampling_token_logp``, ``advantages`` ->
  ``token_advantages``, ``returns`` -> ``token_returns``, ``values`` -> ``token_values``; others
  (``response_mask``, ``token_level_scores``, ``token_level_rewards``, ``rm_scores``, ...)
  under their own names. Every ``[B, P + R]`` tensor (a 2-D or the ``[B, C, P + R]`` rope form
  of ``position_ids``) as a per-token column over the sequence's tokens; ``input_ids``,
  ``attention_mask`` and 2-D ``position_ids`` are not stored when they are what verl derives
  from the prompts and responses (``cat``, the padding, ``clip(cumsum(mask) - 1, 0)``), and
  are rebuilt; a tensor of any other shape whole per completion (``dummy_tensor``);
- a padded position comes back as one recorded value per tensor: the padding's own when it
  holds one (verl pads with the pad token and 0), else 0 (verl's log-probs of padded
  positions are whatever the forward gave there, and no loss reads them; the layout's
  ``pad_kept`` is false then); padded positions holding another value, at most as many as
  rows, are kept exactly (the entry's ``off_mask``): a reward manager writes an empty
  response's score at its index -1, the last padded position; masks (a name ending in
  ``mask``) are stored as int8 and token ids as int32 when their values fit; a dtype Arrow
  has no type for (bfloat16, float16) is stored as float32 and restored;
- ``total_utils``: the sequence reward verl's GRPO uses (``token_level_rewards`` summed, or
  ``token_level_scores``, or ``rm_scores``); ``advantages``: verl's advantage per completion
  when it is constant over each response's ``response_mask`` (outcome estimators such as
  GRPO);
- non-tensor keys per completion: numeric, bool and text arrays as typed columns, anything
  else as JSON text; ``raw_prompt`` chat messages as typed ``prompt_messages`` when a group's
  rows share them;
- the layout (keys, dtypes, shapes, pad values, column names) and ``meta_info`` in the step
  row's :class:`~maxent_arrow.rollout.RunConfig`, ``extra["verl_dataproto"]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from maxent_arrow.arrow import GroupIdentity, Ragged, list_offsets, regroup, single_array
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow.registry import CORE, VERL
from maxent_arrow.errors import LayoutError, MissingExtraError, SchemaError
from maxent_arrow.integrations.adapters import (
    completion_info,
    offpolicy_columns,
    token_lists,
    truncation_flags,
)
from maxent_arrow.integrations.context import example_id_array
from maxent_arrow.integrations.messages import (
    conversation_list,
    is_conversation,
    json_text,
    messages_array,
)
from maxent_arrow.integrations.steps import step_row
from maxent_arrow.rollout import RolloutBatch, RunConfig, declare_families

__all__ = ["LAYOUT_KEY", "from_dataproto", "to_dataproto", "verl_sampling"]

# Where the layout lives in the step row's RunConfig.extra. Version 2 adds a tensor entry's
# `off_mask` (the padded positions that hold something else); version 1 layouts read as before.
LAYOUT_KEY = "verl_dataproto"
LAYOUT_VERSION = 2

# DataProto keys with a home in the group schema (or a name that would collide with one).
_RENAMES = {
    "prompts": "prompt_ids",
    "responses": "completion_ids",
    "ref_log_prob": "ref_token_logp",
    "old_log_probs": "behavior_token_logp",
    "rollout_log_probs": "sampling_token_logp",
    "advantages": "token_advantages",
    "returns": "token_returns",
    "values": "token_values",
    "uid": "group_id",
}
_SCHEMA_NAMES = set(R.names(R.GROUP))
_RESERVED = _SCHEMA_NAMES | set(_RENAMES.values())
# Registered per-token float columns: a tensor is stored there only when it already has the
# column's float type (a cast would lose precision; it goes to `verl_{key}` instead).
_FLOAT_TOKEN_TYPES = {
    c.name: c.type.value_type.value_type
    for c in R.columns(R.GROUP, level="token", where=lambda c: c.byte_stream_split)
}
_REWARD_KEYS = ("token_level_rewards", "token_level_scores", "rm_scores")
# Arrow types of torch dtypes; the narrower float types are stored as float32.
_ARROW_TYPES = {
    torch.bool: pa.bool_(),
    torch.uint8: pa.uint8(),
    torch.int8: pa.int8(),
    torch.int16: pa.int16(),
    torch.int32: pa.int32(),
    torch.int64: pa.int64(),
    torch.float16: pa.float32(),
    torch.bfloat16: pa.float32(),
    torch.float32: pa.float32(),
    torch.float64: pa.float64(),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- from_dataproto
def from_dataproto(
    data: Any,
    *,
    step: int,
    rank: int = 0,
    kind: str = "train",
    config: RunConfig | Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    policy_version: int | None = None,
    example_id: str | None = "index",
    sampling: Mapping[str, Any] | None = None,
) -> RolloutBatch:
    """A verl ``DataProto`` rollout batch as one step of one rank (see the module doc).

    Parameters
    ----------
    data:
        The ``DataProto``: tensors ``prompts`` ``[B, P]`` (left-padded), ``responses``
        ``[B, R]`` (right-padded) and ``attention_mask`` ``[B, P + R]`` are required, and the
        non-tensor ``uid`` (one per prompt group).
    step, rank, kind:
        Where the batch belongs in the store.
    config:
        The run's settings (:class:`~maxent_arrow.rollout.RunConfig` or a dict); the layout is
        added to its ``extra``. Default: ``RunConfig(trainer="verl")``.
    tokenizer:
        When given, the completions' text (``completions``) is decoded with it
        (``skip_special_tokens=True``); otherwise ``completions`` holds empty strings.
    policy_version:
        The optimizer updates the generating policy had (verl's ``global_steps - 1``).
    sampling:
        The rollout's sampling parameters and log-prob semantics, one for every completion
        (:func:`verl_sampling` of verl's config): ``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``logp_semantics``. With ``policy_version``, each completion's
        ``completion_policy_version`` (``docs/arrow-layout.md``, "Off-policy data").
    example_id:
        The non-tensor key whose value (of a group's first row) is the group's
        ``example_id``: verl's ``index`` (its dataset's ``extra_info.index``) by default;
        ``None``, or a batch without the key, stores none. The key is stored as well.

    Raises
    ------
    SchemaError
        A required key is missing, a non-tensor value is not JSON-able (naming the key and
        row), or a tensor's dtype or nesting has no Arrow form.
    LayoutError
        Shapes that do not match, or an ``attention_mask`` that is not a left-padded prompt
        followed by a right-padded response (naming the row).
    """
    tensors, non_tensors, meta_info = _parts(data)
    prompts, responses = tensors["prompts"], tensors["responses"]
    b, p_len, r_len = prompts.shape[0], prompts.shape[1], responses.shape[1]
    attention = tensors.get("attention_mask")
    if attention is None:
        raise SchemaError("from_dataproto: the batch has no 'attention_mask' tensor")
    if tuple(attention.shape) != (b, p_len + r_len) or responses.shape[0] != b:
        raise LayoutError(
            f"from_dataproto: attention_mask: expected shape {(b, p_len + r_len)} (prompts "
            f"{tuple(prompts.shape)} and responses {tuple(responses.shape)}), got "
            f"{tuple(attention.shape)}"
        )
    lp, lr = _lengths(attention, p_len, r_len)
    groups = _Groups(non_tensors, b)
    masks = _Masks(lp, lr, p_len, r_len)

    columns: dict[str, pa.Array] = {}
    layout: dict[str, Any] = {
        "version": LAYOUT_VERSION,
        "batch_size": b,
        "prompt_length": p_len,
        "response_length": r_len,
        "tensors": [],
        "non_tensors": [],
        "meta_info": json.loads(json_text(meta_info, where="from_dataproto: meta_info")),
    }
    used: set[str] = set()
    for key, tensor in tensors.items():
        entry = _tensor_entry(key, tensor, tensors, masks, groups, columns, used)
        layout["tensors"].append(entry)
    for key, values in non_tensors.items():
        if key == "uid":
            entry = {"key": key, "column": "group_id", "encoding": "uid", "dtype": values.dtype.str}
            layout["non_tensors"].append(entry)
            continue
        entry = _non_tensor_entry(key, values, groups, columns, used)
        layout["non_tensors"].append(entry)

    table = _group_table(groups, columns, step=step, rank=rank, kind=kind)
    if example_id is not None and example_id in non_tensors:
        values = non_tensors[example_id]
        ids = example_id_array(
            [values[i] for i in groups.firsts], where=f"from_dataproto: {example_id!r}"
        )
        table = table.append_column("example_id", ids)
    table = _add_summaries(table, tensors, masks, groups, tokenizer, responses)
    table = table.append_column(
        "completion_info", _completion_info(responses, lr, r_len, groups, tokenizer)
    )
    contract = {**(sampling or {}), "policy_version": policy_version}
    for name, array in offpolicy_columns(contract, b, groups.grouped).items():
        table = table.append_column(name, array)
    run_config = _with_layout(config, layout, r_len)
    row = step_row(
        table,
        step=step,
        rank=rank,
        kind=kind,
        config=run_config,
        max_completion_len=r_len,
        policy_version=policy_version,
    )
    return RolloutBatch(declare_families(table, (CORE, VERL)), row)


def verl_sampling(config: Any) -> dict[str, Any]:
    """What verl's trainer config says of the rollout's sampling (``actor_rollout_ref.rollout``:
    ``temperature``, ``top_p``, ``top_k`` (-1, verl's "off", stored as 0), and the log-prob
    semantics of ``rollout_log_probs`` from ``logprobs_mode``: ``processed_logprobs`` (verl's
    default) is ``processed``, ``raw_logprobs`` is ``raw``; logits modes are neither (left
    out)). verl's rollout has no min-p setting (stored as 0.0: off). ``config``: an
    OmegaConf ``DictConfig`` or nested dicts."""

    def get(key: str, default: Any) -> Any:
        node = config
        for part in ("actor_rollout_ref", "rollout", key):
            try:
                node = node[part]
            except (KeyError, TypeError, AttributeError):
                return default
        return default if node is None else node

    mode = str(get("logprobs_mode", "processed_logprobs"))
    top_k = int(get("top_k", -1))
    return {
        "temperature": float(get("temperature", 1.0)),
        "top_p": float(get("top_p", 1.0)),
        "top_k": max(top_k, 0),
        "min_p": 0.0,
        "logp_semantics": {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(mode),
    }


def _parts(data: Any) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict]:
    batch = getattr(data, "batch", None)
    non_tensors = getattr(data, "non_tensor_batch", None)
    if batch is None or non_tensors is None:
        raise SchemaError(
            f"from_dataproto: expected a verl DataProto with tensors, got {type(data).__name__}"
        )
    tensors = {}
    for key in batch.keys():
        value = batch[key]
        if not isinstance(value, torch.Tensor):
            raise SchemaError(
                f"from_dataproto: batch[{key!r}]: expected a tensor, got {type(value).__name__}"
            )
        tensors[key] = value.detach().cpu()
    for key in ("prompts", "responses"):
        if key not in tensors:
            raise SchemaError(f"from_dataproto: the batch has no {key!r} tensor")
    if "uid" not in non_tensors:
        raise SchemaError("from_dataproto: the non-tensor batch has no 'uid' (the groups)")
    return tensors, dict(non_tensors), dict(getattr(data, "meta_info", None) or {})


def _lengths(attention: torch.Tensor, p_len: int, r_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response lengths; the mask must be 0/1, left-padded then right-padded."""
    lp, lr = attention[:, :p_len].ne(0).sum(dim=1), attention[:, p_len:].ne(0).sum(dim=1)
    expected = torch.cat(
        [
            torch.arange(p_len)[None, :] >= (p_len - lp)[:, None],
            torch.arange(r_len)[None, :] < lr[:, None],
        ],
        dim=1,
    )
    bad = attention.ne(expected).any(dim=1)  # also a value other than 0 and 1
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise LayoutError(
            f"from_dataproto: attention_mask row {row}: expected a left-padded prompt followed "
            "by a right-padded response (0/1 values)"
        )
    return lp, lr


class _Groups:
    """The uid groups: rows sorted by group (first-appearance order), stable within."""

    def __init__(self, non_tensors: Mapping[str, np.ndarray], b: int):
        uid = non_tensors["uid"]
        if len(uid) != b:
            raise LayoutError(f"from_dataproto: uid: expected {b} values, got {len(uid)}")
        try:
            ids = pa.array(np.asarray(uid, dtype=object), pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            raise SchemaError("from_dataproto: non_tensor_batch['uid']: expected strings") from None
        if ids.null_count:
            raise SchemaError("from_dataproto: non_tensor_batch['uid']: a uid is None")
        encoded = ids.dictionary_encode()  # dictionary in order of first appearance
        codes = np.asarray(encoded.indices.to_numpy(), dtype=np.int64)
        self.names = encoded.dictionary
        self.order = np.argsort(codes, kind="stable")
        self.sizes = np.bincount(codes, minlength=len(self.names))
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.firsts = self.order[self.offsets[:-1]]  # each group's first row
        self.count = len(self.names)
        self.torch_order = torch.from_numpy(self.order)
        # The rows to un-pad in stored order: None when the groups are contiguous already.
        self.stored = None if bool((self.order == np.arange(b)).all()) else self.order

    def grouped(self, per_completion: pa.Array) -> pa.Array:
        return regroup(per_completion, self.offsets)


class _Masks:
    """Each level's mask (in the DataProto's row order) and, computed once per level, its
    first padded position (row-major)."""

    def __init__(
        self,
        lp: torch.Tensor,
        lr: torch.Tensor,
        p_len: int,
        r_len: int,
    ):
        self.lp, self.lr, self.p_len, self.r_len = lp, lr, p_len, r_len
        self.prompt = torch.arange(p_len)[None, :] >= (p_len - lp)[:, None]
        self.response = torch.arange(r_len)[None, :] < lr[:, None]
        self.sequence = torch.cat([self.prompt, self.response], dim=1)
        self._first: dict[str, tuple[int, int] | None] = {}

    def of(self, level: str) -> torch.Tensor:
        return {"prompt": self.prompt, "response": self.response, "sequence": self.sequence}[level]

    def lengths(self, level: str) -> torch.Tensor:
        return {"prompt": self.lp, "response": self.lr, "sequence": self.lp + self.lr}[level]

    def first_padded(self, level: str) -> tuple[int, int] | None:
        """``(row, column)`` of the first padded position (row-major), or None."""
        if level not in self._first:
            padded = ~self.of(level)
            found = None
            if bool(padded.any()):
                found = divmod(int(padded.reshape(-1).to(torch.uint8).argmax()), padded.shape[1])
            self._first[level] = found
        return self._first[level]


def _column_name(key: str, used: set[str]) -> str:
    name = _RENAMES.get(key) or (key if key not in _RESERVED else f"verl_{key}")
    if name in used:
        name = f"verl_{key}"
    if name in used:
        raise SchemaError(f"from_dataproto: key {key!r}: no free column name (tried {name!r})")
    used.add(name)
    return name


def _level(key: str, tensor: torch.Tensor, p_len: int, r_len: int) -> str:
    """Which positions a tensor's last dimension covers."""
    if key == "prompts":
        return "prompt"
    if key == "responses":
        return "response"
    if tensor.dim() == 2 and tensor.shape[1] == r_len:
        return "response"
    if tensor.dim() in (2, 3) and tensor.shape[-1] == p_len + r_len:
        return "sequence"
    if tensor.dim() == 2 and tensor.shape[1] == p_len:
        return "prompt"
    return "sample"


def _storage_type(key: str, dtype: torch.dtype, values: torch.Tensor) -> pa.DataType:
    """The Arrow type a tensor's ``values`` (what is stored of it) are stored as: narrowed
    for masks and token ids when the values fit."""
    kind = _ARROW_TYPES.get(dtype)
    if kind is None:
        raise SchemaError(f"from_dataproto: batch[{key!r}]: dtype {dtype} has no Arrow type")
    if dtype == torch.int64 and values.numel():
        low, high = (int(v) for v in torch.aminmax(values))
        if key.endswith("mask") and -128 <= low and high <= 127:
            return pa.int8()
        if key in ("prompts", "responses", "input_ids", "position_ids") and (
            -(2**31) <= low and high < 2**31
        ):
            return pa.int32()
    return kind


def _numpy(tensor: torch.Tensor, kind: pa.DataType) -> np.ndarray:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()
    return tensor.contiguous().numpy().astype(kind.to_pandas_dtype(), copy=False)


def _derived(key: str, tensor: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether verl's own rule rebuilds this tensor exactly from prompts and responses."""
    if key == "attention_mask":
        return True  # checked by _lengths: the left/right padding of the two lengths
    if key == "input_ids":
        rebuilt = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
        return rebuilt.shape == tensor.shape and torch.equal(rebuilt.to(tensor.dtype), tensor)
    if key == "position_ids" and tensor.dim() == 2:
        mask = tensors["attention_mask"]
        rebuilt = torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)
        return rebuilt.shape == tensor.shape and torch.equal(rebuilt.to(tensor.dtype), tensor)
    return False


def _tensor_entry(
    key: str,
    tensor: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    masks: _Masks,
    groups: _Groups,
    columns: dict[str, pa.Array],
    used: set[str],
) -> dict[str, Any]:
    """Store one tensor (its column into ``columns``); returns its layout entry."""
    b = groups.order.shape[0]
    if tensor.shape[0] != b:
        raise LayoutError(
            f"from_dataproto: batch[{key!r}]: expected {b} rows, got {tensor.shape[0]}"
        )
    entry: dict[str, Any] = {
        "key": key,
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape[1:]),
    }
    if key in ("attention_mask", "input_ids", "position_ids") and _derived(key, tensor, tensors):
        entry["level"] = "derived"
        return entry
    level = _level(key, tensor, masks.p_len, masks.r_len)
    if level == "sample":
        kind = _storage_type(key, tensor.dtype, tensor)
        name = _free_name(key, kind, level, used)
        entry.update(level=level, column=name)
        width = int(np.prod(tensor.shape[1:], dtype=np.int64))
        ordered = tensor.index_select(0, groups.torch_order)
        flat = pa.array(_numpy(ordered.reshape(b, width), kind).reshape(-1))
        values = pa.FixedSizeListArray.from_arrays(flat, width) if tensor.dim() > 1 else flat
        columns[name] = groups.grouped(values)
        return entry
    # [B, C, L] (the rope form of position_ids): C values per token, [B, L, C] to un-pad.
    padded = tensor if tensor.dim() == 2 else tensor.transpose(1, 2)
    stored = Ragged.from_padded(padded, masks.of(level), rows=groups.stored)
    tokens, offsets = stored.values, stored.offsets.numpy()
    first_pad = masks.first_padded(level)
    # What a padded position holds is restored as one recorded value: the padding's own when
    # it has one, else 0 (verl's log-probs of padded positions are whatever the forward gave
    # there; no loss reads them). `pad_kept` says which.
    pad, constant, off_mask = 0, True, None
    if first_pad is not None:
        first = padded[first_pad].reshape(-1)[0]  # its first channel, for [B, L, C]
        on = masks.of(level) if tensor.dim() == 2 else masks.of(level)[:, None, :]
        differs = ~(tensor.eq(first) | on)
        if bool(differs.any()):
            off_mask = _off_mask(tensor, differs) if key not in ("prompts", "responses") else None
            constant = off_mask is not None
        pad = first.item() if constant else 0
    if not constant and key in ("prompts", "responses"):
        raise LayoutError(
            f"from_dataproto: batch[{key!r}]: its padding holds more than one value (not "
            "verl's padding with the pad token)"
        )
    kind = _storage_type(key, tensor.dtype, tokens)
    name = _free_name(key, kind, level, used)
    entry.update(level=level, pad=pad, pad_kept=constant, column=name)
    if off_mask:
        entry["off_mask"] = off_mask
    if tensor.dim() == 2:
        per_token = pa.array(_numpy(tokens, kind))
        item: pa.DataType = kind
    else:
        per_token = pa.FixedSizeListArray.from_arrays(
            pa.array(_numpy(tokens, kind).reshape(-1)), tensor.shape[1]
        )
        item = per_token.type
    columns[name] = token_lists(per_token, offsets, groups.offsets, item=item)
    return entry


def _off_mask(tensor: torch.Tensor, differs: torch.Tensor) -> list[list[Any]] | None:
    """The padded positions of a 2-D tensor that hold something other than its padding
    (``differs``, some), as ``[row, position, value]`` (the DataProto's row), when there are
    at most as many as rows and all finite: verl's reward managers write a sequence's score at
    ``valid_response_length - 1``, which for an empty response is the last, padded, position.
    ``None``: too many to keep (a log-prob's padding holds whatever the forward gave there)."""
    if tensor.dim() != 2 or tensor.dtype == torch.bool:
        return None
    where = differs.nonzero()
    if len(where) > tensor.shape[0]:
        return None
    values = tensor[where[:, 0], where[:, 1]]
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        return None
    return [[int(r), int(c), v] for (r, c), v in zip(where.tolist(), values.tolist(), strict=True)]


def _free_name(key: str, kind: pa.DataType, level: str, used: set[str]) -> str:
    """The column of a tensor: its schema home only when its type is the schema's."""
    name = _column_name(key, used)
    if _FLOAT_TOKEN_TYPES.get(name, kind) != kind or (level == "sample" and name in _SCHEMA_NAMES):
        used.discard(name)
        name = _column_name(f"verl_{key}", used)
    return name


def _non_tensor_entry(
    key: str,
    values: np.ndarray,
    groups: _Groups,
    columns: dict[str, pa.Array],
    used: set[str],
) -> dict[str, Any]:
    """Store one non-tensor key (typed, text, typed chat messages or JSON); returns its
    layout entry."""
    where = f"from_dataproto: non_tensor_batch[{key!r}]"
    if not isinstance(values, np.ndarray) or values.shape[:1] != groups.order.shape:
        raise LayoutError(f"{where}: expected a numpy array of {len(groups.order)} values")
    entry: dict[str, Any] = {"key": key, "dtype": values.dtype.str}
    ordered = values[groups.order]
    if values.ndim == 1 and values.dtype.kind in "biuf":
        entry["encoding"] = "typed"
        array: pa.Array = pa.array(ordered)
    elif values.ndim == 1 and values.dtype.kind in "US":
        entry["encoding"] = "typed"
        array = pa.array(ordered.astype(str), pa.string())
    elif values.ndim == 1 and all(isinstance(v, str) for v in values):
        entry["encoding"] = "text"
        array = pa.array(ordered, pa.string())
    elif key == "raw_prompt" and _shared_chat(values, groups):
        entry["encoding"] = "prompt_messages"
        entry["column"] = "prompt_messages"
        columns["prompt_messages"] = messages_array([values[i] for i in groups.firsts], where=where)
        used.add("prompt_messages")
        return entry
    else:
        entry["encoding"] = "json"
        array = pa.array(_json_rows(values, where), pa.string()).take(pa.array(groups.order))
    name = _column_name(key, used)
    entry["column"] = name
    columns[name] = groups.grouped(array)
    return entry


def _json_rows(values: np.ndarray, where: str) -> list[str]:
    """JSON text of each value, in the ``DataProto``'s row order (a refusal names the row)."""
    out = []
    for i, value in enumerate(values):
        try:
            out.append(json_text(value, where=where))
        except SchemaError as exc:
            raise SchemaError(str(exc).replace(where, f"{where} row {i}", 1)) from None
    return out


def _shared_chat(values: np.ndarray, groups: _Groups) -> bool:
    """Every value a chat whose messages have text ``role`` and ``content``, the same within
    each group (so one typed copy per group gives every row back)."""
    if values.ndim != 1 or not all(
        is_conversation(v)
        and all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
        for v in values
    ):
        return False
    texts = pa.array(_json_rows(values, "raw_prompt"), pa.string())
    codes = np.repeat(np.arange(groups.count), groups.sizes)
    first = np.empty(len(values), dtype=np.int64)
    first[groups.order] = groups.firsts[codes]
    return bool(pc.all(pc.equal(texts, texts.take(pa.array(first)))).as_py())


def _group_table(
    groups: _Groups, columns: dict[str, pa.Array], *, step: int, rank: int, kind: str
) -> pa.Table:
    """The group rows: identity, per-completion index and DataProto row, the prompts, and the
    columns of the keys."""
    base = GroupIdentity.of(
        step=step, rank=rank, kind=kind, group_offsets=groups.offsets, group_ids=groups.names
    ).columns()
    base["verl_row"] = groups.grouped(pa.array(groups.order.astype(np.int32)))
    prompt_ids = columns.pop("prompt_ids")
    base["prompt_ids"], sample_prompts = _group_prompts(prompt_ids, groups)
    if sample_prompts is not None:
        base["sample_prompt_ids"] = sample_prompts
    return pa.table({**base, **columns})


def _group_prompts(per_sample: pa.Array, groups: _Groups) -> tuple[pa.Array, pa.Array | None]:
    """The group's prompt (its first row's); the per-completion prompts too when a group's
    rows differ."""
    rows = single_array(per_sample).flatten()  # one prompt per completion, stored order
    first = rows.take(pa.array(groups.offsets[:-1]))
    codes = np.repeat(np.arange(groups.count), groups.sizes)
    same = pc.all(pc.equal(_as_text(rows), _as_text(first.take(pa.array(codes))))).as_py()
    return first, (None if same else per_sample)


def _as_text(lists: pa.Array) -> pa.Array:
    """List values as comparable strings (pyarrow compares lists element-wise only)."""
    return pc.binary_join(pc.cast(lists, pa.list_(pa.string())), ",")


def _add_summaries(
    table: pa.Table,
    tensors: Mapping[str, torch.Tensor],
    masks: _Masks,
    groups: _Groups,
    tokenizer: Any,
    responses: torch.Tensor,
) -> pa.Table:
    """``completions``, ``total_utils`` and the per-completion ``advantages``."""
    b = len(groups.order)
    order = groups.torch_order
    if tokenizer is not None:
        tokens = Ragged.from_padded(responses, masks.response, rows=groups.stored)
        texts = tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
    else:
        texts = [""] * b
    table = table.append_column("completions", groups.grouped(pa.array(texts, pa.string())))
    reward_key = next((k for k in _REWARD_KEYS if k in tensors), None)
    if reward_key is not None:
        total = tensors[reward_key].double().sum(dim=-1).index_select(0, order)
        table = table.append_column("total_utils", groups.grouped(pa.array(total.numpy())))
    adv, rmask = tensors.get("advantages"), tensors.get("response_mask")
    if adv is not None and adv.dim() == 2 and rmask is not None and rmask.shape == adv.shape:
        on = rmask != 0
        high = torch.where(on, adv, -torch.inf).amax(dim=1)
        low = torch.where(on, adv, torch.inf).amin(dim=1)
        if bool(((high == low) | ~on.any(dim=1)).all()):
            value = torch.where(on.any(dim=1), high, 0.0).double().index_select(0, order)
            table = table.append_column("advantages", groups.grouped(pa.array(value.numpy())))
    return table


def _completion_info(
    responses: torch.Tensor, lengths: torch.Tensor, width: int, groups: _Groups, tokenizer: Any
) -> pa.Array:
    """Per completion, in stored order, the ``completion_info`` a TRL run has: its token count
    and whether it was truncated (TRL's rule, :func:`.adapters.truncation_flags`, when the
    tokenizer names an end-of-sequence token; else: it fills the response width, verl's
    ``max_response_length``)."""
    order = groups.torch_order
    n = lengths.index_select(0, order)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
        cut = truncation_flags(
            responses.index_select(0, order), n, eos_token_ids=[int(eos)], pad_token_id=pad
        )
    else:
        cut = (n == width).numpy()
    return groups.grouped(completion_info(n.numpy(), cut))


def _with_layout(config: Any, layout: dict[str, Any], width: int) -> RunConfig:
    """The run config with the layout in its ``extra``; the response width is the length cap
    when the caller's config does not give one."""
    if config is None:
        config = RunConfig(trainer="verl", max_completion_len=width)
    elif not isinstance(config, RunConfig):
        config = dict(config)
        config.setdefault("max_completion_len", width)
        config = RunConfig.from_dict(config)
    return config.replace(extra={**dict(config.extra), LAYOUT_KEY: layout})


# ---------------------------------------------------------------------------- to_dataproto
def to_dataproto(batch: RolloutBatch) -> Any:
    """The ``DataProto`` that :func:`from_dataproto` stored as ``batch`` (see the module doc).

    Raises
    ------
    SchemaError
        ``batch`` was not written by :func:`from_dataproto` (no layout in its config), or a
        column the layout names is missing.
    """
    try:
        from verl import DataProto
    except ImportError:
        raise MissingExtraError("verl", "verl") from None
    layout = batch.run_config.extra.get(LAYOUT_KEY)
    if not isinstance(layout, Mapping):
        raise SchemaError(
            f"to_dataproto: step {batch.step} has no {LAYOUT_KEY!r} layout in its config; was it "
            "written by from_dataproto?"
        )
    if int(layout.get("version", 1)) > LAYOUT_VERSION:
        raise SchemaError(
            f"to_dataproto: step {batch.step}'s layout is version {layout['version']}; this "
            f"maxent-arrow reads versions up to {LAYOUT_VERSION} (upgrade maxent-arrow)"
        )
    view = _StoredRows(batch, layout)
    tensors = {entry["key"]: view.tensor(entry) for entry in layout["tensors"]}
    for entry in layout["tensors"]:  # after the others: they rebuild from prompts/responses
        if entry["level"] == "derived":
            tensors[entry["key"]] = view.derived(entry, tensors)
    non_tensors = {entry["key"]: view.non_tensor(entry) for entry in layout["non_tensors"]}
    meta_info = json.loads(json.dumps(layout["meta_info"]))
    # Every None (a derived entry) was filled in above.
    filled = cast(dict[str, torch.Tensor], tensors)
    return DataProto.from_dict(tensors=filled, non_tensors=non_tensors, meta_info=meta_info)


class _StoredRows:
    """The stored columns of a batch, put back in the ``DataProto``'s row order."""

    def __init__(self, batch: RolloutBatch, layout: Mapping[str, Any]):
        self.batch = batch
        self.b = int(layout["batch_size"])
        self.p_len, self.r_len = int(layout["prompt_length"]), int(layout["response_length"])
        rows = self._flat("verl_row")
        if len(rows) != self.b:
            raise LayoutError(
                f"to_dataproto: expected {self.b} completions (the DataProto's rows), got "
                f"{len(rows)}"
            )
        self.rows = torch.from_numpy(np.asarray(rows.to_numpy(), dtype=np.int64))
        sizes = np.diff(batch.group_offsets)
        self.group_of = np.repeat(np.arange(len(sizes)), sizes)
        lr = self._lengths_of(self._column("completion_ids").flatten())
        if self.batch.column("sample_prompt_ids") is not None:
            lp = self._lengths_of(self._column("sample_prompt_ids").flatten())
        else:
            lp = self._lengths_of(self._column("prompt_ids"))[self.group_of]
        self.lp, self.lr = torch.from_numpy(lp), torch.from_numpy(lr)
        self.masks = _Masks(self.lp, self.lr, self.p_len, self.r_len)

    def _column(self, name: str) -> pa.Array:
        column = self.batch.column(name)
        if column is None:
            raise SchemaError(f"to_dataproto: the layout names column {name!r}, which is missing")
        return column

    def _flat(self, name: str) -> pa.Array:
        return self._column(name).flatten()

    @staticmethod
    def _lengths_of(lists: pa.Array) -> np.ndarray:
        return np.diff(list_offsets(lists)).astype(np.int64)

    def _in_place(self, stored: torch.Tensor) -> torch.Tensor:
        """Rows in stored order to the DataProto's order."""
        out = torch.empty_like(stored)
        out[self.rows] = stored
        return out

    def tensor(self, entry: Mapping[str, Any]) -> torch.Tensor | None:
        level = entry["level"]
        if level == "derived":
            return None
        dtype = getattr(torch, entry["dtype"])
        shape = [self.b, *entry["shape"]]
        key, name = entry["key"], entry["column"]
        if key == "prompts" and self.batch.column("sample_prompt_ids") is None:
            values = self._prompt_values()
        elif key == "prompts":
            values = self._flat("sample_prompt_ids").flatten()
        else:
            values = self._flat(name)
        if level == "sample":
            flat = values.flatten() if pa.types.is_fixed_size_list(values.type) else values
            array = torch.from_numpy(np.asarray(flat.to_numpy(zero_copy_only=False)).copy())
            return self._in_place(array.to(dtype).reshape(shape))
        if key not in ("prompts",):
            values = values.flatten()  # per completion -> per token
        if pa.types.is_fixed_size_list(values.type):
            values = values.flatten()
        tokens = torch.from_numpy(np.asarray(values.to_numpy(zero_copy_only=False)).copy())
        mask = self.masks.of(level)
        if len(shape) == 2:
            out = torch.full(shape, entry["pad"], dtype=dtype)
            out[mask] = tokens.to(dtype)
            out = self._in_place(out)
            if entry.get("off_mask"):
                rows, positions, values = zip(*entry["off_mask"], strict=True)
                out[list(rows), list(positions)] = torch.tensor(values, dtype=dtype)
            return out
        channels = shape[1]
        out = torch.full([self.b, shape[2], channels], entry["pad"], dtype=dtype)
        out[mask] = tokens.to(dtype).reshape(-1, channels)
        return self._in_place(out.transpose(1, 2).contiguous())

    def _prompt_values(self) -> pa.Array:
        """Each completion's prompt tokens, flat: the group's prompt repeated per completion."""
        prompts = self._column("prompt_ids")
        offsets = list_offsets(prompts)
        starts = offsets[:-1][self.group_of]
        lengths = np.diff(offsets)[self.group_of]
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return prompts.flatten().take(pa.array(np.repeat(starts, lengths) + within))

    def derived(self, entry: Mapping[str, Any], tensors: dict[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, entry["dtype"])
        key = entry["key"]
        if key == "attention_mask":
            return self._in_place(self.masks.sequence.to(dtype))
        if key == "input_ids":
            return torch.cat([tensors["prompts"], tensors["responses"]], dim=1).to(dtype)
        mask = tensors.get("attention_mask")
        if mask is None:
            mask = self._in_place(self.masks.sequence.to(torch.int64))
        return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0).to(dtype)

    def non_tensor(self, entry: Mapping[str, Any]) -> np.ndarray:
        encoding = entry["encoding"]
        dtype = np.dtype(entry["dtype"]) if "dtype" in entry else np.dtype(object)
        if encoding == "uid":
            group_id = self.batch.column("group_id")
            assert group_id is not None  # a 2.0 column every group row has
            values = group_id.to_numpy(zero_copy_only=False)[self.group_of]
            return self._restore(np.asarray(values, dtype=dtype))
        if encoding == "prompt_messages":
            conversations = conversation_list(self._column("prompt_messages"))
            stored = np.empty(len(self.group_of), dtype=object)
            stored[:] = [conversations[g] for g in self.group_of]
            return self._restore(stored)
        flat = self._flat(entry["column"])
        if encoding == "typed":
            return self._restore(np.asarray(flat.to_numpy(zero_copy_only=False), dtype=dtype))
        if encoding == "text":
            return self._restore(np.asarray(flat.to_numpy(zero_copy_only=False), dtype=object))
        decoded = [json.loads(text) for text in flat.to_pylist()]
        if dtype != np.dtype(object):
            return self._restore(np.asarray(decoded, dtype=dtype))
        stored = np.empty(len(decoded), dtype=object)
        stored[:] = decoded
        return self._restore(stored)

    def _restore(self, stored: np.ndarray) -> np.ndarray:
        out = np.empty_like(stored)
        out[self.rows.numpy()] = stored
        return out
