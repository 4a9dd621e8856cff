"""The engine x FlashInfer table in docs/flashinfer.md is what the code says today: every pinned
release's own file, run on each generation's API as its source defines it."""
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
