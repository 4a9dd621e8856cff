"""No false alarm: SGLang's newest pinned dispatcher file, unmodified (as a lone file and as a
checkout-shaped tree), and with edits that change nothing SGLang can reach, passes the SGLang
tests and the property tests; an edit SGLang can reach still fails them. Run end to end through
pytester, as a user runs ``pytest --policy=sglang:PATH``."""
import re
import shutil

import pytest

from .. import copy_suite

pytest.importorskip("torch", reason="SGLang's dispatcher needs torch: pip install torch==2.13.0")

from dispatcher.sglang import fetch  # noqa: E402
from dispatcher.sglang.verdicts import RELEASES  # noqa: E402

pytestmark = pytest.mark.engine_releases("sglang")  # SGLang's files: on the FlashInfer they call

NEWEST = RELEASES[-1]
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


@pytest.fixture(scope="module")
def newest_tree():
    """The newest pinned release's verified files (the dispatcher and its companions)."""
    try:
        main = fetch.fetch_release(NEWEST)
    except fetch.ReleaseError as exc:
        pytest.fail(f"SGLang {NEWEST} unavailable: {exc}")
    return fetch.PACKAGE.root_of(main)


def _run(pytester, monkeypatch, policy: str, *tests: str):
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    copy_suite(pytester.path, "cpu", "sglang")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                                           f"--policy=sglang:{policy}", *tests)
    return result, result.stdout.str() + result.stderr.str()


def _edited(newest_tree, tmp_path, edits):
    text = (newest_tree / fetch.RELEASE_FILE).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} not once in {NEWEST}'s file"
        text = text.replace(old, new)
    out = tmp_path / "edited" / "flashinfer.py"
    out.parent.mkdir()
    out.write_text(text)
    return out


def test_unmodified_lone_file_passes(pytester, monkeypatch, newest_tree, tmp_path):
    lone = tmp_path / "lone" / "flashinfer.py"
    lone.parent.mkdir()
    shutil.copy(newest_tree / fetch.RELEASE_FILE, lone)
    result, text = _run(pytester, monkeypatch, str(lone), "tests/sglang/test_engine_steps.py",
                        "tests/cpu/test_sizing_properties.py")
    assert result.ret == pytest.ExitCode.OK, text[-4000:]
    assert " skipped" not in text.splitlines()[-1], text[-2000:]


def test_unmodified_checkout_passes(pytester, monkeypatch, newest_tree, tmp_path):
    """A checkout-shaped tree (``python/sglang/srt/...``): the companions beside the file are
    read, so SGLang's own scheduler functions and server-arg checks run."""
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(newest_tree / "sglang", checkout / "python" / "sglang")
    result, text = _run(pytester, monkeypatch, str(checkout), "tests/sglang/test_engine_steps.py")
    assert result.ret == pytest.ExitCode.OK, text[-4000:]


def test_behaviour_preserving_edits_pass(pytester, monkeypatch, newest_tree, tmp_path):
    edited = _edited(newest_tree, tmp_path, PRESERVING.values())
    result, text = _run(pytester, monkeypatch, str(edited), "tests/sglang/test_engine_steps.py")
    assert result.ret == pytest.ExitCode.OK, text[-4000:]


def test_an_observable_edit_still_fails(pytester, monkeypatch, newest_tree, tmp_path):
    edited = _edited(newest_tree, tmp_path, [OBSERVABLE])
    result, text = _run(pytester, monkeypatch, str(edited), "-x",
                        "tests/sglang/test_engine_steps.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text[-4000:]
    assert re.search(r"replay: python -m dispatcher( --flashinfer=\S+)? --policy", text)
