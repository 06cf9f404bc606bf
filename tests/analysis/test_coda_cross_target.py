"""``coda-cross`` pieces on tiny synthetic texts: the pair builder and one short training run."""

from __future__ import annotations

from attnkit.analysis.repro_coda_cross import _vocab, make_topic_pairs, train_pairs


def _texts():
    topics = {
        0: "oil crude barrel opec price",
        1: "shares stock split dividend board",
        2: "wheat grain crop tonnes",
    }
    texts, labels = [], []
    for i in range(60):
        label = i % 3
        texts.append(" ".join((topics[label].split() * 5)[i % 4 : i % 4 + 12]))
        labels.append(label)
    return texts, labels


def test_pairs_are_half_same_topic_and_labels_are_right():
    texts, labels = _texts()
    vocab = _vocab(texts)
    a, b, same = make_topic_pairs(texts, labels, 400, vocab, seed=0, words=8)
    assert a.shape == b.shape == (400, 8) and 0.4 < same.float().mean() < 0.6
    topic_word = {vocab["oil"]: 0, vocab["shares"]: 1, vocab["wheat"]: 2}

    def topic(row):
        return (
            next(topic_word[int(t)] for t in row if int(t) in topic_word)
            if any(int(t) in topic_word for t in row)
            else None
        )

    checked = 0
    for ra, rb, s in zip(a, b, same):
        ta, tb = topic(ra), topic(rb)
        if ta is not None and tb is not None:
            assert (ta == tb) == bool(s)
            checked += 1
    assert checked > 50


def test_a_short_run_returns_an_accuracy():
    texts, labels = _texts()
    vocab = _vocab(texts)
    train = make_topic_pairs(texts, labels, 128, vocab, seed=0, words=8)
    test = make_topic_pairs(texts, labels, 64, vocab, seed=1, words=8)
    acc = train_pairs("coda", train, test, len(vocab) + 2, steps=3, seed=0)
    assert 0.0 <= acc <= 1.0
