"""The 15 seed records of ``maxent_grpo.training.types.rewards`` (:mod:`.rewards` is the
seed-compatible import path), the settings types ``ValidationContext`` names
(:mod:`.settings`), and the helpers of code that makes records from Arrow columns or reads
their batches (``rewards_batch`` with its ``SampleColumns`` and ``SeedColumns``,
``reference_batch`` with its ``GivenForm``, ``sample_messages``, ``record_scalars``).

Names load on first use; importing this package imports no torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
