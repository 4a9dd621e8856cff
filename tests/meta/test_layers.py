"""The package's folders are its layers, and imports only run downward (read from the
source, so a new upward import fails here, not in a reader's head)."""
import ast
from pathlib import Path

import pytest

from dispatcher.engines import ENGINES

from .. import SOURCE


LAYERS = {  # module prefix -> layer (lower is more basic)
    "dispatcher.sizing": 0, "dispatcher.mutants": 0,
    "dispatcher.model": 1, "dispatcher.wheels": 1, "dispatcher.companions": 1, "dispatcher.tree": 1,
    "dispatcher.release_code": 1,
    "dispatcher.procs": 0, "dispatcher.engines": 1, "dispatcher.runner": 1,
    "dispatcher.engine_tensors": 1,
    "dispatcher.emulator": 2, "strategies": 2, "dispatcher.flashinfer": 2, "dispatcher.standins": 2,
    "dispatcher.gpu": 3, **{f"dispatcher.{name}": 3 for name in ENGINES},  # an engine's folder
    "dispatcher.cross_round_verdicts": 3,
    "dispatcher.policies": 4, "dispatcher.supervised": 4, "dispatcher.__main__": 4, "dispatcher.verdicts": 4,
    "dispatcher.compat": 4, "dispatcher.canary": 4,
    "dispatcher": 4,  # the package's __init__ re-exports the model's names
    "dispatcher.plugin": 5, "dispatcher.plugin_fixtures": 5, "dispatcher.plugin_exit": 5,
    "dispatcher.plugin_profiles": 5, "dispatcher.bisect": 6, "dispatcher.cli": 6,
}
SUITE_PACKAGE = "dispatcher.suite"  # the tests, installed: the top layer, not checked here
# Imported inside a function on purpose, named here so that nothing else creeps in:
# rank processes resolve the --policy spec they are sent.
ALLOWED_UPWARD = {("dispatcher.gpu.rank_examples", "dispatcher.policies")}


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
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: str(v))
def test_imports_only_run_downward(name, path):
    mine = _layer(name)
    for target in _imports(name, path):
        if not target.startswith(("dispatcher", "strategies")):
            continue
        if (name, target) in ALLOWED_UPWARD or name == "dispatcher":
            continue
        assert _layer(target) <= mine, f"{name} (layer {mine}) imports {target} " \
                                       f"(layer {_layer(target)})"


def _graph():
    """module -> the gate's modules it imports (at the top or inside a function)."""
    names = {name for name, _ in _modules()}
    graph = {}
    for name, path in _modules():
        targets = set()
        for target in _imports(name, path):
            while target and target not in names:  # "from pkg.mod import name" -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + ".") \
                    and not (name == "dispatcher" or target == "dispatcher"):
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_cycle():
    """No module reaches itself through imports, lazy ones inside functions included (a
    package importing its own submodules aside)."""
    import graphlib

    graph = _graph()
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_collecting_the_suite_imports_no_torch():
    """Every xdist worker and every nested pytest run collects the suite: importing torch there
    costs about a second each (a GPU module's exception class imported from a torch module did
    that once). Torch is imported by the tests and tiers that run it, never at collection."""
    import subprocess
    import sys

    from dispatcher.runner import suite_args

    args = suite_args(args=["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"])
    code = ("import sys, pytest\n"
            f"code = pytest.main({args!r})\n"  # the suite as the gate runs it (checkout or wheel)
            "print('A2A-TORCH-AT-COLLECTION', 'torch' in sys.modules, int(code))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=SOURCE, capture_output=True, text=True,
                         timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("A2A-TORCH-AT-COLLECTION")]
    assert line == ["A2A-TORCH-AT-COLLECTION False 0"], out.stdout[-2000:] + out.stderr[-2000:]
