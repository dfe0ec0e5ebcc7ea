"""maxent-arrow: an Apache Arrow columnar batch store for GRPO-style LLM reinforcement learning.

The public surface: the seed's 15 per-batch dataclasses (facades over Arrow record batches),
``Ragged`` (zero-copy torch views of Arrow list columns, padded or packed in one pass), the
rollout batch and store, analytics, and the error hierarchy. The package tree is the
architecture (``docs/architecture.md``): ``errors`` · ``arrow`` · ``types`` · ``compute`` |
``ingest`` · ``rollout`` · ``store`` · ``analytics`` | ``train`` · ``integrations`` ·
``demo`` · ``cli``, each importing only the ones before it.

Every name loads on first use (declared in ``__init__.pyi``, loaded by ``lazy_loader``):
``import maxent_arrow`` imports no torch, so commands that make no tensor start fast.
"""

import atexit
import gc

import lazy_loader

__version__ = "0.1.0"

# Arrow scanners and readers abandoned before exit keep native worker threads alive; if they
# are only collected during interpreter teardown, after Arrow's pools are gone, the process
# aborts with "terminate called without an active exception" (apache/arrow#34314,
# huggingface/datasets#7566). Collecting them while Arrow is still alive joins those threads.
atexit.register(gc.collect)

__getattr__, _dir_exports, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]


def __dir__() -> list[str]:
    return [*_dir_exports(), "__version__"]
