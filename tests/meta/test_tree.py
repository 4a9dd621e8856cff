"""The tree under test (``dispatcher/releases/tree.py``) is the one path from a ``--policy ENGINE:TARGET``
to the engine code the gate runs: a release, a checkout and a lone file each resolve to one
``Tree``, the loaded policy runs what that tree resolved, and a piece is compiled as its module
binds it."""
import shutil

import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="the engines' files need torch: pip install torch==2.13.0")

from dispatcher.engines import ENGINES  # noqa: E402
from dispatcher.sglang import fetch, loader  # noqa: E402
from dispatcher.sglang.standins import stand_in_globals  # noqa: E402
from dispatcher.vllm import loader as vloader  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang")]
NEWEST = fetch.RELEASES[-1]
ENGINE_TREES = [(e.module("fetch").CODE, e.module("loader")) for e in ENGINES.values()]


def _release_root(code, version):
    try:
        return code.package.root_of(code.package.fetch_release(version))
    except fetch.ReleaseError as exc:
        pytest.fail(f"{code.name} {version} unavailable: {exc}")


@pytest.mark.parametrize("code, load", ENGINE_TREES, ids=list(ENGINES))
def test_a_release_is_one_tree_and_its_policy_runs_what_the_tree_resolved(code, load):
    version = code.releases[-1]
    root = _release_root(code, version)
    tree = load.tree_of_spec(version)
    assert (tree.root, tree.label) == (root, version)
    assert tree.origin == f"from {code.name} {version}'s own files"
    assert all(p is None or root in p.parents for _, p in tree.companions.sources)
    release = load.release_from_spec(version)
    assert release.tree == tree and release.path == tree.main
    assert release.companions is tree.companions or release.companions == tree.companions


@pytest.mark.parametrize("code, load", ENGINE_TREES, ids=list(ENGINES))
def test_a_lone_file_is_a_tree_rooted_in_its_release(tmp_path, code, load):
    version = code.releases[-1]
    root = _release_root(code, version)
    main = code.main_file(version)[0]
    copy = tmp_path / main.name
    shutil.copy(main, copy)
    tree = load.tree_of(copy)
    assert tree.main == copy.resolve() and tree.root == root
    assert tree.origin.startswith(f"identical to {code.name} {version}'s")
    assert tree.digest == load.tree_of(main).digest


def test_a_tree_compiles_the_binding_its_module_ends_with(tmp_path):
    """A checkout whose function's module rebinds require_mlp_tp_gather after its def: the
    tree's function is the rebinding, as Python's import gives it."""
    root = _release_root(fetch.CODE, NEWEST)
    home = loader.tree_of_spec(NEWEST).source("require_mlp_tp_gather").relative_to(root)
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(root / "sglang", checkout / "python" / "sglang")
    dp = checkout / "python" / home
    dp.write_text(dp.read_text() + "\n\ndef _never():\n    return 'rebound'\n\n\n"
                  "require_mlp_tp_gather = _never\n")
    tree = loader.tree_of_spec(str(checkout))
    assert tree.source("require_mlp_tp_gather") == dp.resolve()
    assert tree.origin.startswith(f"from the tree {checkout / 'python'}")
    assert tree.function("require_mlp_tp_gather", stand_in_globals())() == "rebound"
    assert tree.function("no_such_piece", stand_in_globals()) is None


def test_a_file_that_is_not_the_engines_is_refused_before_its_tree_is_read(tmp_path):
    stray = tmp_path / "flashinfer.py"
    stray.write_text("import os\nos._exit(0)\n")
    with pytest.raises(fetch.ReleaseError, match="defines no FlashinferDispatcher"):
        loader.tree_of(stray)
    with pytest.raises(fetch.ReleaseError, match="defines neither"):
        vloader.tree_of(stray)
