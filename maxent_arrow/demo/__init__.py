"""The main job of ``make demo``: a seeded tiny GPT-2 trained on the shipped arithmetic
prompts with two rewards (:mod:`.rewards`), every step stored, then replayed, evaluated and
reported (:mod:`.job`)."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
