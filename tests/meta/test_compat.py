"""The engine x FlashInfer table in docs/flashinfer.md is what the code says today: every pinned
release's own file, run on each generation's API as its source defines it."""
from pathlib import Path

import pytest

from .. import SOURCE, needs_torch

pytestmark = needs_torch(reason="the engines' files need torch")


@pytest.mark.xdist_group("flashinfer-compat")
def test_docs_table_is_the_measured_one():
    from dispatcher.commands.compat import markdown, table

    docs = SOURCE / "docs" / "flashinfer.md"
    if not docs.is_file():  # the installed suite carries no docs
        pytest.skip("docs/ is not shipped in the wheel")
    measured = markdown(table())
    assert measured in docs.read_text(), (
        "docs/flashinfer.md's engine x FlashInfer table is stale; regenerate it with "
        "python -m dispatcher.commands.compat\n" + measured)


def test_each_release_runs_on_the_generation_it_is_judged_on():
    from dispatcher.commands.compat import launch_error
    from dispatcher.engines import ENGINES

    for engine in ENGINES.values():
        for version in engine.releases:
            assert launch_error(engine.spec(version), engine.judged_on(version))[1] is None, version


def test_the_newest_releases_fail_on_074_with_their_own_errors():
    from dispatcher.commands.compat import cell

    assert cell("vllm:0.33.0", "0.7.4") == (
        "TypeError: NVLinkOneSidedAlltoAll.dispatch() got an unexpected keyword argument "
        "'max_tokens_per_rank' (FlashInfer 0.7.4 does not take max_tokens_per_rank=; FlashInfer "
        "0.7.2 does).")
    # the next release calls 0.7.4's API: a compatibility verdict on 0.7.2, judged on 0.7.4
    assert cell("vllm:0.34.0", "0.7.2") == (
        "TypeError: NVLinkOneSidedAlltoAll.dispatch() got an unexpected keyword argument "
        "'runtime_max_tokens_per_rank' (FlashInfer 0.7.2 does not take "
        "runtime_max_tokens_per_rank=; FlashInfer 0.7.4 does).")
    assert cell("vllm:0.34.0", "0.7.4") == "runs; cross-round closed"
    assert cell("vllm:0.34.0@two-sided", "0.7.4") == "runs"
    assert cell("sglang:0.5.23", "0.7.4").startswith("ImportError: Flashinfer is not installed")
    assert cell("vllm:0.33.0", "0.7.2") == cell("sglang:0.5.23", "0.7.2") == \
        "runs; cross-round exposed"
    assert cell("vllm:0.33.0@two-sided", "0.7.2") == "runs"  # other kernels: no such layout


def test_a_pinned_release_runs_on_its_generation_where_none_is_installed_or_asked():
    """``pytest -n auto --policy=vllm:0.34.0`` on a machine without FlashInfer models 0.7.4,
    the generation 0.34.0 calls (an installed FlashInfer or --flashinfer still decides)."""
    from dispatcher.plugin.generation import judged_on as _judged_on

    assert _judged_on("vllm:0.34.0") == _judged_on("vllm:0.34.0@two-sided") == "0.7.4"
    assert _judged_on("vllm:0.33.0") == _judged_on("sglang:0.5.23") == "0.7.2"
    assert _judged_on("prefix_rule") is _judged_on("vllm:/some/checkout") is None


def test_a_lone_copy_of_a_pinned_releases_file_runs_on_that_releases_generation(tmp_path):
    """A lone file byte-identical to 0.34.0's runs 0.34.0's code (its companions), so it is
    judged on 0.34.0's generation, as ``vllm:0.34.0`` is (it failed every test on 0.7.2 with
    the compatibility TypeError); an edited copy is a file of no release: the session's."""
    import shutil

    from dispatcher.plugin.generation import judged_on as _judged_on
    from dispatcher.vllm import fetch

    root = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release("0.34.0"))
    for side, rel in (("", fetch.ONE_SIDED[0]), ("@two-sided", fetch.TWO_SIDED[0])):
        copy = tmp_path / side.strip("@") / Path(rel).name
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(root / rel, copy)
        assert _judged_on(f"vllm:{copy}{side}") == "0.7.4", rel
        copy.write_text(copy.read_text() + "# edited\n")
        assert _judged_on(f"vllm:{copy}{side}") is None
    sglang = tmp_path / "flashinfer.py"
    from dispatcher.sglang import fetch as sglang_fetch

    shutil.copy(sglang_fetch.PACKAGE.root_of(sglang_fetch.PACKAGE.fetch_release("0.5.23"))
                / sglang_fetch.RELEASE_FILE, sglang)
    assert _judged_on(f"sglang:{sglang}") == "0.7.2"
