"""A replay line is data: every printed world reads back exactly, and nothing else runs."""
import re

import pytest
from hypothesis import given, settings

from dispatcher.model.parse import BadWorld, parse_world
from strategies import moe_configs, worlds


@settings(max_examples=100)
@given(world=worlds(moe=moe_configs))
def test_every_world_reads_back_from_its_repr(world):
    assert parse_world(repr(world)) == world


@pytest.mark.parametrize("text, words", [
    ("__import__('os').system('echo PWNED')", "expected World(...)"),
    ("World(ep_size=__import__('os').getpid(), dp_size=1, group_tokens=(1,), max_num_tokens=1)",
     "only literals"),
    ("World(**{'ep_size': 2})", "** arguments"),
    ("World(2, 1, (1,), 1)", "keyword arguments only"),
    ("World(ep_size=2, dp_size=1, group_tokens=(1,), max_num_tokens=1, moe=dict(top_k=1))",
     "expected MoeConfig"),
    ("World(ep_size=2, dp_size=1", "not a World(...) repr"),
    ("World(ep_size=2, dp_size=3, group_tokens=(1,), max_num_tokens=1)", "must divide"),
    ("World(ep_size=2.0, dp_size=1, group_tokens=(1,), max_num_tokens=1)", "must be an int"),
    ("World(ep_size=2, dp_size=1, group_tokens=[1], max_num_tokens=1)", "tuple of ints"),
    ("World(ep_size=2, dp_size=1, group_tokens=(1,), max_num_tokens=1, color=3)",
     "unexpected keyword"),
    ("World(ep_size=2, dp_size=1, group_tokens=(1,), max_num_tokens=1, moe=MoeConfig(top_k=5))",
     "top_k=5"),
    ("World(" + "x" * 30_000 + ")", "characters"),
])
def test_anything_else_is_a_bad_world_naming_the_problem(text, words):
    with pytest.raises(BadWorld, match=re.escape(words)):
        parse_world(text)
