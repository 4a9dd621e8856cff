"""A world carries its FlashInfer generation, and everything that runs it takes that one: the
session's generation (``generations.active()``) is read only where a default is chosen, and an
engine's step runs the world's generation whatever the session's is."""
import ast

import pytest

from dispatcher.model.generations import in_force, modelling, using
from dispatcher.model.world import World

from .. import SOURCE, SUITE

# (module, function) -> why the session's generation is the right one there: a default
DEFAULTS = {
    ("dispatcher.model.world", "World"): "a world made without flashinfer= is the session's",
    ("dispatcher.model.generations", "using"): "the block's default, handed back",
    ("dispatcher.plugin", "pytest_report_header"): "the header names the session's option",
    ("dispatcher.gpu.env", "flashinfer_missing"): "the option against the installed kernels",
    ("dispatcher.supervised", "_Child.request"): "a policy process takes the session's default",
    ("dispatcher.sglang.loader", "load_tree"): "the load probe runs on the session's generation",
    ("dispatcher.vllm.loader", "load_tree"): "the load probe runs on the session's generation",
    ("dispatcher.vllm.verdicts", "judged_on"): "an unpinned release is judged on the session's",
    ("dispatcher.cross_round_verdicts", "search"): "a search with no generation draws the session's",
    ("strategies.worlds", "moe_configs"): "a top-k the session's generation supports",
    ("strategies.search", "visited"): "strategies draw the session's generation by default",
}


def _calls_of_active(path):
    """(where, line) of every call of ``active()`` in one file: where is the module-level
    function or class, or ``Class.method``, that holds it (a nested function counts as its
    outer one)."""
    tree = ast.parse(path.read_text())
    found = []

    def walk(node, where, in_class):
        for child in ast.iter_child_nodes(node):
            name, cls = where, in_class
            if isinstance(child, ast.ClassDef) and where is None:
                name, cls = child.name, True
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if where is None:
                    name = child.name
                elif in_class:
                    name, cls = f"{where}.{child.name}", False
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == "active") or (
                        isinstance(f, ast.Attribute) and f.attr == "active"):
                    found.append((name, child.lineno))
            walk(child, name, cls)
    walk(tree, None, False)
    return found


def _module(path):
    rel = path.relative_to(SOURCE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _sites(folders):
    return {(_module(p), fn): line for folder in folders for p in sorted(folder.rglob("*.py"))
            for fn, line in _calls_of_active(p)}


def test_the_sessions_generation_is_read_only_where_a_default_is_chosen():
    sites = _sites([SOURCE / "dispatcher", SOURCE / "strategies"])
    stray = {site: line for site, line in sites.items() if site not in DEFAULTS}
    assert not stray, (f"active() read where a world's generation is at hand (take "
                       f"world.flashinfer, or in engine code generations.in_force()): {stray}")
    gone = set(DEFAULTS) - set(sites)
    assert not gone, f"DEFAULTS names sites that no longer read active(): {gone}"


def test_the_tests_make_worlds_of_their_generation():
    sites = {site: line for site, line in _sites([SUITE]).items()
             if not site[0].endswith("test_generation_carrier")}
    assert not sites, f"tests read the session's generation (make the world with flashinfer=): {sites}"


def test_the_site_scan_sees_a_call(tmp_path):
    """The scan is not blind: a call inside a method is found with its function's name."""
    f = tmp_path / "m.py"
    f.write_text("from x import active\nclass C:\n    def m(self):\n        return active()\n"
                 "def g():\n    def inner():\n        return generations.active()\n"
                 "X = active()\n")
    assert _calls_of_active(f) == [("C.m", 4), ("g", 7), (None, 8)]


def test_an_engine_stand_in_outside_a_step_is_the_gates_bug():
    with pytest.raises(LookupError, match="no engine step is running"):
        in_force()
    with modelling("0.7.4") as outer:
        with modelling("0.7.2.post1") as inner:
            assert in_force() is inner and inner.version == "0.7.2"
        assert in_force() is outer and outer.version == "0.7.4"
    with pytest.raises(LookupError):
        in_force()


@pytest.mark.engine_releases("vllm")
@pytest.mark.parametrize("session", ["0.7.2", "0.7.4"])
def test_an_engine_step_runs_the_worlds_generation_not_the_sessions(pinned_releases, session):
    """vLLM 0.34.0 passes ``runtime_max_tokens_per_rank=``: FlashInfer 0.7.4 takes it, 0.7.2
    does not. Its step launches on a 0.7.4 world and raises 0.7.2's TypeError on a 0.7.2 one,
    whichever generation the session models."""
    pytest.importorskip("torch")
    release = pinned_releases("vllm:{}")["0.34.0"]
    world = World(ep_size=4, dp_size=4, group_tokens=(3, 5, 1, 2), max_num_tokens=16)
    with using(session):  # the session's default, unlike one of the two worlds
        on_074 = release.step(world.on("0.7.4"))
        on_072 = release.step(world.on("0.7.2"))
    assert [o.runtime for o in on_074] == [5] * 4, on_074
    assert all(o.launch is None and "TypeError" in o.error and "runtime_max_tokens_per_rank"
               in o.error for o in on_072), on_072
