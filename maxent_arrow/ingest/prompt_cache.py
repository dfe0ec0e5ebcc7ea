"""``PromptCache``: prompt text -> token ids, kept in Arrow and persisted as one Parquet file.

The original pipeline tokenized prompts through a per-process ``functools.lru_cache`` keyed by
the prompt string (``docs/formulas.md`` §2.1, ``docs/seed-bugs.md`` §3): lost on every restart,
stacked twice, and, when no getter was configured, silently replaced by an *empty* prompt. This
cache is one Arrow table (``prompt`` string, ``input_ids`` list<int32>), looked up with a
vectorised hash join (``pyarrow.compute.index_in``), filled by one batched tokenizer call per
lookup for the misses only, and saved beside a rollout store so a restarted trainer does not
re-tokenize. No pickle: the tokenizer identity it was built with rides in the file as JSON and
is checked on load.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from maxent_arrow.errors import LayoutError, SchemaError, StoreError
from maxent_arrow.types import PromptCacheEntry

__all__ = ["PromptCache", "tokenizer_identity"]

_IDS_TYPE = pa.list_(pa.field("item", pa.int32(), nullable=False))
_SCHEMA = pa.schema([pa.field("prompt", pa.string(), nullable=False), ("input_ids", _IDS_TYPE)])
_META_KEY = b"maxent_arrow.prompt_cache"
_FORMAT = 1


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What makes two tokenizers interchangeable for the cache (JSON-safe).

    The class, ``name_or_path`` and vocabulary size; a cache built with one tokenizer is refused
    with another, since the same text would map to different ids.
    """
    if tokenizer is None:
        return {}
    return {
        "class": type(tokenizer).__name__,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""),
        "vocab_size": int(getattr(tokenizer, "vocab_size", 0) or 0),
    }


