"""The vLLM prepare() under test (``--policy=vllm:...``, else the newest pinned release) on
every world vLLM produces: every property holds, and what vLLM passes is what its manager
was built for (the cap) and what the rows need."""
import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="vLLM's prepare() needs torch: pip install torch==2.13.0 "
                    "(the CPU build) or pip install -e '.[sglang]'")
from hypothesis import event, given  # noqa: E402

from dispatcher.model.properties import check_all, rule_values  # noqa: E402
from dispatcher.model.vllm_world import not_producible  # noqa: E402
from strategies import vllm_worlds  # noqa: E402

from .test_releases import EXPECTED  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("vllm", under_test=True)]


@pytest.fixture(scope="session")
def engine(engine_under_test):
    """The vLLM file under test: the --policy one, else the newest pinned release."""
    return engine_under_test("vllm")[1]


@given(world=vllm_worlds("any"))
def test_engine_on_every_vllm_world(engine, world):
    if not_producible(world, engine.side):
        return
    if "any" in EXPECTED.get(engine.label, ()):
        pytest.skip(f"vLLM {engine.label} is known to fail (docs/vllm.md): test_releases pins it")
    values = rule_values(engine, world, engine.spec)
    check_all(world, values, engine.spec)
    outs = engine.step(world)
    event(f"dp={world.dp_size} tp={world.attn_tp_size}: {outs[0].launch.api}")
    assert {o.launch.max_num_tokens for o in outs} == {world.max_num_tokens}
    if engine.side == "one-sided":
        sent = {o.launch.payload_bytes_per_token for o in outs if world.max_rows}
        assert sent <= {world.moe.dispatch_bytes}, f"payload bytes {sent} != {world.moe.dispatch_bytes}"
