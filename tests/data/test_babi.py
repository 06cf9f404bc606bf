"""Generated bAbI-style tasks: every answer is what an independent reading of the story implies."""

import re

import pytest

from attnkit.data.babi import BABI_TASKS, COUNT_WORDS, OBJECTS, BabiSample, encode_babi, generate_babi

MOVE = re.compile(r"^(\w+) (?:moved|went|journeyed|travelled) to the (\w+)$")
TAKE = re.compile(r"^(\w+) (?:picked up|got|took) the (\w+)$")
DROP = re.compile(r"^(\w+) (?:dropped|discarded|put down) the (\w+)$")


def _solve(story, question):
    """Replay the story sentence by sentence (a reader independent of the generator)."""
    where, holder, place = {}, {}, {}
    for s in story:
        if m := MOVE.match(s):
            where[m[1]] = m[2]
        elif m := TAKE.match(s):
            holder[m[2]] = m[1]
        elif m := DROP.match(s):
            assert holder.get(m[2]) == m[1], f"{s!r}: dropping an object not held"
            del holder[m[2]]
            place[m[2]] = where[m[1]]
        else:
            raise AssertionError(f"unparsed sentence {s!r}")
    if m := re.match(r"^where is the (\w+)$", question):
        obj = m[1]
        return where[holder[obj]] if obj in holder else place[obj]
    if m := re.match(r"^where is (\w+)$", question):
        return where[m[1]]
    if m := re.match(r"^how many objects is (\w+) carrying$", question):
        return COUNT_WORDS[sum(1 for o in OBJECTS if holder.get(o) == m[1])]
    raise AssertionError(f"unparsed question {question!r}")


@pytest.mark.parametrize("task", BABI_TASKS)
def test_answers_are_implied_by_the_stories(task):
    samples = generate_babi(task, 300, max_sentences=12, seed=5)
    answers = set()
    for s in samples:
        assert _solve(s.story, s.question) == s.answer
        assert all(0 <= i < len(s.story) for i in s.supporting)
        answers.add(s.answer)
    assert len(answers) >= (3 if task == "counting" else 5)  # not a constant answer


def test_supporting_facts_suffice():
    for task in ("single-supporting-fact", "two-supporting-facts"):
        for s in generate_babi(task, 200, seed=2):
            kept = [s.story[i] for i in s.supporting]
            if task == "two-supporting-facts" and "the" in s.question:
                assert len(kept) == 2
            assert s.answer in " ".join(kept)


def test_encoding_pads_and_masks():
    samples = generate_babi("single-supporting-fact", 20, max_sentences=6, seed=0)
    data = encode_babi(samples, memory_size=8)
    assert data.stories.shape == (20, 8, 8)
    for n, s in enumerate(samples):
        assert int(data.story_mask[n].sum()) == len(s.story)
        assert data.stories[n, len(s.story) :].eq(0).all()
        assert data.vocab[int(data.answers[n])] == s.answer
    with pytest.raises(ValueError, match="task="):
        generate_babi("three-supporting-facts", 1)


def test_a_cut_story_keeps_its_last_sentences_and_supporting_rows_point_at_them():
    """Supporting indices counted from the uncut story pointed past the kept rows (15 sentences cut to 8
    kept (11, 12) instead of rows 4 and 5); a fact that was cut is dropped and counted in a warning."""
    samples = generate_babi("two-supporting-facts", 200, max_sentences=20, seed=3)
    with pytest.warns(UserWarning, match=r"cut a supporting fact from \d+ of 200 stories"):
        data = encode_babi(samples, memory_size=8)
    for n, (orig, enc) in enumerate(zip(samples, data.samples)):
        cut = max(0, len(orig.story) - 8)
        assert enc.story == orig.story[cut:]
        assert enc.supporting == tuple(i - cut for i in orig.supporting if i >= cut)
        assert all(0 <= i < int(data.story_mask[n].sum()) for i in enc.supporting)
        for i in enc.supporting:  # the row the index names holds the supporting sentence
            assert enc.story[i] == orig.story[i + cut]


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_size": 0}, "memory_size=0"),
    ({"memory_size": 2.5}, "memory_size=2.5"),
    ({"sentence_len": 0}, "sentence_len=0"),
])
def test_encoding_options_are_checked(kwargs, message):
    samples = generate_babi("counting", 3, seed=0)
    with pytest.raises(ValueError, match=message):
        encode_babi(samples, **kwargs)
    with pytest.raises(ValueError, match="no samples"):
        encode_babi([])


@pytest.mark.parametrize("kwargs, message", [
    ({"num": -3}, "num=-3: expected a positive number of samples"),  # returned []
    ({"num": 2.0}, "num=2.0: expected a positive number of samples"),
    ({"max_sentences": 3.5}, "max_sentences=3.5: expected an integer >= 2"),  # accepted
    ({"max_sentences": True}, "max_sentences=True: expected an integer >= 2"),
    ({"max_sentences": 1}, "max_sentences=1: expected an integer >= 2"),
    ({"seed": None}, r"seed=None; expected an integer in \[0, 2\*\*32 - 1\]"),  # seeded from the OS
])
def test_generation_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_babi("counting", **{"num": 3, **kwargs})


def test_same_seed_gives_the_same_samples():
    assert generate_babi("counting", 20, seed=4) == generate_babi("counting", 20, seed=4)


@pytest.mark.parametrize("sample, message", [
    (BabiSample(("fred went to the kitchen",), "where is fred", "kitchen", (0,)),
     r"sentence 'fred went to the kitchen': 'fred' is not a word of the bAbI vocabulary"),
    (BabiSample(("mary went to the kitchen",), "where is mary", "<pad>", (0,)),
     r"sample 0's answer: '<pad>' is not a word"),
    (BabiSample(("mary went to the kitchen",), "where is mary", "kitchen", (5,)),
     r"sample 0: supporting fact index\(es\) \[5\] outside its story of 1 sentences"),
])
def test_a_sample_the_vocabulary_or_story_cannot_hold_is_refused(sample, message):
    """An unknown word was a KeyError('fred'); an answer '<pad>' became class 0 and a supporting index
    beyond the story was kept, silently."""
    with pytest.raises(ValueError, match=message):
        encode_babi([sample])
