"""The engine code the gate runs beside a dispatcher file (``dispatcher.releases.companions``): the table
of what each release has is the pinned releases' truth, and a tree that lacks a piece its
release has is refused by name, never answered by a silent default."""
import os
import re
import subprocess
import sys
import time

import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="the engines' files need torch: pip install torch==2.13.0")

from dispatcher.engines import ENGINES  # noqa: E402
from dispatcher.releases.companions import NEWEST_ENV  # noqa: E402
from dispatcher.policies import PolicyError, load_policy  # noqa: E402
from dispatcher.sglang import fetch, sources  # noqa: E402
from dispatcher.vllm import fetch as vfetch  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang")]


def _root(package, version):
    try:
        return package.root_of(package.fetch_release(version))
    except fetch.ReleaseError as exc:
        pytest.fail(f"{package.name} {version} unavailable: {exc}")


@pytest.mark.parametrize("engine, package, needed, releases", [
    (name, e.module("fetch").CODE.package, e.module("fetch").CODE.needed,
     e.module("fetch").CODE.releases) for name, e in ENGINES.items()], ids=list(ENGINES))
def test_the_table_is_what_every_pinned_release_has(engine, package, needed, releases):
    for version in releases:
        root = _root(package, version)
        for piece in needed:
            found = [rel for rel in piece.files if (root / rel).is_file()
                     and piece.found_in(root / rel)]
            assert bool(found) == piece.expected_in(version), \
                f"{engine} {version}: {piece.shown} {'found in ' + found[0] if found else 'missing'}" \
                f", the table says {piece.since}..{piece.until or 'now'}"


def test_every_pinned_release_imports_each_piece_from_its_home():
    """Following a pinned release's own imports (the dispatcher file, the scheduler's gather,
    the forward batch, the runners) leads each piece to the home the table names: the two
    ways of finding the engine's code agree wherever both apply."""
    from dispatcher.releases.companions import _find, _imported

    for version in sources.RELEASES:
        root = _root(fetch.PACKAGE, version)
        for piece in (p for p in sources.NEEDED if p.imported_by):
            via = _imported(piece, root)
            home = _find(piece, root) if piece.expected_in(version) else None
            assert (via.file if via else None) == home, (version, piece.key)


@pytest.fixture
def tree(tmp_path):
    """A checkout-shaped copy of the newest SGLang release, as a user's checkout holds it."""
    import shutil

    root = tmp_path / "sglang"
    shutil.copytree(_root(fetch.PACKAGE, sources.RELEASES[-1]) / "sglang", root / "python" / "sglang")
    (root / "python" / "sglang" / "version.py").write_text(f'__version__ = "{sources.RELEASES[-1]}"\n')
    return root


def _file(tree, rel):
    return tree / "python" / rel


@pytest.mark.parametrize("damage, words", [
    ("remove common.py", "require_mlp_tp_gather() (looked in sglang/srt/utils/common.py"),
    ("rename require_mlp_tp_gather", "require_mlp_tp_gather()"),
    ("remove overrides.py", "flashinfer_a2a_max_dispatch_tokens_per_rank()"),
    ("common.py a symlink loop", "require_mlp_tp_gather()"),
    ("rename the topology check", "_flashinfer_a2a_topology_is_supported()"),
])
def test_a_tree_that_lacks_a_piece_of_its_release_is_refused_by_name(tree, damage, words,
                                                                    monkeypatch):
    monkeypatch.delenv(NEWEST_ENV, raising=False)
    common = _file(tree, sources.COMMON)
    if damage == "remove common.py":
        common.unlink()
    elif damage == "rename require_mlp_tp_gather":
        common.write_text(common.read_text().replace("def require_mlp_tp_gather(",
                                                     "def require_mlp_tp_gather_v2("))
    elif damage == "remove overrides.py":
        _file(tree, sources.OVERRIDES).unlink()
    elif damage == "common.py a symlink loop":
        common.unlink()
        os.symlink(common, common)
    else:
        hook = _file(tree, sources.MOE_HOOK)
        hook.write_text(hook.read_text().replace("_flashinfer_a2a_topology_is_supported",
                                                 "_a2a_topology_ok"))
    with pytest.raises(PolicyError, match="the tree lacks") as info:
        load_policy(f"sglang:{tree}")
    assert words in str(info.value) and str(tree) in str(info.value)
    assert "--newest-companions" in str(info.value)
    monkeypatch.setenv(NEWEST_ENV, "1")  # asked for explicitly: the newest release's stands in
    release = load_policy(f"sglang:{tree}")[1]
    assert release.companions.standin and "(--newest-companions)" in release.companions.origin


