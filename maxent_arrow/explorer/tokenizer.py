"""The run's tokenizer, loaded offline, for the piece of text each token id stands for.

A run records its tokenizer's identity in its config (``RunConfig.tokenizer``: the class,
``name_or_path`` or ``name``, the vocabulary size). The tokens page shows each token's
decoded piece beside its id when that tokenizer loads here without a network:

- a name or path that ``transformers.AutoTokenizer`` finds locally (a directory, or a hub
  name already in the local cache: ``local_files_only=True``, never a download, never
  remote code);
- else a tokenizer class of ``transformers`` that needs no files (``ByT5Tokenizer``, whose
  vocabulary is bytes);

and its vocabulary size is the recorded one. Anything else (nothing recorded, ``transformers``
not installed, files not here, another vocabulary) shows the ids only, and the page says
why. ``transformers`` is imported on the first tokens page, not when the explorer starts;
each identity is loaded once per process.
"""

from __future__ import annotations

import json
import threading
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RunTokenizer", "visible"]

# Whitespace made visible in a piece (a space-only token would otherwise look empty).
_VISIBLE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})


def visible(piece: str) -> str:
    """``piece`` with its whitespace drawn (``␣``, ``↵``, ``⇥``), other control characters
    as their escape (``\\x00``), and ``∅`` for nothing (a byte of a character the next
    tokens complete)."""
    if not piece:
        return "∅"
    drawn = piece.translate(_VISIBLE)
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" else c for c in drawn)


class RunTokenizer:
    """The tokenizers of recorded identities, loaded on first use and kept (thread-safe)."""

    def __init__(self) -> None:
        self._loaded: dict[str, tuple[Any | None, str]] = {}
        self._lock = threading.Lock()

    def load(self, identity: Any) -> tuple[Any | None, str]:
        """``(tokenizer, what it is)`` for a recorded identity, or ``(None, why not)``."""
        key = json.dumps(identity, sort_keys=True, default=str)
        with self._lock:
            hit = self._loaded.get(key)
            if hit is None:
                hit = self._loaded[key] = _load(identity)
            return hit

    def pieces(self, identity: Any, ids: Sequence[int]) -> tuple[list[str] | None, str]:
        """Each id's decoded piece (whitespace visible; :func:`visible`), and a sentence
        naming the tokenizer; ``None`` and why when it cannot be loaded here."""
        tokenizer, said = self.load(identity)
        if tokenizer is None:
            return None, said
        try:
            decoded = tokenizer.batch_decode([[int(i)] for i in ids])
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:
            return None, f"{said} could not decode these ids ({exc}): ids only"
        return [visible(p) for p in decoded], said


def _load(identity: Any) -> tuple[Any | None, str]:
    if not isinstance(identity, Mapping) or not identity:
        return None, "the run recorded no tokenizer: ids only"
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed here: ids only"
    kind = identity.get("class")
    name = identity.get("name_or_path") or identity.get("name")
    tokenizer, tried = None, []
    if isinstance(name, str) and name and name != kind:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                name, local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError, ImportError) as exc:
            tried.append(f"{name!r} is not here ({str(exc).splitlines()[0][:120]})")
    if tokenizer is None and isinstance(kind, str) and kind:
        found = getattr(transformers, kind, None)
        base = transformers.PreTrainedTokenizerBase
        if isinstance(found, type) and issubclass(found, base):
            try:
                tokenizer = found()
            except (OSError, ValueError, TypeError, ImportError) as exc:
                tried.append(f"{kind} needs its files ({str(exc).splitlines()[0][:120]})")
        else:
            tried.append(f"{kind} is not a tokenizer class of transformers")
    if tokenizer is None:
        return None, f"the run's tokenizer cannot be loaded here ({'; '.join(tried)}): ids only"
    recorded = identity.get("vocab_size")
    if isinstance(recorded, int) and getattr(tokenizer, "vocab_size", recorded) != recorded:
        return None, (
            f"the tokenizer found here ({type(tokenizer).__name__}) has a vocabulary of "
            f"{tokenizer.vocab_size}, the run recorded {recorded}: ids only"
        )
    where = f" {name}" if isinstance(name, str) and name and name != kind else ""
    return tokenizer, f"decoded by the run's tokenizer, {type(tokenizer).__name__}{where}"
