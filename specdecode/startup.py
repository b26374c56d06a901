"""Start-up without the cyclic garbage collector.

Importing torch, the web stack and this package creates a few hundred thousand objects that live as long as the
process, and CPython's collector walks all of them again at each full collection it runs while they are being
created: a large share of a command's start-up goes to collections that find nothing to free. So the collector
is off while torch imports (``pause_torch_import``: the first import of torch in the process, from whichever
module, runs ``paused``) and, in the command-line processes, until their first engine is loaded (``pause``; the
engine calls ``resume``).

Only the ``specdecode`` command and the server's own entry point call ``pause``, each owning its process; in any
other program ``resume`` does nothing.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.abc
import sys
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


class _Paused(importlib.abc.Loader):
    """A module's own loader, run with the collector paused. The module gets its own loader back before it runs,
    so nothing that asks it for its loader (resources, source) ever sees this one."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        with paused():
            self._loader.exec_module(module)


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds torch with the finders after it, the first time it is imported, and pauses the collector while it
    loads; then steps aside. The package imports torch only where a name needs it (specdecode/__init__.py), so
    this is the one place that covers every way in: the library, the commands, the server module, Ray replicas."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Paused(spec.loader)
                return spec
        return None


def pause_torch_import() -> None:
    """Installs _TorchFinder unless torch is imported already (or the finder is installed)."""
    if "torch" not in sys.modules and not any(isinstance(f, _TorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchFinder())
