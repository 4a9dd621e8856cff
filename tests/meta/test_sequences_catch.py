"""The sequence test can fail, and only it can for a policy wrong after a history: a rule that
bakes the runtime of the first step it sees on a workspace (as a CUDA graph bakes its capture's)
passes every single step on a fresh object and fails the second step of a sequence."""
import pytest

from dispatcher.model.properties import PropertyViolation, broken_columns
from dispatcher.model.sequences import check_sequence, round_pairs
from dispatcher.sizing import RankView, ideal_rule
from strategies import worlds
from strategies.search import assert_no_examples, first_in, minimal, visited
from strategies.sequences import step_sequences


class BakedPerWorkspace:
    """Right on the first step of a workspace (ep_size, cap), then the value it baked there."""

    def __init__(self):
        self.baked = {}

    def __call__(self, view: RankView) -> int:
        return self.baked.setdefault((view.ep_size, view.max_num_tokens), ideal_rule(view))


def _fails(seq) -> bool:
    try:
        check_sequence(BakedPerWorkspace(), seq, "baked")
    except PropertyViolation:
        return True
    return False


def test_a_fresh_baked_rule_passes_every_single_step():
    assert_no_examples(worlds(), lambda w: broken_columns(BakedPerWorkspace(), w), 300)


def test_a_baked_rule_fails_a_sequence_shrunk_to_two_steps():
    seq = minimal(step_sequences(), _fails, 500)
    assert seq is not None, "no sequence catches a rule that bakes its first runtime"
    assert len(seq) == 2 and seq[1].max_rows != seq[0].max_rows, seq  # the baked value is wrong


def _at_risk(seq) -> bool:
    return any(r is not None and any(r) for r in check_sequence(ideal_rule, seq, "ideal_rule"))


def test_the_cross_round_hazard_is_counted_between_rounds():
    """The ideal rule grows the layout with the batch: rows at risk on 0.7.2, between two
    consecutive rounds (that pair alone shows it), none on 0.7.4."""
    seq = first_in(visited(step_sequences(flashinfer="0.7.2"), 300), _at_risk)
    assert seq is not None
    pair = next(p for p in round_pairs(ideal_rule, seq) if any(p.risk))
    assert _at_risk((seq[pair.before], seq[pair.after]))
    assert check_sequence(ideal_rule, seq[:1]) == ()
    assert_no_examples(step_sequences(flashinfer="0.7.4"), _at_risk, 100)


def test_the_cross_round_column_can_say_closed_and_exposed():
    """The verdict tables' search (``cross_round_verdicts.search``): a rule that always passes
    the cap never grows the layout ("closed"), the ideal rule grows it with the batch and is
    shrunk to two rounds; on 0.7.4 the same rule is closed by layout."""
    from dispatcher import cross_round_verdicts as cross_round

    seen = visited(cross_round.one_format("0.7.2"), 150)  # what the release tests' cells visit
    assert cross_round.first_exposed(lambda view: view.max_num_tokens, seen) is None
    found = cross_round.search(ideal_rule, 100, flashinfer="0.7.2")
    assert found.exposed and len(found.example) == 2, found
    assert found.example[1].ideal_runtime > found.example[0].ideal_runtime
    assert "rows at risk on FlashInfer 0.7.2" in found.detail
    assert cross_round.first_exposed(ideal_rule, visited(cross_round.one_format("0.7.4"), 150)
                                     ) is None


KEEP_FIRST = ("            runtime_max_tokens_per_rank = x.shape[0]\n",
              "            runtime_max_tokens_per_rank = x.shape[0]\n"
              "        runtime_max_tokens_per_rank = self.__dict__.setdefault(\n"
              "            '_kept', runtime_max_tokens_per_rank)\n")


@pytest.mark.engine_releases("sglang")
def test_an_sglang_file_that_keeps_its_first_runtime_fails_a_two_step_sequence(tmp_path,
                                                                              monkeypatch):
    """The newest release's ``flashinfer.py``, edited so each dispatcher keeps the runtime of
    the first step it ran: every single step on fresh dispatchers passes, and the serving
    sequence test fails it, shrunk to two steps, with a replay line for the sequence."""
    pytest.importorskip("torch")
    from dispatcher.releases.companions import NEWEST_ENV
    from dispatcher.policies import load_policy
    from dispatcher.sglang import fetch, sources
    from dispatcher.sglang.bug_classes import BUGS
    from dispatcher.sglang.sequences import SequenceFailure, check_steps
    from strategies import sglang_sequences, sglang_steps
    from strategies.search import visited

    monkeypatch.setenv(NEWEST_ENV, "1")  # a lone file: the newest release's companions
    newest = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release(sources.RELEASES[-1]))
    text = (newest / "sglang/srt/layers/moe/token_dispatcher/flashinfer.py").read_text()
    assert KEEP_FIRST[0] in text, "the newest flashinfer.py no longer has the line this edits"
    (tmp_path / "flashinfer.py").write_text(text.replace(*KEEP_FIRST))
    release = load_policy(f"sglang:{tmp_path / 'flashinfer.py'}")[1]

    def fails(steps) -> bool:
        release._instances.clear()  # fresh dispatchers: a server starting
        try:
            check_steps(release, steps, BUGS)
        except SequenceFailure:
            return True
        return False

    assert not any(fails([step]) for step in visited(sglang_steps(), 150))
    steps = minimal(sglang_sequences(), fails, 500)
    assert steps is not None and len(steps) == 2, steps
    release._instances.clear()
    with pytest.raises(SequenceFailure, match="at step 2 of 2") as failure:
        check_steps(release, steps, BUGS)
    assert "replay the sequence: python -m dispatcher" in str(failure.value)
