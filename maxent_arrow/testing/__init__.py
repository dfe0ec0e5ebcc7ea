"""The factories our tests share, public so that a test suite (ours or a user's) never copies
them: seeded rollout batches, stores built of them, and a run written with known values.

- :func:`make_batch` / :func:`make_parts`: a complete, seeded
  :class:`~maxent_arrow.rollout.RolloutBatch` (every seed object) of given groups, group sizes
  and lengths, with :data:`CONFIG`; :func:`expected_group_math`: its derived values by the
  formulas, in plain numpy.
- :func:`streamed_batch`: the smallest batch of a prompt stream's groups (no torch).
- :func:`loose_store`, :func:`compacted_run`, :func:`resume_run`: stores of seeded steps (one
  file each, in part compacted, resumed by a second attempt); :func:`unit_path`: the committed
  file of one unit.
- :func:`write_store`: a run of known values written from Arrow (:class:`Written`), to check
  queries against.

Names load on first use; importing this package imports no torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
