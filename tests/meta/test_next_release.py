"""The next release is judged, not refused: synthetic next versions of vLLM's newest pinned tree
(a new import of an engine module, a FlashInfer keyword renamed, a manager whose signature
changed) run through the gate with vLLM's own code beside them, and ``a2a-gate canary`` says
of every release on the index whether it was judged."""
import shutil

import pytest

from .. import needs_torch

pytestmark = [needs_torch(reason="vLLM's files need torch"),
              pytest.mark.engine_releases("vllm")]

FILE = "vllm/model_executor/layers/fused_moe/prepare_finalize/flashinfer_nvlink_one_sided.py"
TWO = "vllm/model_executor/layers/fused_moe/prepare_finalize/flashinfer_nvlink_two_sided.py"
ALL2ALL = "vllm/distributed/device_communicators/all2all.py"


def _next_tree(tmp_path, edits):
    """The newest pinned vLLM tree as a checkout, with ``edits`` (file -> (old, new))."""
    from dispatcher.engines import ENGINES

    vllm = ENGINES["vllm"]
    root = vllm.package().root_of(vllm.package().main_file(vllm.releases[-1])[0])
    tree = tmp_path / "vllm-next"
    shutil.copytree(root / "vllm", tree / "vllm")
    for rel, (old, new) in edits.items():
        path = tree / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))
    return tree


def _judged(spec):
    """The generation the release runs on, and its properties on a few steps there."""
    from dispatcher.canary import runs_on
    from dispatcher.model import properties
    from dispatcher.model.generations import using
    from dispatcher.model.world import World
    from dispatcher.policies import load_policy

    generation, why = runs_on(spec)
    assert generation is not None, why
    with using(generation):
        policy = load_policy(spec)[1]
        for world in (World(ep_size=4, dp_size=4, group_tokens=(3, 5, 1, 2), max_num_tokens=16),
                      World(ep_size=4, dp_size=2, group_tokens=(5, 9), max_num_tokens=16)):
            world = properties.world_for(policy, world)
            properties.check_all(world, properties.rule_values(policy, world, spec), spec)
    return generation


def test_a_new_import_of_an_engine_module_is_simply_run(tmp_path):
    tree = _next_tree(tmp_path, {FILE: ("import torch\n", "import torch\n\nfrom vllm.model_executor."
                                        "layers.fused_moe.brand_new_helper import helper\n")})
    assert _judged(f"vllm:{tree}") == "0.7.4"


def test_a_renamed_flashinfer_keyword_is_judged_where_flashinfer_takes_it(tmp_path):
    tree = _next_tree(tmp_path, {FILE: ("runtime_max_tokens_per_rank=self.runtime_max_tokens_per_rank",
                                        "max_tokens_per_rank=self.runtime_max_tokens_per_rank")})
    assert _judged(f"vllm:{tree}") == "0.7.2"  # 0.7.2's moe_ep wrapper calls it so


def test_a_changed_manager_signature_runs_the_releases_own_manager(tmp_path):
    tree = _next_tree(tmp_path, {
        ALL2ALL: ("        hidden_size: int,\n    ) -> \"NVLinkTwoSidedAlltoAll\":",
                  "        hidden_size: int,\n        layer_name: str,\n    ) -> \"NVLinkTwoSidedAlltoAll\":"),
        TWO: ("            hidden_size=hidden_size,\n        )",
              "            hidden_size=hidden_size,\n            layer_name=\"experts\",\n        )")})
    assert _judged(f"vllm:{tree}@two-sided") == "0.7.4"


def test_a_name_the_gate_does_not_run_is_refused_by_name_where_it_is_used(tmp_path):
    """A release that calls a vLLM function the gate neither runs nor stands in is not judged,
    and never blamed on vLLM: the message names the function."""
    from dispatcher.canary import runs_on

    tree = _next_tree(tmp_path, {FILE: (
        "        global_num_tokens_cpu = get_local_sizes()\n",
        "        from vllm.distributed import get_pp_group\n        get_pp_group()\n"
        "        global_num_tokens_cpu = get_local_sizes()\n")})
    generation, why = runs_on(f"vllm:{tree}")
    assert generation is None
    assert "vllm.distributed.get_pp_group, which the gate neither runs nor stands in" in why


def test_the_canary_says_what_it_judged_and_fails_only_on_what_it_could_not(monkeypatch, capsys):
    from dispatcher import canary
    from dispatcher.engines import ENGINES

    newest = {"sglang": ENGINES["sglang"].releases[-1], "vllm": "99.0.0",
              "flashinfer-python": "0.7.4"}
    judged = []

    def judge(spec):
        judged.append(spec)
        return canary.Row("vllm", "99.0.0", "judged", "pass (on FlashInfer 0.7.4)")
    rows = canary.canary(newest=newest.get, judge=judge)
    assert judged == ["vllm:99.0.0"]
    assert [(r.package, r.status) for r in rows] == [
        ("sglang", "up to date"), ("vllm", "judged"), ("flashinfer", "up to date")]
    monkeypatch.setattr(canary, "newest_on_index", {**newest, "flashinfer-python": "0.8.0",
                                                    "vllm": ENGINES["vllm"].releases[-1]}.get)
    assert canary.main([]) == canary.NOT_JUDGED
    out = capsys.readouterr().out
    assert "| flashinfer | 0.8.0 | not judged | FlashInfer 0.8.0:" in out
    assert canary.main(["--release", "pytorch:1.0"]) == 2
