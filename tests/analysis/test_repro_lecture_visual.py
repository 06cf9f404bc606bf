"""``lecture-visual`` reproduction: BLEU and exact match on known values; the quick run end to end (slow)."""

import json
import math

import pytest

from attnkit.analysis.repro_lecture_visual import corpus_bleu, exact_match, matched_ngrams


def test_bleu_known_values():
    assert corpus_bleu(["one two three four"], ["one two three four"]) == pytest.approx(100.0)
    # precisions 3/4, 2/3, 1/2 and, for the unmatched 4-gram, sacrebleu's "exp" smoothing 1/(2 * 1):
    # BLEU = 100 * (0.75 * 2/3 * 0.5 * 0.5) ** 0.25 with brevity penalty 1
    expected = 100 * (0.75 * (2 / 3) * 0.5 * 0.5) ** 0.25
    assert corpus_bleu(["one two three five"], ["one two three four"], smooth="exp") == pytest.approx(
        expected, abs=1e-6
    )
    # unsmoothed (the default): no matched 4-gram, BLEU-4 0
    assert corpus_bleu(["one two three five"], ["one two three four"]) == 0.0
    assert matched_ngrams(["one two three five"], ["one two three four"]) == [3, 2, 1, 0]
    # a shorter hypothesis pays the brevity penalty exp(1 - r / c): every n-gram of "one two three four"
    # matches the five-word reference (precisions 1), so BLEU = 100 * exp(1 - 5 / 4)
    short = corpus_bleu(["one two three four"], ["one two three four five"])
    assert short == pytest.approx(100 * math.exp(1 - 5 / 4), abs=1e-6)


def test_bleu_reads_captions_split_at_whitespace_only():
    """Tokens are the captions' words as written: "d." is one token (sacrebleu's 13a would split it)."""
    assert corpus_bleu(["a b c d."], ["a b c d ."]) < 90


def test_accuracy_beats_needs_two_standard_errors_of_the_difference():
    from attnkit.analysis.repro_lecture_visual import _beats

    # n = 100: se = sqrt((0.6 * 0.4 + 0.5 * 0.5) / 100) = 0.070, so a gap of 0.10 is 1.4 se, of 0.20 2.9 se
    assert not _beats(0.6, 0.5, 100) and _beats(0.7, 0.5, 100)
    assert not _beats(0.5, 0.7, 100)


def test_exact_match_counts_whole_captions():
    assert exact_match(["one two", "three"], ["one two", "three four"]) == 0.5


def _scores(soft: float, hard: float, ram: float, hops3: float) -> tuple[dict, dict, dict, dict]:
    from attnkit.data.babi import BABI_TASKS

    cap = {m: {"BLEU-4 (greedy)": v, "exact (greedy)": v / 100, "matched n-grams (greedy)": [90, 60, 40, 20]}
           for m, v in (("none", 20.0), ("soft", soft), ("reinforce", hard), ("gumbel", 21.0))}
    cap["pretrain accuracy"] = 0.9
    cap["soft beats none"] = 1.0 if soft > 22 else 0.6  # shares of bootstrap resamples
    cap["hard beats soft"] = 1.0 if hard > soft else 0.1
    cls = {"ram": ram, "cnn": 0.5, "draw": 0.4, "glimpse distance": 3.0, "random distance": 10.0}
    mem = {(t, h): (hops3 if h == 3 else 0.5) for t in BABI_TASKS for h in (1, 3)}
    return cap, cls, mem, {"cls_steps": 60, "batch": 32, "mem_test": 1000}


def test_claims_state_paper_value_ours_and_criterion():
    from attnkit.analysis.repro_lecture_visual import _claims

    claims = _claims(*_scores(soft=24.0, hard=26.0, ram=0.9, hops3=0.9))
    assert [c.held for c in claims] == [True, True, True, True, True]
    assert all(c.paper and c.ours for c in claims)
    assert all(c.criterion == "different" for c in claims)  # digits and generated stories, not MNIST/bAbI
    assert "+2 BLEU" in claims[0].paper and "+4 BLEU" in claims[1].paper
    assert all(c.ours.endswith("1 seed") for c in claims)
    assert "soft 24.0 (+4.0), higher in 100% of paired bootstrap resamples" in claims[0].ours
    failing = _claims(*_scores(soft=19.0, hard=18.0, ram=0.5, hops3=0.5))
    assert [c.held for c in failing] == [False, False, False, True, False]
    assert all(c.paper and c.ours for c in failing)
    # soft one point above none, higher in 60% of the resamples: within the test set's noise, not held
    within_noise = _claims(*_scores(soft=21.0, hard=26.0, ram=0.9, hops3=0.9))
    assert [c.held for c in within_noise][:2] == [False, True]


