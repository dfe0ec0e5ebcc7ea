"""One step of one rank as Arrow, and what can be recomputed from it.

- :class:`RolloutBatch`: the group rows and the step row of one step of one rank, built from
  the seed objects (:meth:`RolloutBatch.from_parts`) or from Arrow, giving the seed objects
  back as views.
- :class:`RunConfig`: the replay contract, the settings a step was computed with.
- :func:`recompute`: advantages, q and MaxEnt weights of a batch from its stored facts (also
  under TRL's conventions); :func:`recompute_kl`: the k3 KL of its stored log-probs.
- :func:`reassemble`: the parts of a group that ranks wrote separately, merged into one row.
- :func:`trainer_metrics_table`: a trainer's logged figures as records of their own (the
  ``trainer_metrics`` record table).

Names load on first use; importing this package imports no torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
