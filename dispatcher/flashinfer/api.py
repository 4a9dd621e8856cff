"""The API a FlashInfer release offers engines, read from its own source (never retyped).

An engine's file under test imports names from ``flashinfer.comm`` and calls a handful of
FlashInfer functions; the recorders that stand in for FlashInfer must offer exactly that
release's names and refuse exactly the calls its signatures refuse, so an engine release that
calls an API the generation lacks fails here with the error it would raise in production
(``ImportError``, ``TypeError``). ``api(version)`` parses the release's files (fetched and
verified by ``fetch.py``) with ``ast``: the names ``flashinfer/comm/__init__.py`` binds, which
modules exist, and the parameter lists of the entry points engines call.
"""
from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Optional

from .fetch import (COMM_INIT, MOE_A2A_072, MOE_EP_INIT, ONE_SIDED, TWO_SIDED, TWO_SIDED_EP,
                    PACKAGE, ReleaseError)

__all__ = ["Api", "api", "ENTRY_POINTS"]

# entry point -> (file, class or None, function): what engines call
ENTRY_POINTS = {
    "MoeAlltoAll.__init__": (MOE_A2A_072, "MoeAlltoAll", "__init__"),
    "MoeAlltoAll.dispatch": (MOE_A2A_072, "MoeAlltoAll", "dispatch"),
    "MoeAlltoAll.combine": (MOE_A2A_072, "MoeAlltoAll", "combine"),
    "moe_a2a_get_workspace_size_per_rank": (MOE_A2A_072, None,
                                            "moe_a2a_get_workspace_size_per_rank"),
    "NVLinkOneSidedAlltoAll.dispatch": (ONE_SIDED, "NVLinkOneSidedAlltoAll", "dispatch"),
    "NVLinkOneSidedAlltoAll.combine": (ONE_SIDED, "NVLinkOneSidedAlltoAll", "combine"),
    "NVLinkTwoSidedAlltoAll.dispatch": (TWO_SIDED_EP, "NVLinkTwoSidedAlltoAll", "dispatch"),
}
# modules engines import by path (``flashinfer.comm.trtllm_alltoall``: vLLM's two-sided file)
MODULES = {"flashinfer.comm.trtllm_alltoall": TWO_SIDED,
           "flashinfer.comm.trtllm_moe_alltoall": MOE_A2A_072}


@dataclass(frozen=True)
class Api:
    version: str
    comm_names: FrozenSet[str]  # what ``from flashinfer.comm import NAME`` finds
    moe_ep_names: FrozenSet[str]  # what ``from flashinfer.moe_ep import NAME`` finds
    modules: FrozenSet[str]  # importable modules of MODULES
    signatures: Dict[str, inspect.Signature]  # of ENTRY_POINTS present in the release

    def has(self, name: str) -> bool:
        return name in self.signatures

    def bind(self, entry: str, *args, **kwargs) -> inspect.BoundArguments:
        """Bind a call as the release's function would (``self`` excluded), defaults applied;
        raises the ``TypeError`` Python raises for that call."""
        sig = self.signatures.get(entry)
        if sig is None:
            raise AttributeError(f"FlashInfer {self.version} has no {entry}")
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{entry}() {exc}{self._taken_elsewhere(entry, kwargs)}") from None
        bound.apply_defaults()
        return bound

    def _taken_elsewhere(self, entry: str, kwargs) -> str:
        """For a keyword this release does not take: which generation's ``entry`` does (a
        compatibility verdict: the engine calls another FlashInfer's API)."""
        from ..model.generations import GENERATIONS

        unknown = [k for k in kwargs if k not in self.signatures[entry].parameters]
        if not unknown:
            return ""
        others = [v for v in GENERATIONS if v != self.version and api(v).has(entry)
                  and all(k in api(v).signatures[entry].parameters for k in unknown)]
        taken = ", ".join(f"FlashInfer {v}" for v in others) or "no FlashInfer the gate models"
        return (f" (FlashInfer {self.version} does not take "
                f"{', '.join(k + '=' for k in unknown)}; {taken} does)")

    def runtime_keyword(self, entry: str) -> Optional[str]:
        """The parameter of ``entry`` that carries the runtime tokens per rank."""
        names = [n for n in self.signatures[entry].parameters if n.endswith("max_tokens_per_rank")]
        return names[0] if names else None


def _signature(node: ast.FunctionDef, method: bool) -> inspect.Signature:
    """The parameter list of ``node`` (names, kinds and which have defaults), as a signature."""
    args = node.args
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        a.annotation = None
    if args.vararg:
        args.vararg.annotation = None
    if args.kwarg:
        args.kwarg.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    stub = ast.FunctionDef(name=node.name, args=args, body=[ast.Pass()], decorator_list=[],
                           returns=None, type_params=[])
    ns: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module([stub], [])), "<signature>", "exec"), ns)
    sig = inspect.signature(ns[node.name])
    if method:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def _find(tree: ast.Module, cls: Optional[str], func: str) -> Optional[ast.FunctionDef]:
    body = tree.body
    if cls is not None:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            return None
        body = found[0].body
    for n in body:
        if isinstance(n, ast.FunctionDef) and n.name == func:
            return n
    return None


def _bound_names(tree: ast.Module) -> FrozenSet[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def api(version: str) -> Api:
    """The API of FlashInfer ``version`` (a generation of ``model.generations.GENERATIONS``)."""
    main = PACKAGE.fetch_release(version)

    def tree(name: str) -> Optional[ast.Module]:
        path = main if name == ONE_SIDED else PACKAGE.companion_file(main, name)
        return None if path is None else ast.parse(Path(path).read_text())

    comm = tree(COMM_INIT)
    if comm is None:
        raise ReleaseError(f"FlashInfer {version} has no {COMM_INIT}")
    signatures = {}
    for entry, (file, cls, func) in ENTRY_POINTS.items():
        t = tree(file)
        node = None if t is None else _find(t, cls, func)
        if node is not None:
            signatures[entry] = _signature(node, method=cls is not None)
    modules = frozenset(m for m, f in MODULES.items() if tree(f) is not None)
    moe_ep = tree(MOE_EP_INIT)
    return Api(version, _bound_names(comm), _bound_names(moe_ep) if moe_ep else frozenset(),
               modules, signatures)
