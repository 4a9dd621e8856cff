"""No tier x policy-kind pair that never runs: every tier that checks the policy under test is
run by CI (``.ci/policy-matrix.tsv``, which ``.ci/run`` runs through ``.ci/policy_matrix.py``)
under every kind of policy a user gates, on every FlashInfer generation, or is named below
with the reason it cannot apply. The GPU tiers run there too, on the exact CPU model behind
their drivers: a combination nobody runs is a combination that is broken (a GPU-only test
failed every SGLang file, and a two-sided vLLM policy failed a health check, where CI ran
only the default rule)."""
import importlib.util
import subprocess
import sys

import pytest

from dispatcher.engines import ENGINES
from dispatcher.model.generations import GENERATIONS

from .. import SOURCE

pytestmark = pytest.mark.skipif(not (SOURCE / ".ci" / "policy-matrix.tsv").is_file(),
                                reason="CI's policy matrix lives in the checkout, not the wheel")

TIERS = ("cpu", *ENGINES, "gpu", "multi_gpu", "meta")  # the suite's folders
ENGINE_KINDS = {"sglang": ("sglang-release", "sglang-file", "sglang-tree"),
                "vllm": ("vllm-one-sided", "vllm-two-sided")}
# (tier, kind) -> why no test of that tier checks a policy of that kind
NOT_APPLICABLE = {
    **{("meta", kind): "the meta tier checks the gate itself (self-checks, run by the "
                       "default-policy runs of .ci/run): a --policy of the user's deselects it"
       for kind in ("rule", *ENGINE_KINDS["sglang"], *ENGINE_KINDS["vllm"])},
    **{(tier, kind): f"tests/{tier} runs {tier}'s own code: under a policy of another kind its "
                     f"tests check the pinned releases (self-checks, run by the default-policy "
                     f"runs of .ci/run)"
       for tier in ENGINE_KINDS
       for kind in ("rule", *(k for e, ks in ENGINE_KINDS.items() if e != tier for k in ks))},
}


def _matrix():
    spec = importlib.util.spec_from_file_location("policy_matrix", SOURCE / ".ci" / "policy_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uncovered(rows, kinds) -> list:
    """The (tier, kind, generation) pairs no row runs and ``NOT_APPLICABLE`` does not name (a
    row of a wrong policy shows failures, not that a tier runs)."""
    ran = {(tier, kind, gen) for kind, gen, _, paths, expect in rows if expect != "fail"
           for tier in TIERS if paths == (".",) or f"tests/{tier}" in paths}
    return [(tier, kind, gen) for tier in TIERS for kind in kinds for gen in GENERATIONS
            if (tier, kind) not in NOT_APPLICABLE and (tier, kind, gen) not in ran]


def test_every_tier_runs_under_every_kind_of_policy_in_ci():
    matrix = _matrix()
    rows = matrix.read_table()
    assert set(matrix.KINDS) == {"rule", *ENGINE_KINDS["sglang"], *ENGINE_KINDS["vllm"]}
    assert sorted(SOURCE.joinpath("tests").glob("*/__init__.py")) and {
        p.parent.name for p in SOURCE.joinpath("tests").glob("*/__init__.py")} == set(TIERS), \
        "a tier folder was added or removed: list it in TIERS"
    missing = uncovered(rows, matrix.KINDS)
    assert not missing, ("pairs neither run by .ci/policy-matrix.tsv nor named in "
                         f"NOT_APPLICABLE with a reason: {missing}")
    assert {gen for _, gen, _, _, _ in rows} == set(GENERATIONS)
    assert any(expect == "fail" for *_, expect in rows), "no row shows a wrong policy failing"
    assert "policy_matrix.py" in (SOURCE / ".ci" / "run").read_text(), \
        ".ci/run does not run the policy matrix"


def test_taking_a_pair_out_of_ci_is_caught():
    """The check above is not vacuous: taking the rows of any kind and generation out of the
    table leaves pairs uncovered."""
    matrix = _matrix()
    rows = matrix.read_table()
    for kind in matrix.KINDS:
        for gen in GENERATIONS:
            left = [r for r in rows if (r[0], r[1]) != (kind, gen)]
            assert any(k == kind and g == gen for _, k, g in uncovered(left, matrix.KINDS)), \
                (kind, gen)


@pytest.mark.parametrize("tier, spec", [("sglang", "prefix_rule"), ("vllm", "prefix_rule"),
                                        ("meta", "prefix_rule")])
def test_a_pair_named_not_applicable_runs_no_test(tier, spec):
    """Under a rule of the user's, the engines' tiers and the meta tier select nothing (their
    tests are self-checks): the reason given above is what the gate does."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-p", "no:cacheprovider", f"tests/{tier}", f"--policy={spec}"],
                         cwd=SOURCE, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]
    assert "deselected" in out.stdout and "::" not in out.stdout, f"tests/{tier} selects tests under {spec}:\n{out.stdout[-2000:]}"
