"""An engine's own functions and methods, compiled alone from its files and run on strict
stand-ins: every name they read is the engine's own code (resolved through the file's imports,
as Python would) or a stand-in the gate declares, and anything else stops the run with the
name and the function that read it.

``dispatcher.releases.companions.companion_function`` runs one function whose free names the stand-ins
answer loosely (its whole namespace is the stand-in table). The forward-batch padding and the
CUDA-graph runner's bucket choice read deeper: module helpers, enum classes, other modules'
functions, the object's own attributes. ``FileNamespace`` is a module's namespace built on
demand: a name is answered by

1. the builtins;
2. the gate's stand-ins for process state (``standins``: the parallel state, the server's
   config, recorders that stop the run where it publishes its result);
3. a top-level function or class the file itself defines, compiled alone (decorators and
   annotations dropped, imports inside it resolved the same way);
4. the file's ``from M import name``: the same lookup in module ``M``'s file, when the tree
   holds it;

and a name none of them answers is ``Unmodelled`` (a ``NameError``), as an attribute a
``Strict`` object was not given is (an ``AttributeError``): a release that reads something
new is noticed, never answered by a default.
"""
from __future__ import annotations

import ast
import builtins
import copy
import importlib
import sys
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

from ..releases.companions import parse

__all__ = ["Unmodelled", "UnmodelledAttribute", "Absent", "Strict", "FileNamespace", "find_def",
           "compile_def", "IMPORT_HOOK"]

IMPORT_HOOK = "__a2a_gate_import__"


class Unmodelled(NameError):
    """A name the engine's code read that neither its files nor the gate's stand-ins answer."""


class UnmodelledAttribute(AttributeError):
    """An attribute of a stand-in object the gate did not give it."""


class Absent:
    """What an import of a module the gate does not keep binds: importing it succeeds (as in
    the engine), and any use of it (a call, an attribute, a truth value, ...) raises
    ``Unmodelled`` with its name."""

    def __init__(self, why: str):
        object.__setattr__(self, "_why", why)

    def _stop(self, *a, **k):
        raise Unmodelled(self._why)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._stop()

    __call__ = __bool__ = __iter__ = __len__ = __getitem__ = __eq__ = __lt__ = __int__ = _stop
    __hash__ = object.__hash__

    def __repr__(self):
        return f"<not modelled: {self._why}>"


class Strict:
    """A stand-in object with exactly the fields given (``what`` names it in errors); reading
    any other field raises ``UnmodelledAttribute`` (so ``getattr(x, name, default)`` still
    answers the engine's own default). Fields may be written, as the engine's code does."""

    def __init__(self, what: str, **fields):
        object.__setattr__(self, "_what", what)
        self.__dict__.update(fields)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnmodelledAttribute(f"{self._what}.{name}: the engine's code reads it and the "
                                  f"gate does not model it")

    def __repr__(self):
        fields = {k: v for k, v in self.__dict__.items() if k != "_what"}
        return f"<{self._what} {fields}>"


def find_def(path: Path, name: str, cls: Optional[str] = None) -> Optional[ast.AST]:
    """The top-level ``def``/``class`` ``name`` of ``path`` (or method ``name`` of its class
    ``cls``), or None."""
    body = parse(path).body
    if cls is not None:
        owner = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if owner is None:
            return None
        body = owner.body
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and n.name == name), None)


class _Alone(ast.NodeTransformer):
    """Decorators (but ``staticmethod``/``classmethod``, kept as markers) and annotations
    dropped; ``import`` statements inside the code become lookups in the namespace."""

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.returns = None
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            arg.annotation = None
        for arg in (node.args.vararg, node.args.kwarg):
            if arg is not None:
                arg.annotation = None
        node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name)
                               and d.id in ("staticmethod", "classmethod")]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.generic_visit(node)
        node.decorator_list = []
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return ast.Pass()
        return ast.Assign([node.target], node.value)

    def visit_ImportFrom(self, node):
        module = "." * node.level + (node.module or "")
        return [ast.Assign([ast.Name(a.asname or a.name, ast.Store())],
                           ast.Call(ast.Name(IMPORT_HOOK, ast.Load()),
                                    [ast.Constant(module), ast.Constant(a.name)], []))
                for a in node.names]

    def visit_Import(self, node):
        return [ast.Assign([ast.Name(a.asname or a.name.split(".")[0], ast.Store())],
                           ast.Call(ast.Name(IMPORT_HOOK, ast.Load()),
                                    [ast.Constant(a.name), ast.Constant("")], []))
                for a in node.names]


