"""``lecture-seq`` claims: single runs are compared by a gap beyond two binomial standard errors of the test
set.

(The end-to-end quick run and the criteria's basic cases are in ``test_reproduce.py``.)"""

from attnkit.analysis import repro_lecture_seq as lecture


def _summary(mlp_err: float, van_err: float, loc_longer: float, content_longer: float, ctc_per: float = 0.2,
             n_test: int = 200, n_longer: int = 100, tokens: int = 1400) -> dict:
    """Rows as ``lecture_seq`` writes them: every other model at 50% error, PER 0.2."""
    out = {}
    for task in ("g2p", "numbers"):
        out[task] = {}
        for m in lecture.MODELS:
            err = {"additive": mlp_err, "vanilla": van_err}.get(m, 0.5)
            acc_longer = {"gmm": loc_longer, "mixed": loc_longer, "additive": content_longer,
                          "dot": content_longer}.get(m, 0.5)
            row = {"sequence_error": err, "token_error": ctc_per if m == "ctc" else 0.2,
                   "seq_error_longer": 1 - acc_longer, "test_examples": n_test, "longer_examples": n_longer,
                   "reference_tokens": tokens}
            out[task][m] = {"row": row, "curve": {1: 0.9, 3: 0.9 if m == "additive" else 0.5}}
    return out


def test_one_test_item_does_not_decide_much_better_or_more_accurate():
    """MLP 50.0% vs vanilla 50.5% sequence error (one item in 200) held "much better", and location 51% vs
    content 50% on 100 longer inputs held "more accurate": a bare comparison of single runs."""
    claims = lecture._claims(_summary(0.500, 0.505, 0.51, 0.50))
    assert not claims[0].held and not claims[2].held
    assert "on 200 test items (within 2 s.e.)" in claims[0].evidence
    assert "on 100 longer test items" in claims[2].evidence
    # a gap of 20 points on 200 items is 4 s.e.: held
    real = lecture._claims(_summary(0.30, 0.50, 0.70, 0.50))
    assert real[0].held and real[2].held
    # one task within the noise is enough to fail "on both tasks"
    mixed = _summary(0.30, 0.50, 0.70, 0.50)
    mixed["numbers"]["additive"]["row"]["sequence_error"] = 0.49
    assert not lecture._claims(mixed)[0].held


def test_ctc_within_one_point_counts_the_noise_against_the_claim():
    """CTC's PER at most 1 point above the best attention model's was a bare comparison; it now needs the
    difference plus two binomial standard errors over the reference phonemes to be at most 1 point."""
    # CTC 0.5 points worse on 1400 phonemes: 2 s.e. = 3.0 points, so "within 1 point" is not shown
    assert not lecture._claims(_summary(0.3, 0.5, 0.7, 0.5, ctc_per=0.205))[3].held
    # the same gap on 100000 phonemes (2 s.e. = 0.36 points): held
    assert lecture._claims(_summary(0.3, 0.5, 0.7, 0.5, ctc_per=0.205, tokens=100_000))[3].held
    # CTC clearly better than the best attention model: held at 1400 phonemes too
    claim = lecture._claims(_summary(0.3, 0.5, 0.7, 0.5, ctc_per=0.15))[3]
    assert claim.held and "1400 reference phonemes" in claim.evidence


def test_quick_note_states_the_measured_errors():
    """The quick run carried no note although every g2p model got 85-97% of the test words wrong."""
    table = [{"task": t, "model": m, "sequence_error": e, "test_examples": 200}
             for t, m, e in (("g2p", "vanilla", 0.97), ("g2p", "gmm", 0.85), ("numbers", "gmm", 0.325),
                             ("numbers", "vanilla", 0.95))]
    note = lecture._quick_note(table, lecture.QUICK)
    assert "g2p 85%-97%" in note and "numbers 32%-95%" in note and "smoke test" in note


def test_ctc_claim_survives_an_error_rate_above_one():
    """A phoneme error rate above 1 (more edits than reference phonemes, an untrained model) made the
    binomial variance negative and its square root complex: a TypeError at the comparison."""
    claim = lecture._claims(_summary(0.3, 0.5, 0.7, 0.5, ctc_per=1.4))[3]
    assert not claim.held


def test_location_claim_without_longer_test_inputs_is_not_held():
    """With no test input longer than the training ones the 2-s.e. rule would divide by zero."""
    assert not lecture._claims(_summary(0.3, 0.5, 0.7, 0.5, n_longer=0))[2].held
