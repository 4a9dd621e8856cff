"""What may cross the pipe between a policy's supervised process and the gate's: the gate's
classes, builtins, torch (tensors, dtypes) and the few standard modules their pickles name.
Anything else is the policy's own object, which the gate's process never imports: an answer
holding one is refused (``ForeignObject``), an exception of such a class is carried as its
type and text (``ForeignError``)."""
from __future__ import annotations

import io
import pickle

from ..model import properties
from ..model.world import World

__all__ = ["ForeignObject", "ForeignError"]

_SAFE_MODULES = ("dispatcher", "strategies", "builtins", "torch", "collections", "copyreg", "pathlib",
                 "_codecs", "numpy", "functools", "datetime", "fractions", "decimal",
                 "hypothesis.errors")


def _safe(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _SAFE_MODULES)


class ForeignObject(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"an object of class {module}.{name}, which is not the gate's")
        self.module, self.name = module, name


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not _safe(module) or (module == "builtins" and name in ("eval", "exec", "compile",
                                                                   "open", "__import__",
                                                                   "getattr", "setattr")):
            raise ForeignObject(module, name)
        return super().find_class(module, name)


def _loads(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


class ForeignError(properties.RuleCrashed):
    """An exception of a class that is not the gate's (or that does not survive pickling),
    raised by the policy in its process: its type and text, carried as a crash."""


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if the parent can rebuild it with the gate's unpickler, else a ``ForeignError``
    with its type and text."""
    kind = type(exc)
    if _safe(kind.__module__):
        try:
            again = _loads(pickle.dumps(exc))
            if type(again) is kind:
                return again
        except Exception:  # noqa: BLE001 - an exception whose pickle does not rebuild it
            pass
    from ..model.show import text

    return ForeignError(f"[rule crashed] the policy raised {kind.__module__}.{kind.__qualname__}"
                        f": {text(exc)}")


_PLAIN = (int, str, bool, float, type(None))


def _plain(value) -> bool:
    """Whether ``value`` is made of builtins only (no need to check the parent takes it)."""
    if type(value) in _PLAIN:
        return True
    if type(value) in (tuple, list, properties.RuleValues):
        return all(type(v) in _PLAIN for v in value)
    return False


_WORLDS: dict = {}


def _interned(value):
    """``value`` with each World replaced by the first equal one this child saw: what the
    policy's code and the World cache per object (views, an engine's mapped world) is
    computed once per world, as in one process, not once per request."""
    if isinstance(value, World):
        try:
            return _WORLDS.setdefault(value, value)
        finally:
            if len(_WORLDS) > 4096:
                _WORLDS.clear()
    if type(value) is tuple:
        return tuple(_interned(v) for v in value)
    return value
