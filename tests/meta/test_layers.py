"""The package's folders are its layers, and imports only run downward (read from the
source, so a new upward import fails here, not in a reader's head)."""
import ast
from pathlib import Path

import pytest

from dispatcher.engines import ENGINES

from .. import SOURCE


LAYERS = {  # module prefix -> layer (lower is more basic)
    "dispatcher.sizing": 0, "dispatcher.mutants": 0, "dispatcher.sandbox": 0,
    "dispatcher.sandbox.procs": 0,
    "dispatcher.model": 1, "dispatcher.engines": 1,
    "dispatcher.releases": 1, "dispatcher.sandbox.release_code": 1,
    "dispatcher.sandbox.engine_tensors": 1, "dispatcher.sandbox.wire": 1,
    "dispatcher.emulator": 2, "strategies": 2, "dispatcher.flashinfer": 2,
    "dispatcher.sandbox.standins": 2,
    "dispatcher.gpu": 3, **{f"dispatcher.{name}": 3 for name in ENGINES},  # an engine's folder
    "dispatcher.cross_round_verdicts": 3,
    "dispatcher.policies": 4, "dispatcher.supervised": 4, "dispatcher.__main__": 4,
    # the commands users run: the replay's process, the tables, the canary and the suite's
    # settings; the CLI and bisect on top
    "dispatcher.commands": 4,
    "dispatcher": 4,  # the package's __init__ re-exports the model's names
    "dispatcher.plugin": 5,  # the pytest plugin: its hooks, fixtures, profiles, exit status
    "dispatcher.commands.bisect": 6, "dispatcher.commands.cli": 6,
}
# Every importlib door of the gate's modules, (module, function) -> the gate's modules it opens
# (engine code the user names, or the standard library, open none of the gate's): a new door
# fails test_every_importlib_door_is_declared until it is written here.
DOORS = {
    ("dispatcher.engines", "module"): tuple(f"dispatcher.{e}.{part}" for e in ENGINES
                                            for part in ("fetch", "loader", "verdicts")),
    ("dispatcher.gpu.ops", "ops_of"): ("dispatcher.gpu.mnnvl", "dispatcher.gpu.one_sided"),
    ("dispatcher.policies", "load_policy"): (),  # the user's own rule module
    ("dispatcher.sandbox.release_code", "_resolve_import"): (),  # the standard library, for engine code
    ("dispatcher.sandbox.zygote.server", "_sub_main"): (),  # its preload: torch (zygote.WITH_TORCH)
}
SUITE_PACKAGE = "dispatcher.suite"  # the tests, installed: the top layer, not checked here
# Imported inside a function on purpose, named here so that nothing else creeps in.
ALLOWED_UPWARD = {  # the engine registry's door: a record names the folder that implements it,
                  # opened on first use
                  *((("dispatcher.engines", t) for t in DOORS["dispatcher.engines", "module"]))}


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def _modules():
    for folder in ("dispatcher", "strategies"):
        for path in sorted((SOURCE / folder).rglob("*.py")):
            parts = path.relative_to(SOURCE).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name == SUITE_PACKAGE or name.startswith(SUITE_PACKAGE + "."):
                continue
            yield name, path


def _imports(name: str, path: Path):
    """Every module ``name`` may import: ``import X``; ``from X import a, b`` as ``X`` and each
    of ``X.a``, ``X.b`` (a name that is a module is an edge to that module: ``from . import
    mnnvl``); and the ``importlib`` doors of ``DOORS``, each target it opens."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
    for function in _doors(tree):
        yield from DOORS.get((name, function), ())


def _doors(tree: ast.Module):
    """The functions of a module that call ``importlib.import_module`` (or ``__import__``)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and (
                        (isinstance(call.func, ast.Attribute) and call.func.attr == "import_module")
                        or (isinstance(call.func, ast.Name) and call.func.id in
                            ("import_module", "__import__"))):
                    yield fn.name
                    break


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: str(v))
def test_imports_only_run_downward(name, path):
    mine = _layer(name)
    names = {n for n, _ in _modules()}
    for target in set(_resolved(_imports(name, path), names)):
        if (name, target) in ALLOWED_UPWARD or name == "dispatcher":
            continue
        assert _layer(target) <= mine, f"{name} (layer {mine}) imports {target} " \
                                       f"(layer {_layer(target)})"


def _resolved(targets, names):
    """Each import target as the gate's module it reaches ("from pkg.mod import name" ->
    pkg.mod), the others (torch, the standard library) dropped."""
    for target in targets:
        while target and target not in names:
            target = target.rpartition(".")[0]
        if target:
            yield target


def _graph():
    """module -> the gate's modules it imports (at the top or inside a function, through
    importlib doors too); a package's edge to its own ``__init__`` aside (Python imports the
    parent package first anyway)."""
    names = {name for name, _ in _modules()}
    graph = {}
    for name, path in _modules():
        graph[name] = {t for t in _resolved(_imports(name, path), names)
                       if t != name and not name.startswith(t + ".")
                       and not (name == "dispatcher" or t == "dispatcher")}
    return graph


