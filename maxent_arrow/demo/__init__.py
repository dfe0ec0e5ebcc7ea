"""The main job of ``make demo``: a seeded tiny GPT-2 warm-started on the shipped
demonstrations, trained with MaxEnt-GRPO on the shipped arithmetic prompts with two rewards
(:mod:`.rewards`), every step stored, then evaluated, replayed and reported (:mod:`.stages`),
behind a command line that loads torch only when a run starts (:mod:`.job`)."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