def _move_gather(tree, *targets):
    """``require_mlp_tp_gather`` cut out of ``utils/common.py`` and written into ``targets``."""
    import ast

    common = _file(tree, sources.COMMON)
    text = common.read_text()
    node = next(n for n in ast.parse(text).body
                if isinstance(n, ast.FunctionDef) and n.name == "require_mlp_tp_gather")
    lines = text.splitlines(keepends=True)
    body = "".join(lines[node.lineno - 1:node.end_lineno])
    common.write_text("".join(lines[:node.lineno - 1] + lines[node.end_lineno:]))
    for rel in targets:
        _file(tree, rel).write_text("from sglang.srt.utils.common import *  # noqa\n\n\n" + body)


def test_a_helper_upstream_moved_to_a_new_module_is_found_there(tree):
    """A refactor that moves ``require_mlp_tp_gather()`` out of ``utils/common.py`` into a new
    module: the tree is judged with it (no refusal, no false alarm), and the header says where
    it was found."""
    from dispatcher.sglang.bug_classes import BUG_CLASSES, step_problem

    _move_gather(tree, "sglang/srt/utils/mlp_gather.py")
    release = load_policy(f"sglang:{tree}")[1]
    assert "require_mlp_tp_gather() from sglang/srt/utils/mlp_gather.py" in \
        release.companions.origin
    _, world, ctx = BUG_CLASSES["collapsed-dp-global"].first_seen
    assert step_problem(release, world, ctx, release.step(world, ctx)) is None


def test_a_helper_defined_in_two_new_modules_is_refused_naming_both(tree):
    _move_gather(tree, "sglang/srt/utils/mlp_gather.py", "sglang/srt/layers/gather_rules.py")
    with pytest.raises(PolicyError, match=r"2 modules define it \(sglang/srt/layers/gather_rules.py, "
                                          r"sglang/srt/utils/mlp_gather.py\)"):
        load_policy(f"sglang:{tree}")


def test_a_tree_is_held_to_the_release_it_says_it_is(tree, monkeypatch):
    """An older tree need not have what came later (0.5.19 had no topology function, only the
    assert), and lacking what its release had (the assert) is refused."""
    monkeypatch.delenv(NEWEST_ENV, raising=False)
    (tree / "python" / "sglang" / "version.py").write_text('__version__ = "0.5.19"\n')
    old = _root(fetch.PACKAGE, "0.5.19")
    hook = _file(tree, sources.MOE_HOOK)
    hook.write_bytes((old / sources.MOE_HOOK).read_bytes().replace(
        b'== "flashinfer"', b'== "flashinfer_v2"'))
    with pytest.raises(PolicyError, match=r"the tree says it is 0\.5\.19") as info:
        load_policy(f"sglang:{tree}")
    assert sources.TOPOLOGY_ASSERT in str(info.value)
    hook.write_bytes((old / sources.MOE_HOOK).read_bytes())
    assert "assert under" in load_policy(f"sglang:{tree}")[1].hooks.scheduler.sources["topology"]


def test_a_bom_or_a_coding_line_reads_as_python_reads_it(tree, monkeypatch):
    monkeypatch.delenv(NEWEST_ENV, raising=False)
    common = _file(tree, sources.COMMON)
    common.write_bytes(b"\xef\xbb\xbf" + common.read_bytes())
    spec = _file(tree, sources.SPEC_INFO)
    spec.write_bytes(b"# -*- coding: utf-8 -*-\n" + spec.read_bytes())
    release = load_policy(f"sglang:{tree}")[1]
    assert not release.companions.standin and release.hooks.require_mlp_tp_gather is not None


def test_a_vllm_tree_without_its_forward_context_is_refused(tmp_path, monkeypatch):
    import shutil

    monkeypatch.delenv(NEWEST_ENV, raising=False)
    root = tmp_path / "vllm"
    shutil.copytree(_root(vfetch.PACKAGE, vfetch.RELEASES[-1]) / "vllm", root / "vllm")
    (root / vfetch.FORWARD_CONTEXT).unlink()
    with pytest.raises(PolicyError, match=r"_compute_sp_num_tokens\(\) \(looked in vllm/forward_context.py"):
        load_policy(f"vllm:{root}")


def test_the_gate_refuses_such_a_tree_before_any_test(tree):
    """The user's command: a usage error (exit 4) naming the missing function, not a green run."""
    _file(tree, sources.COMMON).unlink()
    env = {k: v for k, v in os.environ.items() if k != NEWEST_ENV}
    from dispatcher.commands.runner import suite_args  # the suite as a checkout or a2a-gate runs it

    args = suite_args(args=["-p", "no:cacheprovider", "--co", "-q", f"--policy=sglang:{tree}",
                            "cpu/test_validation.py"])
    done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tree, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "require_mlp_tp_gather()" in done.stderr


