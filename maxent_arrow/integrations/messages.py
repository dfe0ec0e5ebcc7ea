"""Chat messages and free-form values of other trainers as Arrow: typed messages (``role``,
``content``, everything else as JSON in ``extra``; :data:`~maxent_arrow.arrow.schema.
MESSAGE_TYPE`), and strict JSON for values that have no typed column.

Strict means: what ``json`` writes, plus numpy scalars and arrays (written as numbers and
lists). Anything else (an image, a tensor, an arbitrary object) is refused with a
:class:`~maxent_arrow.errors.SchemaError` naming where it was, never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError

__all__ = [
    "conversation_list",
    "is_conversation",
    "json_text",
    "messages_array",
    "strip_images",
]


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is a chat conversation: a list of dicts with a ``role`` each."""
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def strip_images(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with image objects dropped from its content blocks (a
    ``{"type": "image", "image": <PIL.Image>}`` block becomes ``{"type": "image"}``), as TRL
    does before it logs a conversation."""
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {k: v for k, v in block.items() if k != "image"}
                if isinstance(block, Mapping) and block.get("type") == "image"
                else block
                for block in content
            ]
            message = {**message, "content": content}
        out.append(dict(message))
    return out


def _plain(value: Any, where: str) -> Any:
    """``json.dumps`` ``default``: numpy scalars and arrays as numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return value.tolist()
    if isinstance(value, np.ndarray) and value.dtype == object:
        return list(value)
    raise SchemaError(
        f"{where}: expected JSON-able values (str, numbers, bools, None, lists, dicts), got "
        f"{type(value).__module__}.{type(value).__qualname__}; it is not stored (never pickled)"
    )


def json_text(value: Any, *, where: str) -> str:
    """``value`` as JSON text, refusing what JSON cannot hold (see the module doc). NaN and
    infinities are written as ``NaN``/``Infinity`` (Python's ``json`` reads them back)."""
    try:
        return json.dumps(value, default=lambda v: _plain(v, where), allow_nan=True)
    except (TypeError, ValueError) as exc:  # e.g. a dict key that is not a string
        raise SchemaError(f"{where}: expected a JSON-able value ({exc})") from None


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise SchemaError(f"{where}: expected a message dict, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    if content is not None and not isinstance(content, str):
        # Content blocks (text and images) have no typed column: they go to `extra`.
        rest["content"] = content
        content = None
    if role is not None and not isinstance(role, str):
        raise SchemaError(f"{where}: role: expected a string, got {type(role).__name__}")
    return {
        "role": role,
        "content": content,
        "extra": json_text(rest, where=where) if rest else None,
    }


def messages_array(conversations: Sequence[Any], *, where: str) -> pa.Array:
    """One ``list<message>`` value per conversation (:data:`~maxent_arrow.arrow.schema.
    MESSAGES_TYPE`); a ``None`` conversation is a null."""
    values = [
        None
        if conversation is None
        else [_message(m, f"{where}[{i}][{j}]") for j, m in enumerate(conversation)]
        for i, conversation in enumerate(conversations)
    ]
    return pa.array(values, S.MESSAGES_TYPE)


def conversation_list(array: pa.Array) -> list[list[dict[str, Any]] | None]:
    """The conversations of a ``list<message>`` array as Python lists of dicts: ``role`` and
    ``content`` plus the keys of ``extra`` (so a message stored by :func:`messages_array`
    comes back equal)."""
    out = []
    for conversation in array.to_pylist():
        if conversation is None:
            out.append(None)
            continue
        messages = []
        for m in conversation:
            message = {"role": m["role"], "content": m["content"]}
            if m.get("extra"):
                message.update(json.loads(m["extra"]))
            messages.append(message)
        out.append(messages)
    return out
