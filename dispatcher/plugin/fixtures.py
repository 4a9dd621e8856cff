"""The gate's pytest fixtures (registered by ``dispatcher.plugin``, which imports them): the
policy under test, pinned engine releases loaded on first use, and the FlashInfer generation an
engine's pinned releases run on."""
from __future__ import annotations

import pytest

from dispatcher.policies import PolicyError, engine_spec, load_policy
from dispatcher.supervised import load_supervised

__all__ = ["policy_spec", "policy", "load_release", "Releases", "pinned_releases",
           "engine_under_test"]


@pytest.fixture(scope="session")
def policy_spec(request):
    return request.config.getoption("--policy")


@pytest.fixture(scope="session")
def policy(policy_spec):
    """The policy under test: a rule ``(RankView) -> int`` or an engine's file, run in a
    supervised process where it is code the user named (``dispatcher.supervised``)."""
    return load_supervised(policy_spec)


@pytest.fixture(scope="session")
def load_release(pytestconfig):
    """``load(spec) -> release``: a pinned engine release; one that cannot be had fails the
    test that asked for it, naming the release and why (a skip only with
    ``--allow-missing-releases``), so a missing release never passes as "skipped"."""
    allowed = pytestconfig.getoption("--allow-missing-releases")

    def load(spec: str):
        try:
            return load_policy(spec)[1]
        except PolicyError as exc:
            (pytest.skip if allowed else pytest.fail)(
                f"{spec} unavailable: {exc} (--allow-missing-releases skips instead)")
    return load


class Releases(dict):
    """``releases[key]`` loaded on first use by ``load(key)``: one release that cannot be had
    fails the tests that use it, not the others."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, key):
        self[key] = value = self._load(key)
        return value


@pytest.fixture(scope="session")
def pinned_releases(load_release):
    """``table("sglang:{}")``: the releases of that spec template, each loaded on first use."""
    return lambda template: Releases(lambda v: load_release(template.format(v)))




@pytest.fixture(autouse=True)
def _engine_generation(request):
    """Under ``engine_releases``: the pinned releases' history is a fact about the FlashInfer
    they call, so it runs on that generation whatever ``--flashinfer`` says (a test over
    several releases puts each on its own: ``Engine.judged_on``); the engine under test
    (``--policy=sglang:...``/``vllm:...``) runs on the session's generation."""
    mark = request.node.get_closest_marker("engine_releases")
    if mark is None:
        yield
        return
    engine = mark.args[0]
    from dispatcher.engines import ENGINES
    from dispatcher.model.generations import PINNED_RELEASES_GENERATION, using

    generation = PINNED_RELEASES_GENERATION
    if mark.kwargs.get("under_test"):
        policy_spec = request.config.getoption("--policy")
        spec = engine_spec(policy_spec, engine)
        if spec == policy_spec:
            yield
            return
        generation = ENGINES[engine].judged_on(spec.partition(":")[2])  # its newest release's
    with using(generation):
        yield


@pytest.fixture(scope="session")
def engine_under_test(policy_spec, load_release):
    """``get(engine) -> (spec, release)``: what an engine's own tiers run (the ``--policy`` one
    when it is that engine's, else its newest pinned release). A test that uses it carries
    ``engine_releases(engine, under_test=True)``: that mark says whether it checks the policy
    under test (``self_check``)."""
    def get(engine: str):
        spec = engine_spec(policy_spec, engine)
        if spec == policy_spec:
            return spec, load_supervised(spec)
        return spec, load_release(spec)
    return get
