"""``maxent-arrow view``: a local, read-only web explorer of a run (docs/architecture.md)."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
