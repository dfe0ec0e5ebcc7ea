"""Values as strict JSON takes them: each non-finite float (NaN, the infinities: JSON has no
words for them) as ``None``, at any depth of dicts, lists and tuples. The one rule behind the
off-policy report's values, the explorer's page data and the command line's ``--json``
output. Standard library only: the command line imports it before anything heavy."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite"]


def finite(value: Any) -> Any:
    """``value`` with each non-finite float as ``None`` (tuples come back as lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
