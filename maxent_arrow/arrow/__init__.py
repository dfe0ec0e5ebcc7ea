"""Arrow underneath everything: the store's schemas, list arrays and their torch twin.

- :mod:`~maxent_arrow.arrow.schema`: the group and step tables of each schema version, the kind
  rule, version checks and schema unification (no torch).
- :mod:`~maxent_arrow.arrow.lists`: offsets and regrouping of Arrow list arrays (no torch).
- :mod:`~maxent_arrow.arrow.ragged`: :class:`Ragged`, values + int64 offsets in torch, viewed
  from Arrow without copying, padded or packed in one vectorised pass, and un-padded by
  ``Ragged.from_padded`` (``prefix_lengths``: the lengths of a ones-then-zeros mask).

Names load on first use (:mod:`maxent_arrow.lazy`), so importing this package imports no torch.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".lists": ["first_null", "list_offsets", "regroup", "single_array"],
        ".identity": ["GroupIdentity", "completion_index_of", "default_group_ids"],
        ".ragged": ["Ragged", "arrow_to_torch", "prefix_lengths", "torch_to_arrow"],
    },
)
