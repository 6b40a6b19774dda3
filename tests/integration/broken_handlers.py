"""A handler module whose import raises, as a module with a bug at import time does: ``worker
run`` with it exits 1 (a failure, not a configuration error), at every start."""

raise RuntimeError("broken_handlers fails at import, on purpose")