def compile_def(node: ast.AST, path: Path, namespace: dict, store_as: Optional[str] = None):
    """``node`` (a ``def`` or ``class`` of ``path``) compiled alone with ``namespace`` as its
    globals: nothing of the file runs but this definition. ``store_as``: a name it is
    compiled under and taken back from the namespace by (a method, so it shadows nothing)."""
    node = _Alone().visit(copy.deepcopy(node))
    if store_as:
        node.name = store_as
    node = ast.fix_missing_locations(node)
    if isinstance(node, ast.ClassDef):  # a class body looks globals up without __missing__:
        for name in _class_body_reads(node):  # answer its names first
            try:
                namespace[name]
            except NameError:
                pass  # read when the body runs: Python's own NameError names it
    # one mapping for globals and locals: a class statement's bases and body are looked up
    # through it (and so through ``FileNamespace.__missing__``)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace.pop(store_as) if store_as else namespace[node.name]


def _class_body_reads(node: ast.ClassDef) -> set:
    found, todo = set(), list(node.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            found.add(n.id)
        todo.extend(ast.iter_child_nodes(n))
    return found


class FileNamespace(dict):
    """The namespace of one file of an engine tree, answered on demand (module docstring)."""

    def __init__(self, root: Path, path: Path, standins: Mapping[str, object],
                 cache: Optional[Dict[Path, "FileNamespace"]] = None):
        super().__init__()
        self.root, self.path, self.standins = Path(root), Path(path), standins
        self.cache = {} if cache is None else cache
        self.cache[self.path] = self
        self._imported: Dict[tuple, object] = {}
        self[IMPORT_HOOK] = self._import
        self["__name__"] = self._module_name()
        self.imports = self._imports()

    def _module_name(self) -> str:
        try:
            rel = self.path.relative_to(self.root).with_suffix("")
        except ValueError:
            return self.path.stem
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        return ".".join(parts)

    def _imports(self) -> Dict[str, tuple]:
        found = {}
        for node in parse(self.path).body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    found[a.asname or a.name] = ("." * node.level + (node.module or ""), a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found[a.asname or a.name.split(".")[0]] = (a.name, "")
        return found

    def module_file(self, module: str) -> Optional[Path]:
        if module.startswith("."):
            level = len(module) - len(module.lstrip("."))
            base = self._module_name().split(".")[:-level] if level else []
            module = ".".join(base + [module.lstrip(".")] if module.lstrip(".") else base)
        rel = Path(*module.split("."))
        for candidate in (self.root / rel.with_suffix(".py"), self.root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def namespace_of(self, path: Path) -> "FileNamespace":
        return self.cache.get(path) or FileNamespace(self.root, path, self.standins, self.cache)

    def _import(self, module: str, name: str):
        key = (module, name)  # an import inside a function runs on every call: answer it once
        if key not in self._imported:
            self._imported[key] = self._resolve_import(module, name)
        return self._imported[key]

    def _resolve_import(self, module: str, name: str):
        if not name:  # ``import M``: the standard library, or a stand-in module object
            if module in self.standins:
                return self.standins[module]
            if module.split(".")[0] in sys.stdlib_module_names:
                return importlib.import_module(module.split(".")[0])
            raise Unmodelled(f"import {module} in {self.path.name}: the gate does not model "
                             f"that module")
        if name in self.standins:
            return self.standins[name]
        if module.split(".")[0] in sys.stdlib_module_names:  # enum, typing, bisect, ...
            return getattr(importlib.import_module(module), name)
        path = self.module_file(module)
        if path is not None:
            return self.namespace_of(path)._defined(name, f"{module}.{name}")
        # the import itself succeeds, as it would in the engine; any use of it stops the run
        return Absent(f"{name} (from {module}, imported in {self.path.name}): neither a file "
                      f"the gate keeps nor a stand-in it declares")

    def _defined(self, name: str, shown: str):
        if name in self:
            return self[name]
        node = find_def(self.path, name)
        if node is not None:
            self[name] = compile_def(node, self.path, self)
            return self[name]
        if name in self.imports:
            module, original = self.imports[name]
            self[name] = self._import(module, original)
            return self[name]
        if name in self.standins:
            return self.standins[name]
        raise Unmodelled(f"{shown} (read in {self.path.name}): not defined there, and no "
                         f"stand-in of the gate answers it")

    def __missing__(self, name):
        if name in self.standins:
            value = self.standins[name]
        elif hasattr(builtins, name):
            value = getattr(builtins, name)
        else:
            return self._defined(name, name)
        self[name] = value  # answered once: the next lookup is a plain dict hit
        return value

    def method(self, cls: str, name: str) -> Optional[Callable]:
        """Method ``name`` of class ``cls`` of this file, compiled alone as a plain function
        (pass its ``self`` explicitly); None if the class has none."""
        node = find_def(self.path, name, cls)
        if node is None:
            return None
        node = copy.deepcopy(node)
        node.decorator_list = []
        return compile_def(node, self.path, self, f"_a2a_gate_{cls}_{name}")
