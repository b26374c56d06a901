"""Start-up without the cyclic garbage collector.

Importing torch, the web stack and this package creates a few hundred thousand objects that live as long as the
process, and CPython's collector walks all of them again at each full collection it runs while they are being
created: a large share of a command's start-up goes to collections that find nothing to free. So the collector
is off while the package imports (``paused``) and, in the command-line processes, until their first engine is
loaded (``pause``; the engine calls ``resume``).

Only the ``specdecode`` command and the server's own entry point call ``pause``, each owning its process; in any
other program ``resume`` does nothing.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_pending = False  # pause() turned the collector off and resume() has not turned it back on


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside the block, back to its previous state after it (also on an exception)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on and not _pending:
            gc.enable()


def pause() -> None:
    """The collector off until ``resume``: called by a command's entry point before it loads anything."""
    global _pending
    if gc.isenabled():
        gc.disable()
        _pending = True


def resume() -> None:
    """The collector back on if ``pause`` turned it off; otherwise nothing."""
    global _pending
    if _pending:
        _pending = False
        gc.enable()
