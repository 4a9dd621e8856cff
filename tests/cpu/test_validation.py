"""The dispatcher validates on every rank before launching: right error, actionable message."""
import numpy as np
import pytest
from hypothesis import given

from dispatcher.model import properties
from dispatcher.model.validation import (CAP_ENV, A2ASizingError, CapExceeded, NonPositiveRuntime,
                                         NotAnInteger, PayloadExceedsRuntime, RuntimeDisagreement,
                                         plan, require_int, validate)
from dispatcher.model.world import World
from dispatcher.sizing import ideal_rule
from strategies import worlds


@given(world=worlds())
def test_policy_value_passes_validation_when_a_valid_runtime_exists(world, policy, policy_spec):
    """Whenever every payload fits the cap, the rule's values launch (no sizing error)."""
    world = properties.world_for(policy, world)  # an engine's own world (vLLM)
    values = properties.values_or_reject(policy, world, policy_spec)
    if world.payload_fits_cap:
        runtime = validate(values, world.views, world.generation)
        assert world.max_rows <= runtime <= world.max_num_tokens
    else:
        with pytest.raises(A2ASizingError):
            validate(values, world.views, world.generation)


@given(world=worlds())
def test_no_valid_runtime_raises_cap_exceeded_naming_the_env(world):
    """With the shipped rule, a payload over the cap is CapExceeded naming the cap env."""
    if world.payload_fits_cap:
        assert plan(ideal_rule, world.views, world.generation) == world.ideal_runtime
    else:
        with pytest.raises(CapExceeded, match=CAP_ENV) as info:
            plan(ideal_rule, world.views, world.generation)
        assert f"at least {world.max_rows}" in str(info.value)


@pytest.mark.parametrize("over", [0, 1])
def test_cap_boundary_exact(over):
    """At the cap it launches; one row over it raises CapExceeded."""
    cap = 8
    world = World(ep_size=4, dp_size=2, group_tokens=(2 * (cap + over), 3), max_num_tokens=cap)
    assert world.max_rows == cap + over
    if over:
        with pytest.raises(CapExceeded, match=CAP_ENV):
            plan(ideal_rule, world.views, world.generation)
    else:
        assert plan(ideal_rule, world.views, world.generation) == cap


WORLD = World(ep_size=4, dp_size=2, group_tokens=(6, 2), max_num_tokens=8)  # rows [3,3,1,1]


@pytest.mark.parametrize("values, error, words", [
    ([3, 3, 1, 1], RuntimeDisagreement, "disagree"),
    ([0, 0, 0, 0], NonPositiveRuntime, "max(1"),
    ([2, 2, 2, 2], PayloadExceedsRuntime, "ranks [0, 1]"),
    ([9, 9, 9, 9], CapExceeded, "oversized"),
    ([3.0, 3.0, 3.0, 3.0], NotAnInteger, "must be a Python int"),
    ([True] * 4, NotAnInteger, "must be a Python int"),
    # ints past the 4,300-digit str limit and past a float's range: named, never a crash
    ([10 ** 4000] * 4, CapExceeded, "=<an int of about 4,000 digits> exceeds the workspace cap"),
    ([10 ** 4500] * 4, CapExceeded, "oversized (<an int of about 4,499 digits>x)"),
    ([10 ** 4500, 3, 3, 3], RuntimeDisagreement, "<an int of about 4,500 digits> on ranks [0]"),
    ([-10 ** 4500] * 4, NonPositiveRuntime, "=<an int of about 4,500 digits> but"),
])
def test_each_bad_value_gets_its_own_error(values, error, words):
    with pytest.raises(error) as info:
        validate(values, WORLD.views, WORLD.generation)
    assert words in str(info.value)


def test_errors_are_value_errors_distinct_types():
    kinds = {RuntimeDisagreement, NonPositiveRuntime, CapExceeded, PayloadExceedsRuntime,
             NotAnInteger}
    assert all(issubclass(k, A2ASizingError) and issubclass(k, ValueError) for k in kinds)
    assert len({k.__name__ for k in kinds}) == 5


@pytest.mark.parametrize("value", [3.0, None, "3", True, [3], np.int64(3)])
def test_only_a_python_int_is_a_runtime(value):
    """The runtime's type is decided in one place (``require_int``), for every tier."""
    with pytest.raises(NotAnInteger, match=type(value).__name__):
        require_int(value)
    assert require_int(3) == 3
