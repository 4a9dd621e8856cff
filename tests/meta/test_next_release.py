"""The next release is judged, not refused: synthetic next versions of each engine's newest
pinned tree (a new import of an engine module, a FlashInfer keyword renamed, a manager whose
signature changed; SGLang's helpers moved to new modules, a changed helper signature) run
through the gate with the engine's own code beside them, found where the tree's own imports
lead, and ``a2a-gate canary`` says of every release on the index whether it was judged."""
import shutil

import pytest

from .. import needs_torch

pytestmark = [needs_torch(reason="the engines' files need torch"),
              pytest.mark.engine_releases("vllm", "sglang")]

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
    from dispatcher.commands.canary import runs_on
    from dispatcher.model import properties
    from dispatcher.model.generations import using
    from dispatcher.model.world import World
    from dispatcher.policies import load_policy

    generation, why = runs_on(spec)
    assert generation is not None, why
    with using(generation):  # the generation the load probe executes the file against
        policy = load_policy(spec)[1]
    for world in (World(ep_size=4, dp_size=4, group_tokens=(3, 5, 1, 2), max_num_tokens=16),
                  World(ep_size=4, dp_size=2, group_tokens=(5, 9), max_num_tokens=16)):
        world = properties.world_for(policy, world.on(generation))
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
    from dispatcher.commands.canary import runs_on

    tree = _next_tree(tmp_path, {FILE: (
        "        global_num_tokens_cpu = get_local_sizes()\n",
        "        from vllm.distributed import get_pp_group\n        get_pp_group()\n"
        "        global_num_tokens_cpu = get_local_sizes()\n")})
    generation, why = runs_on(f"vllm:{tree}")
    assert generation is None
    assert "vllm.distributed.get_pp_group, which the gate neither runs nor stands in" in why


def test_the_canary_says_what_it_judged_and_fails_only_on_what_it_could_not(monkeypatch, capsys):
    from dispatcher.commands import canary
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


# --- SGLang: the next tree, its helpers found where its own imports lead ---------------------
SGL = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
COMMON = "sglang/srt/utils/common.py"
DP_ATTN = "sglang/srt/managers/scheduler_components/dp_attn.py"
FORWARD = "sglang/srt/model_executor/forward_batch_info.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
GATHER_DEF = "def require_mlp_tp_gather(*, moe_a2a_backend=None):\n"
CAP_DEF = "def flashinfer_a2a_max_dispatch_tokens_per_rank(prefill_buffer_tokens: int) -> int:\n"


def _sglang_tree(tmp_path, edits=None, files=None):
    """The newest pinned SGLang tree as a checkout of its next version, with ``edits`` (file ->
    (old, new), or a list of (file, old, new); each replaced once) and new ``files``."""
    from dispatcher.engines import ENGINES

    sglang = ENGINES["sglang"]
    root = sglang.package().root_of(sglang.package().main_file(sglang.releases[-1])[0])
    tree = tmp_path / "sglang-next"
    shutil.copytree(root / "sglang", tree / "python" / "sglang")
    (tree / "python" / "sglang" / "version.py").write_text('__version__ = "0.5.99"\n')
    edits = [(rel, *pair) for rel, pair in edits.items()] if isinstance(edits, dict) else edits
    for rel, old, new in edits or ():
        path = tree / "python" / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))
    for rel, text in (files or {}).items():
        (tree / "python" / rel).write_text(text)
    return tree


def _cut(tree, rel, head):
    """The top-level function starting with ``head`` cut out of ``rel``: its text."""
    path = tree / "python" / rel
    text = path.read_text()
    start = text.index(head)
    end = text.find("\ndef ", start + 1)
    end = len(text) if end < 0 else end + 1
    path.write_text(text[:start] + text[end:])
    return text[start:end]


def _collapsed(release):
    """The SGLang #27945 step's problem under ``release`` (None: it holds)."""
    from dispatcher.sglang.bug_classes import BUG_CLASSES, step_problem

    _, world, ctx = BUG_CLASSES["collapsed-dp-global"].first_seen
    return step_problem(release, world, ctx, release.step(world, ctx))


def test_sglang_a_new_import_of_an_engine_module_is_simply_run(tmp_path):
    tree = _sglang_tree(tmp_path, {SGL: ("import torch\n", "import torch\n\n"
                                         "from sglang.srt.utils.brand_new_helper import helper\n"
                                         "from sglang.srt.layers.dp_attention import "
                                         "get_attention_dp_size\n")})
    assert _judged(f"sglang:{tree}") == "0.7.2"


