"""Arrow underneath everything: the store's schemas, list arrays and their torch twin.

- :mod:`~maxent_arrow.arrow.registry`: every stored column declared once (no torch);
  :mod:`~maxent_arrow.arrow.schema`: the group and step tables derived from it, the kind rule,
  version checks and schema unification (no torch).
- :mod:`~maxent_arrow.arrow.lists`: offsets and regrouping of Arrow list arrays (no torch).
- :mod:`~maxent_arrow.arrow.keptsets`: the gap-coded kept-token sets of the off-policy
  contract (``kept_token_ids``): encoding, decoding, the column's type (no torch).
- :mod:`~maxent_arrow.arrow.ragged`: :class:`Ragged`, values + int64 offsets in torch, viewed
  from Arrow without copying, padded or packed in one vectorised pass, and un-padded by
  ``Ragged.from_padded``.

Names load on first use (declared in ``__init__.pyi``; ``docs/architecture.md`` §4), so
importing this package imports no torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