def _folder(name: str) -> str:
    """The folder a module sits in: ``dispatcher.gpu``, ``strategies``; a module at the root
    of ``dispatcher/`` is its own."""
    parts = name.split(".")
    if parts[0] != "dispatcher" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def test_every_importlib_door_is_declared():
    """A module opened by name (``importlib.import_module``) is an edge no import statement
    shows: each door is declared in DOORS with what it opens, so the layer and cycle checks
    see it."""
    found = {(name, fn) for name, path in _modules() for fn in _doors(ast.parse(path.read_text()))}
    assert found == set(DOORS), (f"undeclared doors: {sorted(found - set(DOORS))}; declared "
                                 f"but gone: {sorted(set(DOORS) - found)}")
    names = {n for n, _ in _modules()}
    for door, targets in DOORS.items():
        assert set(targets) <= names, f"{door} opens modules that do not exist: " \
                                      f"{sorted(set(targets) - names)}"


def test_no_folder_loop():
    """The folders read top-down: no folder imports one that imports it back (through any of
    their modules, lazy imports and doors included), so a same-layer pair is one-way too."""
    import graphlib

    folders = {}
    for name, targets in _graph().items():
        for t in targets:
            if _folder(t) != _folder(name):
                folders.setdefault(_folder(name), set()).add(_folder(t))
    try:
        tuple(graphlib.TopologicalSorter(folders).static_order())
    except graphlib.CycleError as exc:
        loop = exc.args[1][::-1]  # graphlib names each node's predecessor next: importer first
        graph = _graph()
        why = "; ".join(f"{a} -> {b} through " + ", ".join(sorted(
            f"{m} -> {t}" for m, ts in graph.items() if _folder(m) == a
            for t in ts if _folder(t) == b)) for a, b in zip(loop, loop[1:]))
        pytest.fail(f"folder loop: {' -> '.join(loop)}: {why}")


def test_no_import_cycle():
    """No module reaches itself through imports, lazy ones inside functions included (a
    package importing its own submodules aside)."""
    import graphlib

    graph = _graph()
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1][::-1])}")  # importer first


def test_collecting_the_suite_imports_no_torch():
    """Every xdist worker and every nested pytest run collects the suite: importing torch there
    costs about a second each (a GPU module's exception class imported from a torch module did
    that once). Torch is imported by the tests and tiers that run it, never at collection."""
    import subprocess
    import sys

    from dispatcher.commands.runner import suite_args

    args = suite_args(args=["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"])
    code = ("import sys, pytest\n"
            f"code = pytest.main({args!r})\n"  # the suite as the gate runs it (checkout or wheel)
            "print('A2A-TORCH-AT-COLLECTION', 'torch' in sys.modules, int(code))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=SOURCE, capture_output=True, text=True,
                         timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("A2A-TORCH-AT-COLLECTION")]
    assert line == ["A2A-TORCH-AT-COLLECTION False 0"], out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize("importer, imported", [
    ("dispatcher.model.generations", "dispatcher.model.mnnvl"),  # from . import mnnvl
    ("dispatcher.model.sequences", "dispatcher.model.properties"),
    ("dispatcher.gpu.single", "dispatcher.gpu.torch_ops"),  # from . import torch_ops
    ("dispatcher.plugin", "dispatcher.model.properties"),  # from dispatcher.model import ...
    ("dispatcher.engines", "dispatcher.sglang.loader"),  # importlib, through DOORS
    ("dispatcher.gpu.ops", "dispatcher.gpu.one_sided"),
], ids=lambda v: v.rpartition(".")[2])
def test_the_graph_sees_every_kind_of_import(importer, imported):
    """The edges a reader sees that the layer checks once missed: ``from . import mod``,
    ``from pkg import mod`` and the importlib doors."""
    assert imported in _graph()[importer]


def test_a_folder_loop_of_one_layer_is_found(monkeypatch):
    """Two folders of one layer importing each other (as gpu/ and sglang/ did through
    gpu/emulated.py) fail the folder check, although no module cycle exists."""
    loop = {"dispatcher.gpu.rank_examples": {"dispatcher.sglang.loader"},
            "dispatcher.sglang.loader": {"dispatcher.sglang.standins"},
            "dispatcher.sglang.standins": {"dispatcher.gpu.emulated"},
            "dispatcher.gpu.emulated": set()}
    monkeypatch.setattr(__import__(__name__, fromlist=["_graph"]), "_graph", lambda: loop)
    with pytest.raises(pytest.fail.Exception, match="folder loop: dispatcher.gpu -> "
                       "dispatcher.sglang -> dispatcher.gpu.*sglang.standins -> "
                       "dispatcher.gpu.emulated"):
        test_no_folder_loop()


MAX_ROOT_MODULES = 8  # users' face (sizing.py, policies.py ...); the rest lives in the layers' folders
MAX_LINES = 450


def test_the_root_is_small_and_no_module_is_long():
    root = sorted(p.name for p in (SOURCE / "dispatcher").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root of dispatcher/: {root}"
    # tests/ too: the wheel ships it inside dispatcher/ (dispatcher/suite/), where the same
    # limit holds, so a checkout must not pass what the installed suite fails
    long = {str(p.relative_to(SOURCE)): n for folder in ("dispatcher", "strategies", "tests")
            for p in (SOURCE / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do): {long}"