def test_sglang_a_helper_moved_is_run_from_where_the_tree_imports_it(tmp_path):
    """``require_mlp_tp_gather`` moved to a new module that the scheduler's gather and the
    forward batch import it from, a stale copy left in ``utils/common.py``: the gate runs the
    one the tree's imports lead to, as Python would. With the #27945 bug in the moved copy the
    tree fails; in the stale copy alone, it passes."""
    base = _sglang_tree(tmp_path / "probe")
    body = _cut(base, COMMON, GATHER_DEF)
    fixed = "from sglang.srt.utils.common import *  # noqa\n\n\n" + body
    end = body.index('"""\n', body.index('"""') + 3) + 4  # after the docstring
    buggy = body[:end] + "    return False  # SGLang #27945\n" + body[end:]
    moves = {DP_ATTN: ("from sglang.srt.utils.common import require_mlp_tp_gather",
                       "from sglang.srt.utils.mlp_gather import require_mlp_tp_gather"),
             FORWARD: ("from sglang.srt.utils.common import require_mlp_tp_gather",
                       "from sglang.srt.utils.mlp_gather import require_mlp_tp_gather")}
    stale = {COMMON: (GATHER_DEF, GATHER_DEF.replace("require_mlp_tp_gather",
                                                     "_stale_gather", 1))}
    good = _sglang_tree(tmp_path / "good", moves, {"sglang/srt/utils/mlp_gather.py": fixed})
    path = good / "python" / COMMON
    path.write_text(path.read_text() + "\n\n" + buggy)  # the stale copy holds the bug
    release = load(f"sglang:{good}")
    assert "require_mlp_tp_gather() from sglang/srt/utils/mlp_gather.py, where " in \
        release.companions.origin
    assert _collapsed(release) is None
    bad = _sglang_tree(tmp_path / "bad", {**moves, **stale},
                       {"sglang/srt/utils/mlp_gather.py": fixed.replace(body, buggy)})
    problem = _collapsed(load(f"sglang:{bad}"))
    assert problem is not None and "raised" in problem, problem


def test_sglang_a_helper_in_two_modules_is_taken_from_the_one_imported(tmp_path):
    """Two modules define the cap derivation; the dispatcher imports it from one: judged (a
    search of the tree alone could not tell which)."""
    probe = _sglang_tree(tmp_path / "probe")
    body = _cut(probe, OVERRIDES, CAP_DEF)
    head = "from sglang.srt.environ import envs\n\n\n"
    tree = _sglang_tree(tmp_path / "tree", {SGL: (
        "from sglang.srt.arg_groups.overrides import", "from sglang.srt.arg_groups.a2a_cap import")},
        {"sglang/srt/arg_groups/a2a_cap.py": head + body,
         "sglang/srt/arg_groups/a2a_cap_old.py": head + body})
    _cut(tree, OVERRIDES, CAP_DEF)
    release = load(f"sglang:{tree}")
    assert "flashinfer_a2a_max_dispatch_tokens_per_rank() from sglang/srt/arg_groups/a2a_cap.py" \
        in release.companions.origin
    assert _judged(f"sglang:{tree}") == "0.7.2"


def test_sglang_a_changed_helper_signature_runs_the_trees_own_helper(tmp_path):
    tree = _sglang_tree(tmp_path, {
        OVERRIDES: (CAP_DEF, "def flashinfer_a2a_max_dispatch_tokens_per_rank(\n"
                             "    prefill_buffer_tokens: int, floor: int = 4096\n) -> int:\n"),
        SGL: ("flashinfer_a2a_max_dispatch_tokens_per_rank(\n            max_prefill_buffer_tokens()\n",
              "flashinfer_a2a_max_dispatch_tokens_per_rank(\n            max_prefill_buffer_tokens(), "
              "floor=4096\n")})
    assert _judged(f"sglang:{tree}") == "0.7.2"


def test_sglang_a_name_the_gate_does_not_run_is_refused_by_name_where_it_is_used(tmp_path):
    """A dispatch() that calls an SGLang function the gate neither runs nor stands in is not
    judged, and never blamed on SGLang: the message names the function."""
    from dispatcher.commands.canary import runs_on

    tree = _sglang_tree(tmp_path, [
        (SGL, "import torch\n", "import torch\n\nfrom sglang.srt.layers.dp_attention import "
                                "get_attention_dp_size\n"),
        (SGL, "        self.runtime_max_tokens_per_rank = ",
         "        get_attention_dp_size()\n        self.runtime_max_tokens_per_rank = ")])
    generation, why = runs_on(f"sglang:{tree}")
    assert generation is None
    assert "sglang.srt.layers.dp_attention.get_attention_dp_size, which the gate neither runs " \
           "nor stands in" in why


def load(spec):
    from dispatcher.policies import load_policy

    return load_policy(spec)[1]
