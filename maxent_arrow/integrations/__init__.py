"""Adapters to other systems, each over the public names of the packages below it:
Ray Data (:mod:`.ray`), TRL's ``GRPOTrainer`` (:mod:`.trl`: record its rollouts into a store),
verl's ``DataProto`` (:mod:`.verl`: to and from a store's rows) and verl's trainer
(:mod:`.verl_recorder`: record a ``RayPPOTrainer`` run). Each loads its own
optional dependency only when used."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
