"""Group math on (values, offsets), in torch, the same code on CPU and GPU.

Utilities, group advantages, q-distributions, MaxEnt weights, reward moments and length stats
(:mod:`.group_math`), SEED-GRPO scaling (:mod:`.seed_grpo`), the whole reward step
(:mod:`.reward_step`), KL (:mod:`.kl`), the MaxEnt and GRPO losses (:mod:`.loss`) and the batch
diagnostics (:mod:`.diagnostics`) and the off-policy corrections of TRL and verl
(:mod:`.offpolicy`), all over segment reductions (:mod:`.segments`). The
formulas are ``docs/formulas.md``; no Python loop over groups or samples.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
