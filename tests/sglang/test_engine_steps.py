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

from dispatcher.sglang.classes import BUG_CLASSES, BUGS, check_step, describe_step  # noqa: E402
from strategies import sglang_steps  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang", under_test=True)]


@pytest.fixture(scope="session")
def engine(engine_under_test):
    """The SGLang file under test: the --policy one, else the newest pinned release."""
    return engine_under_test("sglang")[1]


# The classes whose failure is an unsound launch (what this test checks); the others (the cap
# built, padding marks, tightness) do not change what it sees.
RUNTIME_CLASSES = ("collapsed-dp-global", "cuda-graph-buckets", "all-idle", "extend-over-cap")


def _allowed(engine, key):
    """Classes a pinned release is known to ship are measured in test_releases instead."""
    from .test_releases import EXPECTED_CLASSES

    return key in EXPECTED_CLASSES.get(engine.label, set())


@pytest.mark.parametrize("key", BUGS)
def test_engine_has_no_bug_class(engine, key):
    """Each class's regime, searched for the engine under test (a pinned release's known
    classes are left to test_releases, which expects them). Steps whose server config the
    engine's own checks refuse are none of its steps. Hazards (contexts SGLang's own code does
    not produce) are no test here: ``python -m dispatcher.sglang_verdicts`` reports them in
    the hardening column."""
    if _allowed(engine, key):
        pytest.skip(f"{engine.label} is known to ship {key} (docs/sglang.md): test_releases "
                    f"checks it fails as expected")

    @given(step=sglang_steps(key))
    def run(step):
        problem = check_step(engine, key, *step)
        assert problem is None, problem
    run()


@given(step=sglang_steps("any"))
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
    said = describe_step(engine, world, ctx, outs)
    kinds = {"launch" if o.launch else "around" if o.routed_around else "error" for o in outs}
    event(f"{ctx.forward_mode}: {'/'.join(sorted(kinds))}")
    assert len(kinds) == 1, f"ranks take different paths {sorted(kinds)}: the others hang\n{said}"
    if kinds == {"error"}:
        refused_mode = ctx.skip_all_gather and world.dp_attention and world.ep_size > 1
        assert not world.payload_fits_cap or refused_mode, f"SGLang raised in a valid step\n{said}"
        return
    if kinds == {"around"}:
        return
    values = [o.runtime for o in outs]
    assert len(set(values)) == 1, f"ranks pass different runtimes {values}\n{said}"
    runtime, cap = values[0], outs[0].launch.max_num_tokens
    assert type(runtime) is int and runtime >= 1, f"runtime {runtime!r} is not an int >= 1\n{said}"
    assert runtime <= cap, f"runtime {runtime} over the cap {cap} SGLang built: FlashInfer's " \
                           f"assert crashes the server\n{said}"
    rows = engine.forward_world(world, ctx)  # the replayed buckets, or the padded step
    assert runtime >= rows.max_rows, f"runtime {runtime} < {rows.max_rows} rows: silent " \
                                     f"overflow\n{said}"