def test_a_companion_function_runs_nothing_of_its_file_but_its_body(tmp_path):
    """Compiled alone: defaults that are not literals are not evaluated (that would run the
    file's code at load); a decorated one is refused by name, since the decorator decides
    which object Python binds (running the bare def could run the wrong one), and nothing of
    the file runs either way."""
    from dispatcher.releases.companions import Unevaluated, companion_function
    from dispatcher.releases.wheels import ReleaseError

    marker = tmp_path / "ran"
    src = tmp_path / "common.py"
    touch = ("def touch(*a, **k):\n"
             f"    open({str(marker)!r}, 'a').write('x')\n"
             "    return lambda f: f\n")
    src.write_text(touch + "def require_mlp_tp_gather(server_args=touch(), flag=True):\n"
                           "    return flag\n")
    fn = companion_function(src, "require_mlp_tp_gather", {})
    assert not marker.exists()
    assert fn() is True and isinstance(fn.__defaults__[0], Unevaluated)
    src.write_text(touch + "@touch()\ndef require_mlp_tp_gather(flag=True):\n    return flag\n")
    with pytest.raises(ReleaseError, match="wraps require_mlp_tp_gather in a decorator"):
        companion_function(src, "require_mlp_tp_gather", {})
    assert not marker.exists()


@pytest.mark.parametrize("head, decorator", [
    ("import functools\n", "@functools.lru_cache(maxsize=None)"),
    ("import functools\n", "@functools.cache"),
    ("from functools import lru_cache\n", "@lru_cache"),
    ("from functools import lru_cache\n", "@lru_cache(64)"),
    ("import functools as ft\n", "@ft.cache"),
])
def test_a_companion_under_functools_cache_is_run_as_its_own_function(tmp_path, head, decorator):
    """functools' caches return what the function returns: the gate runs the function itself
    (the #27945 fix undone under ``@lru_cache`` still fails), for each step's server args."""
    from dispatcher.releases.companions import companion_function

    src = tmp_path / "common.py"
    src.write_text(f"{head}\n{decorator}\ndef require_mlp_tp_gather(flag=False):\n    return flag\n")
    fn = companion_function(src, "require_mlp_tp_gather", {})
    assert fn() is False and fn(True) is True  # no cache between the gate's calls


@pytest.mark.parametrize("head, decorator", [
    ("import functools\n", "@functools.wraps(print)"),
    ("from mycache import lru_cache\n", "@lru_cache"),  # a look-alike of the user's
    ("import functools\nfunctools = None\n", "@functools.cache"),  # rebound
    ("from functools import lru_cache\nlru_cache = print\n", "@lru_cache"),
    ("from functools import lru_cache\n", "@lru_cache(maxsize=size())"),
])
def test_a_companion_under_another_decorator_is_refused(tmp_path, head, decorator):
    from dispatcher.releases.companions import companion_function
    from dispatcher.releases.wheels import ReleaseError

    src = tmp_path / "common.py"
    src.write_text(f"{head}\n{decorator}\ndef require_mlp_tp_gather(flag=False):\n    return flag\n")
    with pytest.raises(ReleaseError, match="wraps require_mlp_tp_gather in a decorator"):
        companion_function(src, "require_mlp_tp_gather", {})


@pytest.mark.parametrize("how", [
    "def require_mlp_tp_gather(server_args=None):\n    return True\n",  # a second def later
    "def _other(server_args=None):\n    return True\nrequire_mlp_tp_gather = _other\n",
    "def _other(server_args=None):\n    return True\nalias = _other\nrequire_mlp_tp_gather = alias\n",
])
def test_a_companion_is_the_object_python_binds(tmp_path, how):
    """SGLang #27945's fix undone by a later binding of the name: Python runs the last one, so
    the gate runs that one (a second ``def``, a rebinding to another def, followed)."""
    from dispatcher.releases.companions import companion_function

    src = tmp_path / "dp_attention.py"
    src.write_text("def require_mlp_tp_gather(server_args=None):\n    return False\n\n" + how)
    assert companion_function(src, "require_mlp_tp_gather", {})() is True


