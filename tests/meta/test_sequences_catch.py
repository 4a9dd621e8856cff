"""The sequence test can fail, and only it can for a policy wrong after a history: a rule that
bakes the runtime of the first step it sees on a workspace (as a CUDA graph bakes its capture's)
passes every single step on a fresh object and fails the second step of a sequence."""
from dispatcher.model.generations import using
from dispatcher.model.properties import PropertyViolation, broken_columns
from dispatcher.model.sequences import check_sequence
from dispatcher.sizing import RankView, ideal_rule
from strategies import worlds
from strategies.search import assert_no_examples, minimal
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
    assert len(seq) == 2 and seq[1].max_rows > seq[0].max_rows, seq


def _at_risk(seq) -> bool:
    return any(r is not None and any(r) for r in check_sequence(ideal_rule, seq, "ideal_rule"))


def test_the_cross_round_hazard_is_counted_between_rounds():
    """The ideal rule grows the layout with the batch: rows at risk on 0.7.2, none on 0.7.4."""
    with using("0.7.2"):
        seq = minimal(step_sequences(), _at_risk, 500)
        assert seq is not None and len(seq) == 2
        assert check_sequence(ideal_rule, seq[:1]) == ()
    with using("0.7.4"):
        assert_no_examples(step_sequences(), _at_risk, 200)
