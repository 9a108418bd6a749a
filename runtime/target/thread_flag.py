"""A flag each thread sets for itself inside a `with`: a context one engine's thread is in (a prefill, a draft) that
must not reach another thread's forwards (a verify, which must stay exact)."""
from __future__ import annotations

import contextlib
import threading


class ThreadFlag:
    def __init__(self):
        self._local = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def raised(self):
        """On inside, as it was after (nested uses included)."""
        before = self.on
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before
