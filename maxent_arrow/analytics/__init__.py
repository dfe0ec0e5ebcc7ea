"""Analytics over a saved run: DuckDB views, the ready-made queries, the plotted report and
exports (Arrow IPC, Hugging Face ``datasets``).

Names load on first use; importing this package imports no torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
