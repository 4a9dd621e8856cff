"""The SGLang dispatcher under test in every context the gate knows: ``--policy=sglang:PATH``
(a checkout, a wheel, a release) or, when the policy is a plain rule, the newest pinned
release. Every bug class's regime, and every (world, context) SGLang can produce: all ranks
take the same path, a launched runtime fits every rank, agrees across ranks, is an int >= 1
within the cap SGLang constructed, and SGLang refuses only where no valid runtime exists.
"""
import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="SGLang's dispatcher needs torch: pip install torch==2.13.0 "
                    "(the CPU build) or pip install -e '.[sglang]'")
from hypothesis import event, given, reject  # noqa: E402

from dispatcher.sglang.bug_classes import (  # noqa: E402
    BUG_CLASSES,
    RUNTIME_CLASSES,
    BUGS,
    check_step,
    describe_step,
    step_problem,
)
from dispatcher.sglang.sequences import check_steps  # noqa: E402
from strategies import sglang_sequences, sglang_steps  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang", under_test=True)]


@pytest.fixture(scope="session")
def engine(engine_under_test):
    """The SGLang file under test: the --policy one, else the newest pinned release."""
    return engine_under_test("sglang")[1]




def _allowed(engine, key):
    """Classes a pinned release is known to ship are measured in test_releases instead."""
    from .test_releases import EXPECTED_CLASSES

    return key in EXPECTED_CLASSES.get(engine.label, set())


@pytest.mark.parametrize("key", BUGS)
def test_engine_has_no_bug_class(engine, key):
    """Each class's regime, searched for the engine under test (a pinned release's known
    classes are left to test_releases, which expects them). Steps whose server config the
    engine's own checks refuse are none of its steps. Hazards (contexts SGLang's own code does
    not produce) are no test here: ``python -m dispatcher.commands.verdicts`` reports them in
    the hardening column."""
    if _allowed(engine, key):
        pytest.skip(f"{engine.label} is known to ship {key} (docs/sglang.md): test_releases "
                    f"checks it fails as expected")

    @given(step=BUG_CLASSES[key].steps())
    def run(step):
        problem = check_step(engine, key, *step)
        assert problem is None, problem
    run()


@given(step=sglang_steps())
def test_engine_in_every_context(engine, step):
    """Any step SGLang can produce: all ranks do the same thing; a launch is sound; a
    refusal happens only where no valid runtime exists (or in a mode SGLang refuses)."""
    world, ctx = step
    if any(_allowed(engine, k) and BUG_CLASSES[k].applies(world, ctx) for k in RUNTIME_CLASSES):
        reject()  # a runtime bug this pinned release is known to ship: test_releases expects it
    try:
        outs = engine.step(world, ctx)
    except Exception as exc:  # NotApplicable: a step the engine cannot run (a bucket too big)
        if type(exc).__name__ == "NotApplicable":
            reject()
        raise
    kinds = {"launch" if o.launch else "around" if o.routed_around else "error" for o in outs}
    event(f"{ctx.forward_mode}: {'/'.join(sorted(kinds))}")
    problem = step_problem(engine, world, ctx, outs)
    assert problem is None, f"{problem}\n{describe_step(engine, world, ctx, outs)}"


@given(steps=sglang_sequences())
def test_engine_along_serving_sequences(engine, steps):
    """One server's steps in order on the same dispatchers (captures at start-up, then eager
    and replayed decode, prefill, idle and draft forwards): every step is held to everything
    a single step is, so a file wrong only after a certain history fails with the shortest
    one. The cross-round rows at risk between consecutive A2A rounds are counted (a hazard of
    FlashInfer 0.7.2's layout, in ``--hypothesis-show-statistics``; never a failure)."""
    for world, ctx in steps:
        if any(_allowed(engine, k) and BUG_CLASSES[k].applies(world, ctx)
               for k in RUNTIME_CLASSES):
            reject()  # a runtime bug this pinned release is known to ship (test_releases)
    hazards = check_steps(engine, steps, [k for k in BUGS if not _allowed(engine, k)])
    event(f"{len(steps)} steps, {sum(r is not None for r in hazards)} pairs of A2A rounds")
    if any(r is not None and any(r) for r in hazards):
        event(f"cross-round on FlashInfer {steps[0][0].flashinfer}: rows at risk")