class PromptCache:
    """Tokenized prompts keyed by their text, as an Arrow table.

    Parameters
    ----------
    tokenizer:
        A ``transformers`` tokenizer, called as ``tokenizer(texts, add_special_tokens=False,
        padding=False, truncation=..., max_length=...)`` (the seed's settings) for the prompts
        not yet cached. Without one, a lookup that misses raises :class:`LayoutError`.
    max_prompt_len:
        Keep the first ``max_prompt_len`` tokens of each prompt (head truncation, as the
        seed's ``truncation=True`` with right-side truncation). ``None`` keeps them all.

    Examples
    --------
    >>> cache = PromptCache(tokenizer, max_prompt_len=512)       # doctest: +SKIP
    >>> ids = cache.lookup(["What is 2+2?", "Name a prime."])    # list<int32>, one row each
    >>> cache.save(store_root / "prompt_cache.parquet")          # a restart reloads it
    """

    def __init__(self, tokenizer: Any = None, *, max_prompt_len: int | None = None) -> None:
        if max_prompt_len is not None and int(max_prompt_len) < 1:
            raise LayoutError(f"PromptCache.max_prompt_len: expected >= 1, got {max_prompt_len}")
        self.tokenizer = tokenizer
        self.max_prompt_len = None if max_prompt_len is None else int(max_prompt_len)
        self._table = _SCHEMA.empty_table()
        self.misses = 0  # prompts tokenized by this instance (tests and logs read it)

    # ------------------------------------------------------------------ lookups
    def __len__(self) -> int:
        return self._table.num_rows

    def __contains__(self, prompt: object) -> bool:
        if not isinstance(prompt, str) or not len(self):
            return False
        found = pc.index_in(pa.array([prompt]), value_set=self._table.column("prompt"))
        return found[0].is_valid

    def lookup(self, prompts: pa.Array | pa.ChunkedArray | Sequence[str]) -> pa.Array:
        """Token ids of each prompt, as a ``list<int32>`` array aligned with ``prompts``.

        Prompts already cached are found with one hash join; the others are tokenized in one
        batched call (each distinct text once) and added. Repeated prompts share one entry.
        """
        query = _as_strings(prompts)
        if query.null_count:
            at = int(np.flatnonzero(~query.is_valid().to_numpy(zero_copy_only=False))[0])
            raise LayoutError(f"PromptCache.lookup: expected prompt text, got null at group {at}")
        index = self._index(query)
        if index.null_count:
            missing = pc.unique(pc.filter(query, pc.is_null(index)))
            self._add(missing, self._tokenize(missing))
            index = self._index(query)
        return self._table.column("input_ids").take(index).combine_chunks()

    def get(self, prompt: str):
        """The seed's ``prompt_cache_get``: one prompt as a ``PromptCacheEntry`` (plain lists)."""
        ids = self.lookup([prompt])[0].values.to_pylist()
        return PromptCacheEntry(ids, [1] * len(ids))

    __call__ = get

    def _index(self, query: pa.Array) -> pa.Array:
        if not len(self):
            return pa.nulls(len(query), pa.int32())
        return pc.index_in(query, value_set=self._table.column("prompt"))

    def _tokenize(self, texts: pa.Array) -> pa.Array:
        if self.tokenizer is None:
            raise LayoutError(
                f"PromptCache: {len(texts)} prompt(s) have no stored token ids and no tokenizer "
                f"was given to tokenize them (first: {texts[0].as_py()[:60]!r}); pass "
                "tokenizer= (the original pipeline silently scored such prompts as empty)"
            )
        limit = self.max_prompt_len
        encoded = self.tokenizer(
            texts.to_pylist(),
            add_special_tokens=False,
            padding=False,
            truncation=limit is not None,
            max_length=limit,
        )["input_ids"]
        self.misses += len(texts)
        return pa.array(encoded, type=_IDS_TYPE)

    def _add(self, prompts: pa.Array, ids: pa.Array) -> None:
        if self.max_prompt_len is not None:
            ids = pc.list_slice(ids, 0, self.max_prompt_len).cast(_IDS_TYPE)
        new = pa.table({"prompt": prompts.cast(pa.string()), "input_ids": ids}, schema=_SCHEMA)
        self._table = pa.concat_tables([self._table, new]).combine_chunks()

    def update(self, prompts: Sequence[str] | pa.Array, input_ids: pa.Array | Sequence) -> None:
        """Add known tokenizations (e.g. a store's ``prompt`` and ``prompt_ids`` columns).

        Prompts already cached keep their entry.
        """
        texts = _as_strings(prompts)
        ids: pa.Array = (
            input_ids if isinstance(input_ids, pa.Array) else pa.array(input_ids, _IDS_TYPE)
        )
        if len(ids) != len(texts):
            raise LayoutError(
                f"PromptCache.update: expected {len(texts)} id lists (one per prompt), got "
                f"{len(ids)}"
            )
        if ids.null_count:
            keep = ids.is_valid()
            texts, ids = texts.filter(keep), ids.filter(keep)
        fresh = pc.is_null(self._index(texts))
        texts, ids = texts.filter(fresh), ids.filter(fresh)
        if len(texts):
            # First occurrence of each new text wins.
            first = pc.index_in(texts, value_set=pc.unique(texts))
            _, keep = np.unique(first.to_numpy(zero_copy_only=False), return_index=True)
            self._add(texts.take(pa.array(keep)), ids.cast(_IDS_TYPE).take(pa.array(keep)))

    # ------------------------------------------------------------------ persistence
    def to_arrow(self) -> pa.Table:
        """The cache as a table (``prompt``, ``input_ids``), metadata included."""
        meta = {
            "format": _FORMAT,
            "tokenizer": tokenizer_identity(self.tokenizer),
            "max_prompt_len": self.max_prompt_len,
        }
        return self._table.replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})

    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to one Parquet file, atomically (temporary file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            pq.write_table(
                self.to_arrow(),
                tmp,
                compression="zstd",
                # pyarrow takes a bool or a list of columns here; its default makes it `bool`.
                use_dictionary=["prompt"],  # pyright: ignore[reportArgumentType]
            )
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"PromptCache.save: could not write {path}: {exc}") from exc
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        tokenizer: Any = None,
        *,
        max_prompt_len: int | None = None,
    ) -> PromptCache:
        """Read a saved cache; refuse it if it was built with another tokenizer or length.

        ``max_prompt_len=None`` takes the saved one. A missing file gives an empty cache.
        """
        path = Path(path)
        if not path.exists():
            return cls(tokenizer, max_prompt_len=max_prompt_len)
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise StoreError(
                f"PromptCache.load: {path} is not a readable Parquet file: {exc}"
            ) from exc
        raw = (table.schema.metadata or {}).get(_META_KEY)
        if raw is None:
            raise StoreError(f"PromptCache.load: {path} has no {_META_KEY.decode()} metadata")
        meta = json.loads(raw)
        saved_limit = meta.get("max_prompt_len")
        limit = saved_limit if max_prompt_len is None else int(max_prompt_len)
        if saved_limit != limit:
            raise StoreError(
                f"PromptCache.load: {path} holds prompts cut to max_prompt_len={saved_limit}, "
                f"expected {limit}"
            )
        if tokenizer is not None and meta.get("tokenizer") != tokenizer_identity(tokenizer):
            raise StoreError(
                f"PromptCache.load: {path} was built with tokenizer {meta.get('tokenizer')}, "
                f"expected {tokenizer_identity(tokenizer)}"
            )
        if table.schema.remove_metadata() != _SCHEMA:
            try:
                table = table.select(["prompt", "input_ids"]).cast(_SCHEMA)
            except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(f"PromptCache.load: {path}: unexpected columns: {exc}") from None
        cache = cls(tokenizer, max_prompt_len=limit)
        cache._table = table.replace_schema_metadata(None).combine_chunks()
        return cache

    def __repr__(self) -> str:
        return f"PromptCache({len(self)} prompts, max_prompt_len={self.max_prompt_len})"


def _as_strings(prompts: Any) -> pa.Array:
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks()
    if isinstance(prompts, pa.Array):
        if not (pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type)):
            raise SchemaError(f"PromptCache: expected a string array, got {prompts.type}")
        return prompts.cast(pa.string())
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise SchemaError(f"PromptCache: expected a list of prompt strings, got {type(prompts)}")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise SchemaError(
                f"PromptCache: expected a str at position {i}, got {type(text).__name__}"
            )
    return pa.array(list(prompts), type=pa.string())