def test_paired_bootstrap_tells_a_real_bleu_difference_from_noise():
    """One seed of 100 test captions: a BLEU difference of a point flipped the captioning verdict between
    machines; the claims are judged by paired bootstrap resamples of the test captions now."""
    from attnkit.analysis.repro_lecture_visual import _bleu_beats

    refs = [f"{a} {b} {c} {d}" for a, b, c, d in zip("1234567890" * 2, "2345678901" * 2, "3456789012" * 2,
                                                        "4567890123" * 2)]
    perfect = list(refs)
    poor = [r.split()[0] + " 9 9 9" for r in refs]  # one word of four right
    assert _bleu_beats(perfect, poor, refs) == 1.0
    assert _bleu_beats(poor, perfect, refs) == 0.0
    assert _bleu_beats(poor, poor, refs) == 0.0  # never strictly higher than itself
    one_off = list(poor)
    one_off[0] = perfect[0]  # one caption of twenty better: not a difference beyond the noise
    assert 0.5 < _bleu_beats(one_off, poor, refs) < 0.975


def test_bleu_does_not_reward_fewer_four_word_captions_when_no_four_gram_matched():
    """sacrebleu's default "exp" smoothing scored the unmatched 4-gram precision 1 / (2 * total 4-grams):
    with no 4-gram matched, a system emitting fewer 4-word captions scored higher (soft 3.99 vs none 2.72 at
    seed 0) and "soft beats none" held in 99% of resamples. Unsmoothed, both are 0 and neither beats the
    other."""
    from attnkit.analysis.repro_lecture_visual import _bleu_beats

    refs = [f"{a} {b} {c} {d}" for a, b, c, d in zip("1234567890" * 2, "2345678901" * 2, "3456789012" * 2,
                                                        "4567890123" * 2)]
    # both get the first two words of every reference right and nothing after
    long = [r.split()[0] + " " + r.split()[1] + " x x" for r in refs]  # twenty 4-word captions
    short = [r.split()[0] + " " + r.split()[1] + " x" for r in refs]  # none
    short[:2] = long[:2]  # two 4-word captions
    assert matched_ngrams(long, refs)[3] == matched_ngrams(short, refs)[3] == 0
    assert corpus_bleu(short, refs) == corpus_bleu(long, refs) == 0.0
    assert _bleu_beats(short, long, refs) == 0.0


def test_bleu_claims_are_not_held_when_no_four_gram_matched():
    """With no 4-gram matched by either system BLEU-4 ranks nothing, yet "soft beats none" held on a 99%
    bootstrap share of smoothed scores; the verdict is "not held" with the matched counts as evidence."""
    from attnkit.analysis.repro_lecture_visual import _claims

    cap, cls, mem, b = _scores(soft=24.0, hard=26.0, ram=0.9, hops3=0.9)
    for mode, counts in (("none", [47, 6, 0, 0]), ("soft", [62, 6, 0, 0]), ("reinforce", [32, 4, 0, 0])):
        cap[mode]["matched n-grams (greedy)"] = counts
    cap["soft beats none"] = cap["hard beats soft"] = 0.99
    claims = _claims(cap, cls, mem, b)
    assert [c.held for c in claims[:2]] == [False, False]
    assert "not held: no 4-gram matched (BLEU-4 undefined)" in claims[0].evidence
    assert "none [47, 6, 0, 0]" in claims[0].evidence and "soft [62, 6, 0, 0]" in claims[0].evidence
    cap["none"]["matched n-grams (greedy)"] = [60, 20, 5, 1]  # only the baseline matches a 4-gram
    assert not _claims(cap, cls, mem, b)[0].held


@pytest.mark.slow
def test_quick_reproduction_writes_table_claims_and_pictures(tmp_path):
    from attnkit.analysis.reproduce import reproduce

    result = reproduce("lecture-visual", tmp_path / "out", quick=True)
    names = {p.name for p in result.files}
    for picture in (
        "caption_attention_soft.png",
        "caption_attention_hard.png",
        "ram_glimpse_paths.png",
        "draw_classifier_windows.png",
        "draw_reconstructions.png",
        "memn2n_hops1_attention.png",
        "memn2n_hops3_attention.png",
    ):
        assert picture in names
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(summary["rows"]) == 4 + 3 + 1 + 6 and len(summary["claims"]) == 5
    assert all(c["paper"] and c["ours"] for c in summary["claims"])
    # the quick budget says what it cannot show, from its own numbers (D5: the note was empty)
    assert "chance 0.10" in summary["note"] and "distinct greedy captions" in summary["note"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        reproduce("lecture-visual", tmp_path / "out", quick=True)
