"""The files beside an engine's dispatcher file whose functions decide what the dispatcher sees,
and where each one the gate runs came from.

An engine policy runs one file (SGLang's ``flashinfer.py``, vLLM's prepare/finalize) and a few
functions of the files beside it (SGLang's scheduler gather, server-arg checks and cap; vLLM's
SP split). ``resolve`` finds them:

- **a tree** (a checkout, a wheel, a cached release): each function from the tree itself. One
  the tree's release should have (``Needed``: the function, its homes, the first and last
  pinned release that has it, checked against every pinned release by tests/meta) but that is
  missing or renamed is a ``ReleaseError`` naming the path and function: the gate never lets
  a default answer silently where the engine's own code was moved. ``newest_ok`` (the
  ``--newest-companions`` option, carried to workers and ranks by ``NEWEST_ENV``) lets the
  newest pinned release's function stand in instead, and says so.
- **a lone file** byte-identical to a pinned release's dispatcher file: that release's own
  files from the verified cache ("identical to SGLang 0.5.19's file; its companions from the
  release").
- **a lone file** matching no release: the newest pinned release's files stand in, and every
  header and message says so.

Files are parsed from bytes, so a UTF-8 BOM or a coding declaration reads as Python does.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from .bindings import (Unevaluated, _module_bindings, companion_function, defines,  # noqa: F401
                       parse)
from .wheels import Package, ReleaseError, sha256

__all__ = ["Needed", "Companions", "resolve", "NEWEST_ENV", "newest_allowed", "read_version",
           "defines", "parse", "companion_function", "module_name", "absolute_module",
           "module_file", "defining_file"]

NEWEST_ENV = "A2A_GATE_NEWEST_COMPANIONS"


def newest_allowed() -> bool:
    """Whether the session asked for the newest release's functions to stand in for ones
    missing from a tree (``--newest-companions``)."""
    return os.environ.get(NEWEST_ENV, "") == "1"


def _version_key(version: str):
    from packaging.version import Version

    return Version(version)


@dataclass(frozen=True)
class Needed:
    """One piece of an engine's own code the gate runs from beside the dispatcher file."""

    key: str  # the function's name, or a name for a check that is no function
    files: Tuple[str, ...]  # its homes in the tree, newest first
    since: str  # the first pinned release that has it
    until: Optional[str] = None  # the last pinned release that has it (None: still there)
    decides: str = ""  # what it decides, for messages
    finder: Optional[Callable[[Path], bool]] = None  # for a check that is no function
    # the files of the tree that import it (the dispatcher file, the scheduler, ...): where
    # their imports lead is where the engine takes it from, whatever its homes say
    imported_by: Tuple[str, ...] = ()

    def found_in(self, path: Path) -> bool:
        return self.finder(path) if self.finder else defines(path, self.key)

    def expected_in(self, version: str) -> bool:
        v = _version_key(version)
        return _version_key(self.since) <= v and (self.until is None
                                                 or v <= _version_key(self.until))

    @property
    def shown(self) -> str:
        return f"{self.key}()" if self.finder is None else self.key


@dataclass(frozen=True)
class Companions:
    """Where each ``Needed`` of one dispatcher file comes from."""

    sources: Tuple[Tuple[str, Optional[Path]], ...]  # Needed.key -> the file that holds it
    origin: str  # one line for the report header and messages
    standin: bool  # True where another release's files answer for this file's own
    key: Tuple[Tuple[str, str], ...]  # (key, sha256 of its file): what the behaviour rests on
    tag: str = ""  # where stand-ins answer: "SGLang 0.5.23's, standing in", for each source line
    replay_flag: str = ""  # " --newest-companions" where the replay line needs it
    # Needed.key -> the modules the tree's files import it from (the stand-in that runs the
    # piece is put there too, so a file importing it from a new module reaches it)
    imports: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()

    def source(self, key: str) -> Optional[Path]:
        return dict(self.sources).get(key)


def read_version(root: Path, version_files: Sequence[str]) -> Optional[str]:
    """The release a tree says it is (``__version__ = "..."`` in its version file), or None."""
    for rel in version_files:
        path = root / rel
        try:
            text = path.read_bytes()[:65536].decode("utf-8", "replace")
        except OSError:
            continue
        found = re.search(r"""^\s*__version__\s*(?::\s*str\s*)?=\s*(?:\w+\s*=\s*)?["']([^"']+)["']""", text, re.M)
        if found:
            try:
                _version_key(found.group(1))
            except ValueError:
                return None
            return found.group(1)
    return None


def _find(needed: Needed, root: Path) -> Optional[Path]:
    for rel in needed.files:
        path = root / rel
        if path.is_file() and needed.found_in(path):
            return path
    return None


