"""``headline-generation`` pieces: headline split, ROUGE against hand-computed values, a tiny training run."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.analysis.repro_headlines import _vocab, headline_pairs, rouge_f1, split_headline, train_headlines


def test_split_headline_uses_the_restated_first_word():
    text = (
        "china signs world bank loan for tianjin port china has signed a mln dlr loan agreement with the bank"
    )
    assert split_headline(text) == (
        "china signs world bank loan for tianjin port",
        "china has signed a mln dlr loan agreement with the bank",
    )
    assert split_headline("no repetition of the first word anywhere in this text at all") is None


def test_rouge_matches_hand_computed_values():
    # unigram overlap 3 of 3 predicted, 3 of 6 reference words: F1 = 2 * 1 * 0.5 / 1.5
    scores = rouge_f1(["the cat sat"], ["the cat sat on the mat"])
    assert scores["rouge1"] == pytest.approx(100 * 2 / 3)
    assert scores["rouge2"] == pytest.approx(100 * 2 * 1 * 0.4 / 1.4)  # bigrams 2 of 2, 2 of 5
    assert rouge_f1(["a b"], ["a b"])["rougeL"] == pytest.approx(100.0)
    with pytest.raises(ValueError):
        rouge_f1([], [])


def test_a_tiny_run_generates_and_records_u():
    texts = [
        f"firm{i % 5} buys stake in unit firm{i % 5} said it bought a stake in a unit for cash today ok"
        for i in range(40)
    ]
    pairs = headline_pairs(texts)
    assert len(pairs) == 40
    rouge, preds, steps, us = train_headlines(
        ak.Hybrid(u0=0.1), pairs, pairs[:4], _vocab(pairs, 100), steps=2, seed=0, batch_size=4, record_every=1
    )
    assert len(preds) == 4 and steps == [0, 1, 2] and us[0].shape == (3, 4)
    assert abs(float(us[0].mean()) - 0.1) < 1e-6 and 0 <= rouge["rougeL"] <= 100


@pytest.mark.parametrize("final, held", [
    ([0.4, 0.45, 0.3], {"favor LNAS": True, "middle layers": True}),
    ([0.6, 0.7, 0.4], {"favor LNAS": False, "middle layers": True}),
    ([0.3, 0.2, 0.4], {"favor LNAS": True, "middle layers": False}),
])
def test_the_fig5_claims_judge_the_final_u_of_each_encoder_layer(final, held, tmp_path, monkeypatch):
    """The Fig. 5 claims read u after training (per layer, mean over heads and seeds); u at step 0 (u0 = 0.1
    everywhere) always passed "u < 0.5" and no test caught reading it there."""
    import types

    import numpy as np

    import attnkit.data
    from attnkit.analysis import repro_headlines
    from attnkit.analysis.report import ReproduceResult

    texts = [f"firm{i % 5} buys stake in unit firm{i % 5} said it bought a stake in a unit" for i in range(8)]
    monkeypatch.setattr(attnkit.data, "load_or_fetch",
                        lambda name: types.SimpleNamespace(train_texts=texts, test_texts=texts))
    trajectory = [np.full((3, 2), 0.1), np.repeat(np.array(final)[:, None], 2, axis=1)]  # (layers, heads)

    def train(mech, *args, **kwargs):
        return {"rouge1": 1.0, "rouge2": 0.5, "rougeL": 1.0}, ["firm0 buys"] * 8, [0, 200], trajectory

    monkeypatch.setattr(repro_headlines, "train_headlines", train)
    result = ReproduceResult(name="headline-generation", out=tmp_path)
    repro_headlines.headline_generation(result, quick=True)
    fig5 = {key: c.held for c in result.claims if c.source == "AEA Fig. 5 / sec. 6.3"
            for key in held if key in c.statement}
    assert fig5 == held
    assert f"final u per encoder layer (bottom to top) {final}" in " ".join(c.evidence for c in result.claims)
