"""The forward batch's DP padding and the decode CUDA-graph runner's bucket run from the release
or tree under test (``dispatcher/sglang/forward.py``): every pinned release's own code gives
SGLang's documented values, an edit there that changes what the dispatcher sees fails the gate
with the function named, and a name the gate does not model stops the run by name."""
import shutil

import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="SGLang's dispatcher needs torch: pip install torch==2.13.0")

from dispatcher.releases.companions import NEWEST_ENV  # noqa: E402
from dispatcher.model.generations import PINNED_RELEASES_GENERATION  # noqa: E402
from dispatcher.model.sglang_context import CAPTURE_SIZES, SGLangContext  # noqa: E402
from dispatcher.model.world import World  # noqa: E402
from dispatcher.policies import load_policy  # noqa: E402
from dispatcher.sglang import fetch, sources  # noqa: E402
from dispatcher.sglang.bug_classes import check_step  # noqa: E402
from dispatcher.sizing import ceil_align  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang")]

NEWEST = sources.RELEASES[-1]
DECODE, EXTEND, REPLAY = SGLangContext(), SGLangContext(forward_mode="extend"), \
    SGLangContext(forward_mode="replay")
DRAFT = SGLangContext(forward_mode="replay", speculative=True, draft_forward=True,
                      tokens_per_req=3)  # its runner counts requests of 3 tokens each


def _release(version):
    return load_policy(f"sglang:{version}")[1]


def _expected_padding(counts, tp, extend):
    """SGLang's rule as its docs and every release state it: each count aligned to attn_tp;
    SUM_LEN on an extend over several DP groups, else MAX_LEN iff sum * 2 >= max * dp."""
    aligned = [ceil_align(n, tp) for n in counts]
    dp = len(aligned)
    max_len = not (extend and dp > 1) and sum(aligned) * 2 >= max(aligned) * dp
    return ([max(aligned)] * dp if max_len else aligned), max_len