def _moved(needed: Needed, root: Path, top: str) -> Optional[Path]:
    """Where a function piece missing from its known homes now lives in the tree: the one
    module under ``root/top`` that binds it at its own level (a helper upstream moved to a
    new module is found there). ``None`` where no module does; a ``ReleaseError`` naming them
    where several do (the gate cannot tell which one the engine imports)."""
    if needed.finder is not None or not (root / top).is_dir():
        return None
    pattern = re.compile(rf"^(?:def\s+{re.escape(needed.key)}\s*\(|{re.escape(needed.key)}\s*=)",
                         re.M)
    found = []
    for path in sorted((root / top).rglob("*.py")):
        try:
            text = path.read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        if pattern.search(text) and needed.found_in(path):
            found.append(path)
    if len(found) > 1:
        raise ReleaseError(f"{root}: {needed.shown} is missing from its known homes "
                           f"({', '.join(needed.files)}) and {len(found)} modules define it ("
                           + ", ".join(str(p.relative_to(root)) for p in found[:5])
                           + "): the gate cannot tell which one the engine imports")
    return found[0] if found else None


# --- following the tree's imports, as Python would -------------------------------------------
def module_name(root: Path, path: Path) -> str:
    """The dotted name Python imports ``path`` as, in the tree at ``root``."""
    try:
        rel = Path(path).relative_to(root).with_suffix("")
    except ValueError:
        return Path(path).stem
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def absolute_module(root: Path, importer: Path, module: str, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if not level:
        return module
    own = module_name(root, importer).split(".")
    package = own if Path(importer).name == "__init__.py" else own[:-1]
    base = package[:len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + ([module] if module else []))


def module_file(root: Path, module: str) -> Optional[Path]:
    """The file of module ``module`` in the tree at ``root`` (``a/b.py`` or ``a/b/__init__.py``),
    or None where the tree does not hold it."""
    rel = Path(*module.split("."))
    for candidate in (Path(root) / rel.with_suffix(".py"), Path(root) / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(tree: ast.Module, name: str):
    """``(module, level)`` of every ``from M import name`` in the file, at its own level and
    inside functions alike (an engine imports a helper where it calls it), in file order."""
    return [(node.module or "", node.level) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)]


def _exported(tree: ast.Module, name: str) -> bool:
    """Whether ``from <this module> import *`` binds ``name``: it is in a literal ``__all__``,
    or, with none, public."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                  for t in node.targets)):
            try:
                return name in ast.literal_eval(node.value)
            except ValueError:
                return not name.startswith("_")
    return not name.startswith("_")


def defining_file(root: Path, path: Path, name: str, depth: int = 0) -> Optional[Path]:
    """The file whose own binding of ``name`` (a def, an assignment: not an import) Python
    reaches when it imports ``name`` from the module at ``path``: ``path`` itself, or where its
    ``from M import name`` (its last top-level binding of the name) or a star import leads, in
    the tree. None where the tree does not hold that file or binds no such name."""
    if depth > 16:  # an import loop: Python would fail to import it too
        return None
    tree = parse(path)
    bindings = [b for b in _module_bindings(tree, name) if b in tree.body]
    if bindings:
        last = bindings[-1]
        if not isinstance(last, ast.ImportFrom):
            return Path(path)
        target = module_file(root, absolute_module(root, path, last.module or "", last.level))
        original = next(a.name for a in last.names if (a.asname or a.name) == name)
        return None if target is None else defining_file(root, target, original, depth + 1)
    for node in reversed(tree.body):  # the last star import that binds it wins
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            target = module_file(root, absolute_module(root, path, node.module or "", node.level))
            if target is not None and _exported(parse(target), name):
                found = defining_file(root, target, name, depth + 1)
                if found is not None:
                    return found
    return None


@dataclass(frozen=True)
class _Imported:
    file: Path  # where the tree's imports of the piece lead
    modules: Tuple[str, ...]  # the modules its files import it from
    importers: Tuple[str, ...]  # those files, relative to the tree


def _imported(needed: Needed, root: Path) -> Optional[_Imported]:
    """Where the files that import ``needed`` (``Needed.imported_by``) take it from in the tree
    at ``root``: None where none of them imports it from a module the tree holds. Two files
    whose imports lead to two different definitions are a ``ReleaseError`` naming both (the
    engine would run two functions where the gate runs one)."""
    leads: Dict[Path, list] = {}
    modules = []
    for rel in needed.imported_by:
        importer = Path(root) / rel
        if not importer.is_file():
            continue
        for module, level in _imports_of(parse(importer), needed.key):
            absolute = absolute_module(root, importer, module, level)
            target = module_file(root, absolute)
            found = None if target is None else defining_file(root, target, needed.key)
            if found is not None:
                leads.setdefault(found, []).append(rel)
                modules.append(absolute)
    if not leads:
        return None
    if len(leads) > 1:
        shown = "; ".join(f"{', '.join(sorted(set(by)))} import it from "
                          f"{Path(f).relative_to(root)}" for f, by in leads.items())
        raise ReleaseError(f"{root}: {needed.shown} is defined twice and the tree's files import "
                           f"both ({shown}): the engine runs two functions where the gate runs "
                           f"one")
    (found, by), = leads.items()
    return _Imported(found, tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(by)))


def _digests(sources: Dict[str, Optional[Path]]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, sha256(p)) for k, p in sources.items() if p is not None))


def resolve(package: Package, main: Path, needed: Sequence[Needed], pinned: Sequence[str],
            engine: str, release: Optional[str] = None, newest_ok: Optional[bool] = None,
            version_files: Sequence[str] = ()) -> Companions:
    """The ``Companions`` of dispatcher file ``main``. ``release``: the pinned release it is
    known to be (a cached release: its tree is the release, nothing to check)."""
    newest_ok = newest_allowed() if newest_ok is None else newest_ok
    root = package.root_of(main)
    if root is None:
        return _lone(package, main, needed, pinned, engine)
    sources, imports, moved = _located(needed, root)
    if release is not None:
        return Companions(tuple(sources.items()), f"from {engine} {release}'s own files", False,
                          _digests(sources), imports=imports)
    version = read_version(root, version_files) or package.wheel_version(root)
    held_to = version or pinned[-1]
    for n in needed:
        if sources[n.key] is None and n.expected_in(held_to):
            sources[n.key] = _moved(n, root, package.module or package.name)
            if sources[n.key] is not None:
                moved.append(f"{n.shown} from {sources[n.key].relative_to(root)}: moved there "
                             f"from its known home")
    missing = [n for n in needed if sources[n.key] is None and n.expected_in(held_to)]
    if not missing:
        return Companions(tuple(sources.items()), f"from the tree {root}"
                          + (f" ({'; '.join(moved)})" if moved else ""), False,
                          _digests(sources), imports=imports)
    said = (f"the tree says it is {version} ({_rel_version(root, version_files)})" if version
            else f"the tree has no version file, so it is held to the newest pinned release "
                 f"{pinned[-1]}")
    lines = [f"{n.shown} (looked in {', '.join(n.files)}; {engine} has it there from "
             f"{n.since}{'' if n.until is None else ' to ' + n.until}"
             f"{': it decides ' + n.decides if n.decides else ''})" for n in missing]
    if not newest_ok:
        raise ReleaseError(
            f"{engine}:{root}: the tree lacks {len(missing)} piece(s) of {engine}'s own code the "
            f"gate runs beside the dispatcher file, and {said}: " + "; ".join(lines)
            + f". A function that moved is found anywhere in the tree; one that was renamed "
              f"needs the gate to learn its new name; to let "
              f"{engine} {pinned[-1]}'s own code stand in for them, pass --newest-companions")
    stand_in = package.root_of(package.fetch_release(pinned[-1]))
    for n in missing:
        sources[n.key] = _find(n, stand_in)
    names = ", ".join(n.shown for n in missing)
    return Companions(tuple(sources.items()),
                      f"from the tree {root}, except {names}: missing there, {engine} "
                      f"{pinned[-1]}'s stand in (--newest-companions)", True, _digests(sources),
                      f"{engine} {pinned[-1]}'s, standing in", " --newest-companions",
                      imports=imports)


def _located(needed: Sequence[Needed], root: Path):
    """Each piece's file in the tree: where the tree's own imports of it lead (``_imported``),
    else its known homes; with the modules it is imported from, and a note for each piece the
    imports found away from its homes."""
    sources, imports, notes = {}, [], []
    for n in needed:
        via = _imported(n, root) if n.imported_by else None
        sources[n.key] = via.file if via is not None else _find(n, root)
        if via is not None:
            imports.append((n.key, via.modules))
            rel = via.file.relative_to(root).as_posix()
            if rel not in n.files:
                notes.append(f"{n.shown} from {rel}, where {', '.join(via.importers)} "
                             f"import{'s' if len(via.importers) == 1 else ''} it from")
    return sources, tuple(imports), notes


def _rel_version(root: Path, version_files: Sequence[str]) -> str:
    return next((rel for rel in version_files if (root / rel).is_file()), "")


def identical_release(package: Package, main: Path, pinned: Sequence[str]) -> Optional[str]:
    """The newest pinned release one of whose kept files of ``main``'s name (a backend's) is
    byte-identical to the lone file ``main``, else None (read from the pins: nothing fetched)."""
    digest = sha256(main)
    pins = package.pins
    same = [v for v in pinned
            if any(d == digest and Path(rel).name == main.name
                   for rel, d in pins.get(v, {}).get("files", {}).items())]
    return same[-1] if same else None


def _lone(package: Package, main: Path, needed: Sequence[Needed], pinned: Sequence[str],
          engine: str) -> Companions:
    same = identical_release(package, main, pinned)
    release = same or pinned[-1]
    try:
        root = package.root_of(package.fetch_release(release))
    except ReleaseError as exc:
        raise ReleaseError(f"{engine}:{main} is a lone file: the gate runs {engine} {release}'s "
                           f"companion files beside it, and they cannot be had: {exc}") from None
    sources, imports, _ = _located(needed, root)
    if same:
        origin = f"identical to {engine} {release}'s file; its companions from the release"
    else:
        origin = (f"a lone file matching no pinned release: {engine} {release}'s companion "
                  f"files stand in for its own")
    return Companions(tuple(sources.items()), origin, not same, _digests(sources),
                      "" if same else f"{engine} {release}'s, standing in", imports=imports)
