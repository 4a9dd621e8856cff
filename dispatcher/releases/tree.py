"""The tree under test: one engine's release, checkout, wheel or lone file, and the engine's own
code that runs beside its dispatcher file.

``EngineCode`` is what an engine's tree is made of (its package on the index, the pieces of its
own code the gate runs, its pinned releases); each engine's ``fetch`` module holds one
(``CODE``). ``CODE.tree(target)`` is the whole path from a ``--policy ENGINE:TARGET`` to the
code the gate runs, in one place:

1. **find** the dispatcher file (``wheels.Package.main_file``: installed, a release, a wheel, a
   checkout or the file itself) and the tree it sits in;
2. **verify** it: a pinned release is its verified cache folder, checked against its pins;
3. **resolve** the engine's own code by following the tree's imports
   (``companions.resolve``: a helper upstream moved is found where the importers lead; a lone
   file takes the code of the release it is identical to, else the newest pinned release's,
   and says so);
4. **compile** a piece of it on demand (``Tree.function``: the object the module binds to
   that name, under the stand-ins the caller gives).

Nothing of the tree is run by 1-3: a report header reads them (``origin``) before any code is
loaded. The engine's loader executes the dispatcher file itself (its sandbox differs per
engine) and asks the tree for everything else.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from .companions import Companions, Needed, companion_function, resolve
from .wheels import Package, sha256

__all__ = ["EngineCode", "Tree"]


@dataclass(frozen=True)
class EngineCode:
    """What one engine's tree is made of."""

    package: Package
    needed: Tuple[Needed, ...]  # its own code the gate runs beside the dispatcher file
    releases: Tuple[str, ...]  # the pinned releases, oldest first
    name: str  # for messages: "SGLang", "vLLM"
    version_files: Tuple[str, ...] = ()  # where a tree says which release it is

    def main_file(self, target: str) -> Tuple[Path, str]:
        """``(file, label)`` for ``ENGINE:TARGET``, found and verified, nothing of it run."""
        return self.package.main_file(target)

    def tree(self, target: str) -> "Tree":
        """The tree ``ENGINE:TARGET`` names (steps 1-3 of the module's docstring)."""
        path, label = self.main_file(target)
        return self.at(path, label)

    def at(self, path, label: Optional[str] = None) -> "Tree":
        """The tree of the dispatcher file ``path`` (a lone file: with its release's code)."""
        path = Path(path).resolve()
        companions = resolve(self.package, path, self.needed, self.releases, self.name,
                             release=self.package.release_of(path),
                             version_files=self.version_files)
        root = self.package.root_of(path)
        if root is None:  # a lone file: the release its companions come from
            source = next((p for _, p in companions.sources if p is not None), None)
            root = self.package.root_of(source) if source is not None else None
        return Tree(self, path, label or str(path), sha256(path), companions, root)


@dataclass(frozen=True)
class Tree:
    """One dispatcher file and the engine code the gate runs beside it."""

    code: EngineCode
    main: Path  # the dispatcher file under test
    label: str  # what the spec named it ("0.5.23", a path, "installed")
    digest: str  # sha256 of ``main``
    companions: Companions  # where each piece of the engine's own code comes from
    root: Optional[Path]  # the tree whose modules run beside ``main`` (a lone file's release's)

    @property
    def origin(self) -> str:
        """One line for the report header: where the engine's own code comes from."""
        return self.companions.origin

    @property
    def key(self) -> tuple:
        """What the behaviour of the file and its code rests on (content, not paths)."""
        return (self.digest, self.companions.key, self.label)

    def source(self, key: str) -> Optional[Path]:
        """The file that holds the piece ``key`` (``Needed.key``), or None where none does."""
        return self.companions.source(key)

    def function(self, name: str, namespace: Dict[str, object], key: Optional[str] = None
                 ) -> Optional[Callable]:
        """The function ``name`` from the file of piece ``key`` (default: ``name``), as that
        module binds it, compiled in ``namespace`` (the stand-ins answer its module-level
        names); None where the tree has no such piece."""
        path = self.source(key or name)
        return None if path is None else companion_function(path, name, namespace)