# on the worker that loads every release for the property table (loading is most of the cost)
@pytest.mark.xdist_group("sglang-property-table")
@pytest.mark.parametrize("version", sources.RELEASES)
def test_every_release_pads_and_picks_buckets_as_sglang_documents(version):
    release = _release(version)
    sched = release.hooks.scheduler
    assert sched.sources["padding"].startswith(f"{sources.FORWARD_BATCH}:")
    assert "prepare_mlp_sync_batch" in sched.sources["padding"]
    assert any(sched.sources["bucket"].startswith(f"{r}:") for r in sources.DECODE_RUNNERS)
    assert sched.sources["draft_bucket"].startswith(f"{sources.DRAFT_RUNNER}:")
    for counts in ((3, 8), (1, 1, 1, 8), (0, 5), (4, 4)):
        world = World(ep_size=len(counts), dp_size=len(counts), group_tokens=counts,
                      max_num_tokens=64)
        for ctx in (DECODE, EXTEND):
            want, max_len = _expected_padding(counts, 1, ctx is EXTEND)
            got = [sched.padded(world, ctx, g, True) for g in range(len(counts))]
            assert [p.published for p in got] == [want] * len(counts), (version, counts, ctx)
            assert [p.num_tokens for p in got] == want and {p.max_len for p in got} == {max_len}
        # the bucket: the cross-rank max when the MLP gather is required, else its own batch
        shared = min(b for b in CAPTURE_SIZES if b >= max(max(counts), 1))
        for g, n in enumerate(counts):
            own = min(b for b in CAPTURE_SIZES if b >= max(n, 1))
            for runner, ctx in ((sched.runner, DECODE), (sched.draft_runner, DRAFT)):
                assert runner.bucket(ctx, CAPTURE_SIZES, True, n, list(counts)) == shared, \
                    (version, runner.source)
                assert runner.bucket(ctx, CAPTURE_SIZES, False, n, [n]) == own


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A checkout-shaped copy of the newest SGLang release."""
    monkeypatch.delenv(NEWEST_ENV, raising=False)
    root = tmp_path / "sglang"
    cached = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release(NEWEST))
    shutil.copytree(cached / "sglang", root / "python" / "sglang")
    (root / "python" / "sglang" / "version.py").write_text(f'__version__ = "{NEWEST}"\n')
    return root


def _edit(tree, rel, old, new):
    path = tree / "python" / rel
    text = path.read_text()
    assert old in text, f"{rel} of {NEWEST} no longer has the lines this test edits"
    path.write_text(text.replace(old, new))


# made at import: each names the generation SGLang's releases run on, whatever the session's
UNEVEN = World(ep_size=2, dp_size=2, group_tokens=(3, 9), max_num_tokens=64,
               flashinfer=PINNED_RELEASES_GENERATION)
SUM_LEN = World(ep_size=4, dp_size=4, group_tokens=(1, 1, 1, 8), max_num_tokens=64,
                flashinfer=PINNED_RELEASES_GENERATION)


EDITS = {  # an edit of one step: (file, old, new), the step and class it shows in, the words
    # the #30242 shape: the decode runner pads to the rank's own batch although the MLP gather
    # is required, so ranks replay different buckets
    "runner-own-bucket": (
        (sources.DECODE_RUNNERS[0],
         "                max_batch_size = self._max_dp_batch_size(forward_batch)\n"
         "                bs = self._pad_to_bucket(max_batch_size, self.capture_bs)",
         "                bs = self._pad_to_bucket(raw_bs, self.capture_bs)"),
        UNEVEN, REPLAY, "cuda-graph-buckets",
        ("ranks pass different runtimes [4, 12]", "CUDA-graph bucket by "
         "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py:",
         "DecodeCudaGraphRunner.load_batch()")),
    # the same, written one line after the ``if self.require_mlp_tp_gather:`` block (Python
    # runs the re-chosen bucket; a slice that stopped at the block passed it)
    "runner-own-bucket-after-the-block": (
        (sources.DECODE_RUNNERS[0],
         "                bs = self._pad_to_bucket(raw_bs, self.capture_bs)\n"
         "            padded_num_tokens = bs * self.captured_req_width\n",
         "                bs = self._pad_to_bucket(raw_bs, self.capture_bs)\n"
         "            bs = self._pad_to_bucket(raw_bs, self.capture_bs)\n"
         "            padded_num_tokens = bs * self.captured_req_width\n"),
        UNEVEN, REPLAY, "cuda-graph-buckets",
        ("ranks pass different runtimes [4, 12]", "DecodeCudaGraphRunner.load_batch()")),
    "draft-runner-own-bucket": (  # the same in the EAGLE draft runner
        (sources.DRAFT_RUNNER, "bs = self._pad_to_bucket(int(max_batch_size), self.capture_bs)",
         "bs = self._pad_to_bucket(raw_bs, self.capture_bs)"),
        World(ep_size=2, dp_size=2, group_tokens=(9, 27), max_num_tokens=256,
              flashinfer=PINNED_RELEASES_GENERATION), DRAFT,
        "cuda-graph-buckets",
        ("ranks pass different runtimes [12, 36]",
         "a draft's by sglang/srt/speculative/eagle_draft_cuda_graph_runner.py:")),
    "padding-publishes-local-count": (
        (sources.FORWARD_BATCH, "        self.global_num_tokens_padded_cpu = global_num_tokens\n",
         "        self.global_num_tokens_padded_cpu = [num_tokens] * sync_group_size\n"),
        SUM_LEN, DECODE, "collapsed-dp-global",
        ("ranks pass different runtimes [1, 1, 1, 8]",
         "padded by sglang/srt/model_executor/forward_batch_info.py:",
         "ForwardBatch.prepare_mlp_sync_batch()")),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_of_the_padding_or_a_runner_fails_naming_the_function(tree, edit):
    """The unmodified tree passes the step; the edited one fails it, and the counterexample
    names the SGLang function that produced the value."""
    (rel, old, new), world, ctx, key, words = EDITS[edit]
    unmodified = load_policy(f"sglang:{tree}")[1]
    ran = unmodified.step(world, ctx)
    assert all(o.launch for o in ran), ran  # the step is judged, not passed for not running
    assert check_step(unmodified, key, world, ctx) is None
    _edit(tree, rel, old, new)
    problem = check_step(load_policy(f"sglang:{tree}")[1], key, world, ctx)
    assert problem and all(w in problem for w in words), problem


def test_a_padding_that_reads_what_the_gate_does_not_model_stops_by_name(tree):
    _edit(tree, sources.FORWARD_BATCH,
          "        sync_group_size = len(global_num_tokens)\n",
          "        sync_group_size = len(global_num_tokens) + get_new_dp_state().extra\n")
    problem = check_step(load_policy(f"sglang:{tree}")[1], "collapsed-dp-global", SUM_LEN, DECODE)
    assert problem and "get_new_dp_state" in problem and "prepare_mlp_sync_batch" in problem, \
        problem
