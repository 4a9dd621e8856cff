"""No false alarm on SGLang's own files, unmodified or edited in ways SGLang cannot tell apart;
an edit SGLang can reach still fails.

The gate's verdict on an SGLang file depends on the file only through what it runs: the file's
bytes and the SGLang code beside it (``dispatcher.releases.companions``: the key of a loaded release).
So a copy whose key is its release's gets its release's verdict, which the suite measures on
every run (tests/sglang/test_releases.py holds each release to its row of docs/sglang.md, and
the SGLang tier gates the newest release by default). These tests check that key in-process for
every pinned release that ships no bug class, as a lone file and as a checkout tree, in both
load orders (a copy loaded first must not lend its stand-ins to the release: the false alarm
lone copies of 0.5.19-0.5.22 once raised); compare an edited file's outcomes with the
release's on the SGLang tier's own regimes; and run the gate end to end once, on an edit that
must fail.
"""
import re
import shutil

import pytest

from .. import copy_suite, needs_torch

NEEDS_TORCH = needs_torch(reason="SGLang's dispatcher needs torch: pip install torch==2.13.0")

from dispatcher.policies import load_policy  # noqa: E402
from dispatcher.sglang import fetch  # noqa: E402
from dispatcher.sglang.bug_classes import BUG_CLASSES, BUGS  # noqa: E402
from dispatcher.sglang import loader  # noqa: E402
from dispatcher.sglang.sources import RELEASES  # noqa: E402
from strategies import sglang_steps  # noqa: E402
from strategies.search import first_in, visited  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang")]  # SGLang's files: on the FlashInfer they call

NEWEST = RELEASES[-1]
CLEAN = ("0.5.19", "0.5.20", "0.5.22", "0.5.23")  # pinned releases that ship no bug class
# Edits of 0.5.23's sizing code that SGLang cannot tell apart: its counts are already padded
# to attn_tp (floor == ceil), and a one-entry list never reaches the multi-entry branch with a
# value other than x.shape[0] (SP rows are uniform; DP attention always gathers every group).
PRESERVING = {
    "floor-division": ("return (max_dp_tokens + attn_tp_size - 1) // attn_tp_size",
                       "return max_dp_tokens // attn_tp_size"),
    "one-entry-list": ("if dp_global is not None and len(dp_global) > 1:",
                       "if dp_global is not None and len(dp_global) >= 1:"),
}
OBSERVABLE = ("max_dp_tokens = max(dp_global_num_tokens)", "max_dp_tokens = min(dp_global_num_tokens)")
STEPS = 150  # per regime, as tests/sglang/test_releases.py searches each class's


def _tree(version):
    try:
        return fetch.PACKAGE.root_of(fetch.fetch_release(version))
    except fetch.ReleaseError as exc:
        pytest.fail(f"SGLang {version} unavailable: {exc}")


def _copy(version, shape, dest):
    """A copy of the release's dispatcher file: alone in a folder, or in a checkout tree."""
    tree = _tree(version)
    if shape == "lone":
        dest.mkdir()
        shutil.copy(tree / fetch.RELEASE_FILE, dest / "flashinfer.py")
        return dest / "flashinfer.py"
    shutil.copytree(tree / "sglang", dest / "python" / "sglang")
    (dest / "python" / "sglang" / "version.py").write_text(f'__version__ = "{version}"\n')
    return dest


@pytest.mark.parametrize("shape", ["lone", "tree"])
@pytest.mark.parametrize("version", CLEAN)
def test_a_copy_of_a_release_runs_that_releases_code(version, shape, tmp_path, monkeypatch):
    """Byte for byte the same code as the release, whichever is loaded first: the same key,
    so the same verdict; the header says where the code beside a lone copy comes from."""
    target = _copy(version, shape, tmp_path / "copy")
    for order in (["copy", "release"], ["release", "copy"]):
        monkeypatch.setattr(loader, "_LOADED", {})  # both loaded afresh, in this order
        loaded = {who: load_policy(f"sglang:{target}" if who == "copy" else f"sglang:{version}")[1]
                  for who in order}
        copy, release = loaded["copy"], loaded["release"]
        assert copy.companions.key == release.companions.key and copy.sha256 == release.sha256
        assert not release.companions.standin and not copy.companions.standin, order
        assert release.hooks.scheduler.sources == copy.hooks.scheduler.sources, order
        if shape == "lone":
            assert copy.companions.origin == (f"identical to SGLang {version}'s file; its "
                                              f"companions from the release")


def _edited(tmp_path, edits):
    text = (_tree(NEWEST) / fetch.RELEASE_FILE).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} not once in {NEWEST}'s file"
        text = text.replace(old, new)
    out = tmp_path / "edited" / "flashinfer.py"
    out.parent.mkdir()
    out.write_text(text)
    return out


@pytest.mark.parametrize("regime", ["any", *BUGS])
def test_behaviour_preserving_edits_do_what_the_release_does(regime, tmp_path):
    """On the SGLang tier's own regimes, every rank of the edited file (a lone file, so the
    newest release's code stands in beside it, as the header says) does exactly what the
    release does: the same launches, the same routing, the same errors."""
    edited = load_policy(f"sglang:{_edited(tmp_path, PRESERVING.values())}")[1]
    release = load_policy(f"sglang:{NEWEST}")[1]
    assert edited.companions.standin and "matching no pinned release" in edited.companions.origin
    assert edited.companions.key == release.companions.key

    def differs(step):
        try:
            mine = edited.step(*step)
        except Exception as exc:  # NotApplicable: a step neither runs
            mine = type(exc).__name__
        try:
            theirs = release.step(*step)
        except Exception as exc:
            theirs = type(exc).__name__
        return mine != theirs
    hit = first_in(visited(BUG_CLASSES[regime].steps() if regime in BUG_CLASSES else sglang_steps(),
                           STEPS), differs)
    assert hit is None, f"the edited file differs from {NEWEST} on {hit!r}"


def test_an_observable_edit_fails_the_gate_end_to_end(tmp_path):
    """The user's command, as a user runs it (``pytest`` in a folder of theirs, no xdist):
    fails, with a replay line naming the file. Run with this run's environment, as a user's
    shell would (no pytester HOME), so its zygote is this run's (a nested run forks from the
    zygote that serves its environment, instead of importing torch in one of its own)."""
    import os
    import subprocess
    import sys

    suite = tmp_path / "user"
    suite.mkdir()
    copy_suite(suite, "cpu", "sglang")
    edited = _edited(tmp_path, [OBSERVABLE])
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-q", "-x", "--hypothesis-profile=ci", f"--policy=sglang:{edited}",
                           "tests/sglang/test_engine_steps.py", "-k", "test_engine_in_every_context"],
                          cwd=suite, env=dict(os.environ, PYTEST_ADDOPTS=""), capture_output=True,
                          text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, text[-4000:]
    assert re.search(r"replay: python -m dispatcher( --flashinfer=\S+)? --policy", text)
    assert "standing in" in text  # the message says whose code stood in beside the file
