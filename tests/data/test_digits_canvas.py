"""Digits canvases: captions match the placed digits; splits are disjoint; clutter keeps the digit."""

import itertools

import pytest
import torch

from attnkit.data.digits_canvas import DIGIT_WORDS, caption_canvases, cluttered_canvases, load_digit_images


def test_caption_is_digit_words_in_reading_order():
    data = caption_canvases(50, rows=2, cols=3, min_digits=2, max_digits=4, seed=3)
    for caption, placed, tokens in zip(data.captions, data.digits, data.tokens):
        slots = [r * 3 + c for _, r, c in placed]
        assert slots == sorted(slots)  # row by row, left to right
        assert caption == " ".join(DIGIT_WORDS[label] for label, _, _ in placed)
        assert data.vocab.decode(tokens) == caption
    assert data.images.shape == (50, 1, 24, 36) and 0 <= data.images.min() and data.images.max() <= 1


def test_each_cell_with_a_digit_has_ink_and_the_others_are_empty():
    data = caption_canvases(20, rows=2, cols=3, cell=12, seed=0)
    for img, placed in zip(data.images, data.digits):
        used = {(r, c) for _, r, c in placed}
        for r in range(2):
            for c in range(3):
                ink = img[0, r * 12 : (r + 1) * 12, c * 12 : (c + 1) * 12].sum()
                assert (ink > 0) == ((r, c) in used)


def test_relations_join_words():
    data = caption_canvases(30, rows=2, cols=2, min_digits=3, max_digits=3, relations=True, seed=1)
    for caption, placed in zip(data.captions, data.digits):
        words = caption.split()
        expected = [DIGIT_WORDS[placed[0][0]]]
        for prev, cur in itertools.pairwise(placed):
            expected += (["left", "of"] if cur[1] == prev[1] else ["above"]) + [DIGIT_WORDS[cur[0]]]
        assert words == expected


def test_splits_are_disjoint_and_bad_arguments_raise():
    tr, _ = load_digit_images("train")
    te, _ = load_digit_images("test")
    assert len(tr) + len(te) == 1797
    with pytest.raises(ValueError, match="split"):
        load_digit_images("val")
    with pytest.raises(ValueError, match="max_digits"):
        caption_canvases(2, rows=1, cols=2, max_digits=3)


def test_cluttered_canvas_holds_the_digit_at_its_centre():
    images, labels, centres = cluttered_canvases(10, size=20, clutter=0, seed=0)
    for img, centre in zip(images, centres):
        y, x = int(centre[0] - 3.5), int(centre[1] - 3.5)
        assert img[0, y : y + 8, x : x + 8].sum() == img.sum() > 0
    assert labels.dtype == torch.long and images.shape == (10, 1, 20, 20)


def test_a_generated_caption_shows_a_pad_or_bos_instead_of_skipping_it():
    """`one <pad> two <bos> <eos>` decoded to "one two" and counted as an exact caption."""
    from attnkit.data.digits_canvas import CaptionVocab

    vocab = CaptionVocab()
    one, two = vocab.words.index("one"), vocab.words.index("two")
    ids = [one, vocab.PAD, two, vocab.BOS, vocab.EOS]
    assert vocab.decode(ids) == "one two"  # a target's padding
    assert vocab.decode(ids, generated=True) == "one \u2205 two \u25b7"


@pytest.mark.parametrize("call, message", [
    (lambda: caption_canvases(-1), "num=-1: expected a positive number of canvases"),  # numpy's message
    (lambda: caption_canvases(2, rows=1.5), "rows=1.5: expected an integer"),
    (lambda: caption_canvases(2, seed=None), r"seed=None; expected an integer in \[0, 2\*\*32 - 1\]"),
    (lambda: cluttered_canvases(-1), "num=-1: expected a positive number of canvases"),  # numpy's message
    (lambda: cluttered_canvases(2, size=12.5), "size=12.5: expected an integer"),
    (lambda: cluttered_canvases(2, seed=None), r"seed=None; expected an integer in \[0, 2\*\*32 - 1\]"),
])
def test_sizes_and_seed_are_checked(call, message):
    """seed=None seeded from the OS (different canvases at every call); a negative num failed in numpy."""
    with pytest.raises(ValueError, match=message):
        call()


def test_same_seed_gives_the_same_canvases():
    a, b = cluttered_canvases(4, size=12, seed=7), cluttered_canvases(4, size=12, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert caption_canvases(4, seed=7).captions == caption_canvases(4, seed=7).captions
