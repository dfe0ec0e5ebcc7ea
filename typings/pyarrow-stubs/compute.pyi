# pyarrow builds most of pyarrow.compute at import time (one Python function per C++ compute
# kernel, `_make_global_functions`) and ships no stubs, so a checker reports every `pc.<kernel>`
# as unknown. This partial stub package (py.typed says "partial": every other pyarrow module
# still resolves to pyarrow itself) makes each name of pyarrow.compute `Any`, as untyped as the
# rest of pyarrow's Cython API is to a checker. (The pyarrow-stubs package was tried instead:
# written for pyarrow 20, it added more errors than it removed, most of them about its own
# stricter signatures: invariant `dict` metadata, `Scalar` where we pass an `int`.)
from typing import Any

def __getattr__(name: str) -> Any: ...
