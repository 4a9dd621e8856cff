"""What every engine's stand-ins share: the stand-in module type (a name the table does not
list fails the load by name, never a silent stub), building ``sys.modules`` entries from an
engine's table, FlashInfer's API as the generation under test defines it, its quantizers as
shapes, and the exception that stops an engine's call at FlashInfer's launch.

An engine's own ``dispatcher/<engine>/standins.py`` holds its table (what its file imports);
its ``loader.py`` executes the file (``exec_engine_file``) inside its sandbox (``reentrant``
over ``unittest.mock.patch.dict(sys.modules, ...)``), holding ``MODULE_TABLE`` meanwhile.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import threading
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Mapping

from ..model.payloads import PayloadFormat, dispatch_payloads
from ..releases.wheels import ReleaseError

__all__ = ["Launched", "StandIn", "Unmodelled", "UnmodelledCode", "UnmodelledModule",
           "UnmodelledFinder", "FlashInferStandIn", "build_modules", "flashinfer_api",
           "quantized_zeros", "fp4_quantize", "mxfp8_quantize", "identity", "MODULE_TABLE",
           "reentrant", "exec_engine_file"]

# Held while an engine's stand-ins are in sys.modules (its sandbox), and by any thread that
# imports while the main thread may be in one (dispatcher/gpu/warm.py): an import in another
# thread meanwhile would find a stand-in, and the sandbox's exit would drop what it imported.
MODULE_TABLE = threading.RLock()


def reentrant(patches):
    """An engine's sandbox, entered once however deeply its uses nest: ``patches(*args)`` (a
    context manager putting the stand-ins in place) runs again only where a level asks for
    other stand-ins than the one around it (another FlashInfer generation), so a step enters
    it once for all its ranks and each rank's call costs one check."""
    entered: list = []  # the arguments of each level that put stand-ins in place

    @contextmanager
    def sandbox(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if entered and entered[-1] == key:
            yield
            return
        with MODULE_TABLE, patches(*args, **kwargs):
            entered.append(key)
            try:
                yield
            finally:
                entered.pop()
    return sandbox


def exec_engine_file(path: Path, module_name: str, sandbox, spec_name: str):
    """Execute an engine's file as module ``module_name`` inside ``sandbox`` (a context that
    puts its stand-ins in ``sys.modules``). A name the stand-ins lack stays the ImportError
    that names it; anything else the file raises is a ``ReleaseError``. Its logger is quieted."""
    import logging

    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        with sandbox:
            spec.loader.exec_module(module)
    except (ImportError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit at import is a bad file too
        raise ReleaseError(f"{spec_name}:{path}: loading it raised {type(exc).__name__}: "
                           f"{exc}") from exc
    logging.getLogger(module_name).setLevel(logging.ERROR)  # e.g. "No tokens on this DP worker"
    return module


class UnmodelledCode(ReleaseError):
    """The release used a name of one of the engine's modules the gate neither runs nor stands
    in: not judged, never blamed on the engine."""


class Unmodelled:
    """A name of an engine module the gate does not run: any use raises ``UnmodelledCode``."""

    def __init__(self, qualname: str):
        object.__setattr__(self, "_qualname", qualname)

    def _refuse(self, *a, **k):
        raise UnmodelledCode(
            f"the release used {self._qualname}, which the gate neither runs nor stands in "
            f"(dispatcher/<engine>/standins.py, dispatcher/vllm/release_modules.py): not judged")

    __call__ = __bool__ = __iter__ = __len__ = __index__ = __int__ = _refuse
    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __enter__ = _refuse

    def __hash__(self):
        return hash(self._qualname)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unmodelled(f"{self._qualname}.{name}")

    def __repr__(self):
        return f"<not run by the gate: {self._qualname}>"


class UnmodelledModule(types.ModuleType):
    """An engine module the gate does not run: its names are ``Unmodelled``."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unmodelled(f"{self.__name__}.{name}")


class UnmodelledFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every module of the engine's package (``prefix``, ``prefix.*``) that nothing else
    provides, as an ``UnmodelledModule``: a release may import a module of its own that it never
    uses on the path the gate runs, and that import then simply works (put last on
    ``sys.meta_path`` while the engine's sandbox is in place)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def find_spec(self, name, path=None, target=None):
        if name == self.prefix or name.startswith(self.prefix + "."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = UnmodelledModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class Launched(Exception):
    """The engine's call reached FlashInfer's launch: ``record`` holds what it passed."""

    def __init__(self, record):
        super().__init__(record)
        self.record = record


class StandIn(types.ModuleType):
    """A stand-in module: only the names listed; anything else fails the load by name
    (``adapter``: the engine package whose standins.py would hold it)."""

    adapter = ""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"the {self.adapter} adapter has no stand-in for {self.__name__}.{name}: "
                          f"add it in dispatcher/{self.adapter}/standins.py")


class FlashInferStandIn(StandIn):
    """A FlashInfer module of the generation under test: a name that release does not bind
    fails the import as Python would (``cannot import name ...``)."""

    version = ""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"cannot import name {name!r} from {self.__name__!r} (FlashInfer "
                          f"{self.version} has no such name)", name=self.__name__)


class LenientStandIn(StandIn):
    """A stand-in module of the engine's own code whose unlisted names are ``Unmodelled``: the
    engine's next release may import a name it never uses on this path (it is then simply
    run), and any use of one is refused by name, never a silent stub."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        import sys

        sub = sys.modules.get(f"{self.__name__}.{name}")  # a submodule the sandbox holds now
        return sub if sub is not None else Unmodelled(f"{self.__name__}.{name}")


def build_modules(table: Mapping[str, Mapping[str, object]], adapter: str, version: str,
                  flashinfer_names: bool = True, lenient: bool = False
                  ) -> Dict[str, types.ModuleType]:
    """One stand-in module per entry of ``table`` (module name -> its names); each a package
    (submodule imports resolve through ``sys.modules``) and an attribute of its parent
    (``import a.b.c as x`` walks them). ``flashinfer_names``: the table's FlashInfer modules
    hold every name release ``version`` binds that the engine's file uses, so a missing name
    is FlashInfer's (``cannot import name``), not the adapter's. ``lenient``: the engine's
    modules are ``LenientStandIn`` (FlashInfer's stay strict)."""
    mods = {}
    for name, attrs in table.items():
        flashinfer = name.split(".")[0] == "flashinfer"
        m = (FlashInferStandIn(name) if flashinfer and flashinfer_names else
             LenientStandIn(name) if lenient and not flashinfer else StandIn(name))
        m.adapter, m.version = adapter, version
        m.__dict__.update(attrs)
        m.__path__ = []
        mods[name] = m
    for name, m in mods.items():
        parent, _, child = name.rpartition(".")
        if parent in mods:
            mods[parent].__dict__.setdefault(child, m)
    return mods


def flashinfer_api():
    """The API of the FlashInfer generation of the step being run (the world's, entered by the
    engine's sandbox: ``generations.modelling``), read from its source
    (``dispatcher/flashinfer/api.py``)."""
    from ..flashinfer.api import api
    from ..model.generations import in_force

    return api(in_force().version)


def quantized_zeros(x, fmt: PayloadFormat):
    """Zero tensors of the shapes FlashInfer's quantizer returns for ``fmt`` (values are
    never read for sizing): the hidden payload and its scales, bytes from the byte model."""
    import torch

    n, h = x.shape
    hidden, scales = dispatch_payloads(fmt, h, 1)[:2]
    return (torch.zeros(n, hidden.bytes_per_token, dtype=torch.uint8),
            torch.zeros(n, scales.bytes_per_token, dtype=torch.uint8))


def fp4_quantize(x, *a, **k):
    return quantized_zeros(x, PayloadFormat.NVFP4)


def mxfp8_quantize(x, *a, **k):
    import torch

    q, sf = quantized_zeros(x, PayloadFormat.MXFP8)
    return q.view(torch.float8_e4m3fn), sf.reshape(-1)


def identity(x, *a, **k):
    return x
