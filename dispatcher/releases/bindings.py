"""What a module of engine code binds to a name, read as Python binds it on import: the last
of the module's own top-level bindings of the name, a plain ``def`` or a rebinding to another
name, undecorated or under functools' caches alone. Where the gate cannot tell which object
that is (a binding under a condition, an import, any other decorator or expression), it is a
``ReleaseError`` naming the lines: the gate never runs another object. ``companion_function``
compiles the bound ``def`` alone (a default that is not a literal is ``Unevaluated``). Files
are parsed from bytes, so a UTF-8 BOM or a coding declaration reads as Python does."""
from __future__ import annotations

import ast
import copy
import functools
from pathlib import Path
from typing import Callable, Dict, Optional

from .wheels import ReleaseError

__all__ = ["parse", "defines", "Unevaluated", "companion_function"]


def parse(path: Path) -> ast.Module:
    """``path`` parsed as Python parses a source file (bytes: a BOM or coding line honoured);
    an unreadable or invalid file is a ``ReleaseError`` naming it. Parsed once per content
    (SGLang's server_args.py is ~450 KB and several pieces are looked for in it); callers
    that change the tree must copy it first (``companion_function`` does)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ReleaseError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return _parsed(data)
    except (SyntaxError, ValueError) as exc:
        raise ReleaseError(f"{path}: cannot be read as Python ({type(exc).__name__}: "
                           f"{exc})") from None


@functools.lru_cache(maxsize=256)  # every pinned release's companion files, with room
def _parsed(data: bytes) -> ast.Module:
    return ast.parse(data)


def defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its own level (a ``def``, or any other
    binding: ``companion_function`` then resolves it as Python would, or refuses it by name)."""
    return bool(_module_bindings(parse(path), name))


class Unevaluated:
    """Stands for a default argument of a companion function that is not a literal: it is not
    evaluated when the function is compiled alone (nothing of the file runs but the body)."""

    def __init__(self, source: str):
        self.source = source

    def __repr__(self):
        return f"<default {self.source} not evaluated>"


