# The exports of maxent_arrow.explorer: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .app import make_app as make_app
from .data import RunData as RunData
from .server import Viewer as Viewer, serve as serve