@pytest.mark.parametrize("how, words", [
    ("from elsewhere import require_mlp_tp_gather\n", "no plain def (line 4: an import"),
    ("try:\n    from fast import require_mlp_tp_gather\nexcept ImportError:\n    pass\n",
     "under a condition"),
    ("if FAST:\n    def require_mlp_tp_gather(server_args=None):\n        return True\n",
     "under a condition"),
    ("require_mlp_tp_gather = make()\n", "no plain def"),
])
def test_a_companion_python_would_resolve_at_run_time_is_refused(tmp_path, how, words):
    """Where the object depends on what runs at import (an import, a condition, a call), the
    gate cannot tell which it is: the tree is refused by name, never run on the wrong one."""
    from dispatcher.releases.companions import companion_function
    from dispatcher.releases.wheels import ReleaseError

    src = tmp_path / "dp_attention.py"
    src.write_text("def require_mlp_tp_gather(server_args=None):\n    return False\n\n" + how)
    with pytest.raises(ReleaseError, match=re.escape(words)):
        companion_function(src, "require_mlp_tp_gather", {})


@pytest.mark.parametrize("written", ["a second def", "under functools.lru_cache"])
def test_the_27945_tree_fails_however_the_function_is_written(tree, written):
    """SGLang #27945 (FlashInfer left out of require_mlp_tp_gather()'s gather) written as a
    second def at the end of common.py, or as a cached def: Python runs that one, and so does
    the gate. 0.5.23's dispatcher asserts on the collapsed list it is then handed, in a step
    where a valid runtime exists: the engine tier fails it."""
    from dispatcher.sglang.bug_classes import BUG_CLASSES, step_problem

    _, world, ctx = BUG_CLASSES["collapsed-dp-global"].first_seen
    release = load_policy(f"sglang:{tree}")[1]
    assert step_problem(release, world, ctx, release.step(world, ctx)) is None
    path = _file(tree, sources.COMMON)
    head = "def require_mlp_tp_gather(*, moe_a2a_backend=None):\n"
    if written == "a second def":
        path.write_text(path.read_text() + "\n\n" + head + "    return False\n")
    else:
        path.write_text(path.read_text().replace(
            head, "@functools.lru_cache(maxsize=None)\n" + head + "    return False\n", 1))
    release = load_policy(f"sglang:{tree}")[1]
    problem = step_problem(release, world, ctx, release.step(world, ctx))
    assert problem is not None and "raised" in problem, problem


def _hostile_companion(tree, body):
    """``body`` run first in the tree's ``require_mlp_tp_gather()``; the environment to run in."""
    path = _file(tree, sources.COMMON)
    text = path.read_text()
    head = "def require_mlp_tp_gather(*, moe_a2a_backend=None):\n"
    assert head in text
    start = text.index('"""', text.index(head))
    end = text.index('"""', start + 3) + 3  # after the docstring
    path.write_text(text[:end] + "\n    " + body + text[end:])
    return {k: v for k, v in os.environ.items() if k != NEWEST_ENV}


# what a tree's require_mlp_tp_gather() does first, and the words its failure must say
HOSTILE = pytest.mark.parametrize("body, words", [
    ("import os\n    os._exit(0)\n", "os._exit(0)"),
    ("import signal\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
     "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    while True:\n        pass\n",
     "[slow rule]"),
    ("while True:\n        pass\n", "[slow rule]"),
], ids=["exits", "spins-deaf", "spins"])


@HOSTILE
def test_engine_code_of_a_tree_that_exits_or_hangs_fails_its_test(tree, body, words):
    """The tree's own companion (``require_mlp_tp_gather()``, run inside SGLang's dispatch)
    ends the process or never returns: it runs in the supervised process, so the run fails
    with the world, never exit 0 and never a hang (the parent's SIGKILL deadline)."""
    env = _hostile_companion(tree, body)
    from dispatcher.commands.runner import suite_args

    args = suite_args(args=["-p", "no:cacheprovider", "-q", "-n", "0", f"--policy=sglang:{tree}",
                            "--rule-timeout-s=0.5", "sglang/test_engine_steps.py",
                            "-k", "in_every_context"])
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tree, capture_output=True,
                          text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert words in out and "INTERNALERROR" not in out, out[-3000:]
    # a hang fails its test at once, unshrunk (shrinking it waited the limit out ~30 times)
    assert time.monotonic() - t0 < 20, out[-3000:]


@HOSTILE
def test_the_replay_of_such_a_tree_is_a_violation(tree, body, words):
    """The replay decides its own status: 1, the violation with its world (was 3, "internal
    error of the gate", where the engine's code exited in the step the replay describes)."""
    env = _hostile_companion(tree, body)
    replay = subprocess.run([sys.executable, "-m", "dispatcher", "--policy", f"sglang:{tree}",
                             "--rule-timeout-s", "0.5",
                             "World(ep_size=4, dp_size=4, group_tokens=(5, 2, 1, 3), "
                             "max_num_tokens=8)"], cwd=tree, capture_output=True, text=True,
                            timeout=120, env=env)
    out = replay.stdout + replay.stderr
    assert replay.returncode == 1 and words in out, out[-3000:]