def _module_bindings(tree: ast.Module, name: str):
    """Every statement of the module's own level (inside ``if``/``try``/``with``/loops too,
    never inside a function or class body) that binds ``name``: defs, classes, assignments,
    imports, deletions."""
    def binds(node) -> bool:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return node.name == name
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For,
                                                      ast.AsyncFor)) else
                   [i.optional_vars for i in node.items if i.optional_vars is not None]
                   if isinstance(node, (ast.With, ast.AsyncWith)) else [])
        return any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t))

    def walk(body):
        for node in body:
            if binds(node):
                yield node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for field in ("body", "orelse", "finalbody"):
                yield from walk(getattr(node, field, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                yield from walk(handler.body)
            for case in getattr(node, "cases", []) or []:
                yield from walk(case.body)
    return list(walk(tree.body))


_MEMOIZERS = ("cache", "lru_cache")  # functools' caches: the function's own value, kept


def _memoizer(decorator: ast.expr, tree: ast.Module) -> bool:
    """Whether ``decorator`` is ``functools.cache`` / ``functools.lru_cache`` (bare or called,
    as ``functools.X`` under ``import functools`` or ``X`` under ``from functools import X``,
    neither rebound at the module's level). Such a cache returns what the function returns for
    the same arguments; in the engine it holds one process's server args, and the gate, which
    asks for many steps' server args in one process, runs the function itself for each: the
    answer a process with those args computes."""
    if isinstance(decorator, ast.Call) and len(decorator.args) <= 2 and all(
            isinstance(a, ast.Constant) for a in decorator.args) and all(
            k.arg in ("maxsize", "typed") and isinstance(k.value, ast.Constant)
            for k in decorator.keywords):
        decorator = decorator.func
    if isinstance(decorator, ast.Attribute) and isinstance(decorator.value, ast.Name):
        module, name = decorator.value.id, decorator.attr
        bound = _module_bindings(tree, module)
        return (name in _MEMOIZERS and len(bound) == 1 and isinstance(bound[0], ast.Import)
                and any(a.name == "functools" and (a.asname or a.name) == module
                        for a in bound[0].names))
    if isinstance(decorator, ast.Name) and decorator.id in _MEMOIZERS:
        bound = _module_bindings(tree, decorator.id)
        return (len(bound) == 1 and isinstance(bound[0], ast.ImportFrom)
                and bound[0].module == "functools" and bound[0].level == 0
                and any(a.name == decorator.id and a.asname is None for a in bound[0].names))
    return False


def _bound_def(tree: ast.Module, name: str, path: Path, before: Optional[int] = None,
               depth: int = 0) -> Optional[ast.FunctionDef]:
    """The ``def`` Python binds to ``name`` when it imports the module (as it stands at line
    ``before``): the last of the module's own top-level bindings of it, where that is a plain
    ``def`` or a rebinding to another name (``name = _other``, followed to ``_other``'s def at
    that point), undecorated or under functools' caches alone (``_memoizer``). ``None`` where
    the module never binds it; a ``ReleaseError`` naming the lines where the gate cannot tell
    which object that is (a binding under ``if``/``try``/``with``, an import, any other
    decorator, any other expression), since it never runs another one."""
    bindings = [b for b in _module_bindings(tree, name) if before is None or b.lineno < before]
    if not bindings:
        return None
    top = {id(node) for node in tree.body}
    nested = [b for b in bindings if id(b) not in top]
    last = bindings[-1]
    lines = ", ".join(str(b.lineno) for b in bindings)
    why = None
    if nested:
        why = (f"binds {name} {len(bindings)} times (lines {lines}), at line {nested[0].lineno} "
               f"under a condition (if/try/with), so which one Python keeps depends on the run")
    elif isinstance(last, ast.FunctionDef):
        wrapping = [d for d in last.decorator_list if not _memoizer(d, tree)]
        if wrapping:
            why = (f"wraps {name} in a decorator ({ast.unparse(wrapping[0])}, line "
                   f"{last.lineno}) that is not one of functools' caches")
        else:
            return last
    elif (isinstance(last, ast.Assign) and len(last.targets) == 1
          and isinstance(last.value, ast.Name) and depth < 8):
        target = _bound_def(tree, last.value.id, path, last.lineno, depth + 1)
        if target is not None:
            return target
        why = f"binds {name} to {last.value.id} (line {last.lineno}), which is no def of the module"
    else:
        why = f"binds {name} {len(bindings)} times (lines {lines}), last by a statement " \
              f"that is no plain def (line {last.lineno}: an import, an expression)"
    raise ReleaseError(f"{path}: the module {why}: the gate cannot tell which object Python runs "
                       f"as {name}(), so it refuses the file rather than run another one (write "
                       f"{name} as one plain def)")


def companion_function(path: Path, name: str, namespace: Dict[str, object]) -> Optional[Callable]:
    """Function ``name`` of the file at ``path`` as Python binds it when it imports the file
    (``_bound_def``: the last top-level ``def``, or the def a rebinding names), compiled alone
    in ``namespace`` (the stand-ins answer its module-level names): annotations dropped,
    defaults that are not literals replaced by ``Unevaluated``, so no code of the file but the
    function's body ever runs; None if the file has none. Where the gate cannot tell which
    object Python binds (a conditional binding, an import, a decorator), a ``ReleaseError``
    names the function and lines: it never runs the wrong one."""
    tree = parse(path)
    found = _bound_def(tree, name, path)
    if found is None:
        return None
    node = copy.deepcopy(found)  # the parsed tree is shared (parse's cache)
    for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
        arg.annotation = None
    node.returns = None
    node.decorator_list = []
    namespace = dict(namespace)
    for defaults in (node.args.defaults, node.args.kw_defaults):
        for i, default in enumerate(defaults):
            if default is not None and not isinstance(default, ast.Constant):
                slot = f"_a2a_gate_default_{len(namespace)}_{i}"
                namespace[slot] = Unevaluated(ast.unparse(default))
                defaults[i] = ast.Name(slot, ast.Load())
    node = ast.fix_missing_locations(node)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[node.name]
