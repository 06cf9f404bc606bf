"""``lecture-visual`` reproduction: BLEU and exact match on known values; the quick run end to end (slow)."""

import json

import pytest

from attnkit.analysis.repro_lecture_visual import corpus_bleu, exact_match


def test_bleu_known_values():
    assert corpus_bleu(["one two three four"], ["one two three four"]) == pytest.approx(100.0)
    # precisions 3/4, 2/3, 1/2 and, for the unmatched 4-gram, sacrebleu's "exp" smoothing 1/(2 * 1):
    # BLEU = 100 * (0.75 * 2/3 * 0.5 * 0.5) ** 0.25 with brevity penalty 1
    expected = 100 * (0.75 * (2 / 3) * 0.5 * 0.5) ** 0.25
    assert corpus_bleu(["one two three five"], ["one two three four"]) == pytest.approx(expected, abs=1e-6)
    # a shorter hypothesis pays the brevity penalty exp(1 - r / c)
    short = corpus_bleu(["one two three"], ["one two three four"])
    assert short < corpus_bleu(["one two three four"], ["one two three four"])


def test_exact_match_counts_whole_captions():
    assert exact_match(["one two", "three"], ["one two", "three four"]) == 0.5


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
    with pytest.raises(FileExistsError, match="--overwrite"):
        reproduce("lecture-visual", tmp_path / "out", quick=True)
