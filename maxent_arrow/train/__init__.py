"""Training with the store underneath: a supervised warm start (:mod:`.supervised`), sampling
K completions (:mod:`.generation`), teacher-forced scoring (:mod:`.scoring`), the
MaxEnt-GRPO trainer (:mod:`.trainer`), evaluation through the seed's ``ValidationContext``
(:mod:`.evaluation`) and the offline re-scoring of saved steps (:mod:`.offline`).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
