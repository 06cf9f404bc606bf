"""Generated bAbI-style question answering: stories, a question, a one-word answer and its supporting facts.

After "Towards AI-Complete Question Answering: A Set of Prerequisite Toy Tasks" (Weston et al., 2015,
arXiv:1502.05698), tasks 1, 2 and 7, generated here by simulating a small world (nothing is downloaded):

- ``"single-supporting-fact"`` (qa1): people move between places; "where is mary ?" -> her last place.
- ``"two-supporting-facts"`` (qa2): people also pick up and drop objects; "where is the apple ?" -> the
  place of whoever holds it, or where it was dropped (two facts: the pick-up and the holder's move).
- ``"counting"`` (qa7): "how many objects is john carrying ?" -> ``none``/``one``/``two``/``three``.

Each sample is a list of sentences (lowercase words, no punctuation), a question, an answer word, and the
indices of the supporting sentences. :func:`encode_babi` turns samples into padded id tensors
``stories (N, M, S)``, ``story_mask (N, M)`` (True = real sentence), ``questions (N, S)``, ``answers (N,)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..validators import check_int, check_seed

__all__ = ["BABI_TASKS", "BabiData", "BabiSample", "encode_babi", "generate_babi"]

BABI_TASKS = ("single-supporting-fact", "two-supporting-facts", "counting")
PEOPLE = ("mary", "john", "sandra", "daniel")
PLACES = ("bathroom", "hallway", "kitchen", "garden", "office", "bedroom")
OBJECTS = ("apple", "football", "milk")
MOVES = ("moved to", "went to", "journeyed to", "travelled to")
COUNT_WORDS = ("none", "one", "two", "three")


@dataclass(frozen=True)
class BabiSample:
    story: tuple[str, ...]
    question: str
    answer: str
    supporting: tuple[int, ...]


@dataclass
class BabiData:
    """Encoded samples: ``stories (N, M, S)``, ``story_mask (N, M)``, ``questions (N, S)``, ``answers (N,)``,
    the ``vocab`` (id 0 = ``<pad>``) and the ``samples``."""

    stories: Tensor
    story_mask: Tensor
    questions: Tensor
    answers: Tensor
    vocab: list[str]
    samples: list[BabiSample]


def _sample(task: str, rng: np.random.Generator, max_sentences: int) -> BabiSample:
    where: dict[str, str] = {}
    holder: dict[str, str | None] = {o: None for o in OBJECTS}
    obj_place: dict[str, str | None] = {o: None for o in OBJECTS}
    last_move: dict[str, int] = {}
    last_take: dict[str, int] = {}  # object -> sentence of its last pick-up or drop
    drop_support: dict[str, tuple[int, int]] = {}  # object -> (holder's last move, the drop)
    story: list[str] = []
    n = int(rng.integers(max(2, max_sentences // 2), max_sentences + 1))
    for _ in range(n):
        person = PEOPLE[int(rng.integers(len(PEOPLE)))]
        carried = [o for o in OBJECTS if holder[o] == person]
        # an object nobody dropped yet lies wherever it is picked up (unstated, as in bAbI); a dropped one
        # can only be picked up where it was dropped
        free = [o for o in OBJECTS if holder[o] is None and obj_place[o] in (None, where.get(person))]
        action = "move"
        if task != "single-supporting-fact" and person in where:
            r = rng.random()
            if r < 0.3 and free:
                action = "take"
            elif r < 0.5 and carried:
                action = "drop"
        if action == "move":
            place = PLACES[int(rng.integers(len(PLACES)))]
            where[person] = place
            last_move[person] = len(story)
            story.append(f"{person} {MOVES[int(rng.integers(len(MOVES)))]} the {place}")
        elif action == "take":
            obj = free[int(rng.integers(len(free)))]
            holder[obj], obj_place[obj] = person, None
            last_take[obj] = len(story)
            story.append(f"{person} {('picked up', 'got', 'took')[int(rng.integers(3))]} the {obj}")
        else:
            obj = carried[int(rng.integers(len(carried)))]
            holder[obj], obj_place[obj] = None, where[person]
            last_take[obj] = len(story)
            drop_support[obj] = (last_move[person], len(story))
            story.append(f"{person} {('dropped', 'discarded', 'put down')[int(rng.integers(3))]} the {obj}")
    if task == "single-supporting-fact":
        person = list(where)[int(rng.integers(len(where)))]
        return BabiSample(tuple(story), f"where is {person}", where[person], (last_move[person],))
    if task == "two-supporting-facts":
        touched = [o for o in OBJECTS if o in last_take]
        if not touched:
            return _sample(task, rng, max_sentences)
        obj = touched[int(rng.integers(len(touched)))]
        if holder[obj] is not None:
            person = holder[obj]
            facts = tuple(sorted({last_take[obj], last_move[person]}))
            return BabiSample(tuple(story), f"where is the {obj}", where[person], facts)
        return BabiSample(tuple(story), f"where is the {obj}", obj_place[obj], drop_support[obj])
    if task == "counting":
        handlers = sorted({s.split()[0] for s in story if s.split()[-1] in OBJECTS})
        pool = handlers if handlers and rng.random() < 0.7 else list(where)  # fewer "none" answers
        person = pool[int(rng.integers(len(pool)))]
        carried = [o for o in OBJECTS if holder[o] == person]
        facts = tuple(
            sorted(
                i
                for i, s in enumerate(story)
                if s.startswith(person + " ") and any(s.endswith(" " + o) for o in OBJECTS)
            )
        )
        return BabiSample(
            tuple(story), f"how many objects is {person} carrying", COUNT_WORDS[len(carried)], facts
        )
    raise ValueError(f"task={task!r}; expected one of {BABI_TASKS}")


def generate_babi(task: str, num: int, *, max_sentences: int = 10, seed: int = 0) -> list[BabiSample]:
    """``num`` samples of ``task`` with at most ``max_sentences`` story sentences (at least 2)."""
    if task not in BABI_TASKS:
        raise ValueError(f"task={task!r}; expected one of {BABI_TASKS}")
    check_int(num, f"num={num!r}", "expected a positive number of samples", low=1)
    check_int(max_sentences, f"max_sentences={max_sentences!r}", "expected an integer >= 2", low=2)
    rng = np.random.default_rng(check_seed(seed))  # None would seed from the OS: different samples each call
    return [_sample(task, rng, max_sentences) for _ in range(num)]


def _words() -> list[str]:
    words = set(PEOPLE) | set(PLACES) | set(OBJECTS) | set(COUNT_WORDS)
    for phrase in (
        *MOVES,
        "picked up",
        "got",
        "took",
        "dropped",
        "discarded",
        "put down",
        "the where is how many objects carrying",
    ):
        words |= set(phrase.split())
    return ["<pad>", *sorted(words)]


def encode_babi(
    samples: Sequence[BabiSample], *, memory_size: int | None = None, sentence_len: int = 8
) -> BabiData:
    """Pad to ``memory_size`` sentences (default: the longest story) of ``sentence_len`` words.

    A longer story keeps its last ``memory_size`` sentences, as MemN2N limits its memory to the most recent
    sentences; ``BabiData.samples`` then holds the story as encoded, its supporting indices shifted to the
    rows kept (a fact that was cut is dropped from them, and a warning counts such samples).
    """
    samples = list(samples)
    if not samples:
        raise ValueError("encode_babi got no samples; generate some with generate_babi(task, num)")
    if memory_size is not None:
        check_int(memory_size, f"memory_size={memory_size!r}",
                  "expected a positive number of sentences (or None: the longest story)", low=1)
    check_int(sentence_len, f"sentence_len={sentence_len!r}", "expected a positive number of words", low=1)
    vocab = _words()
    index = {w: i for i, w in enumerate(vocab)}
    M = memory_size if memory_size is not None else max(len(s.story) for s in samples)

    def known(word: str, where: str) -> int:
        if word not in index or index[word] == 0:  # 0 is <pad>: a word of it would read as padding
            raise ValueError(
                f"{where}: {word!r} is not a word of the bAbI vocabulary ({len(vocab) - 1} words: the "
                "generator's people, places, objects, counts and verbs); encode samples from generate_babi"
            )
        return index[word]

    def ids(text: str) -> list[int]:
        words = text.split()
        if len(words) > sentence_len:
            raise ValueError(f"sentence {text!r} has {len(words)} words; raise sentence_len={sentence_len}")
        return [known(w, f"sentence {text!r}") for w in words] + [0] * (sentence_len - len(words))

    for n, s in enumerate(samples):
        bad = [i for i in s.supporting if not (isinstance(i, int) and 0 <= i < len(s.story))]
        if bad:
            raise ValueError(f"sample {n}: supporting fact index(es) {bad} outside its story of "
                             f"{len(s.story)} sentences; expected indices in [0, {len(s.story)})")

    stories = torch.zeros(len(samples), M, sentence_len, dtype=torch.long)
    mask = torch.zeros(len(samples), M, dtype=torch.bool)
    encoded, lost = [], 0
    for n, s in enumerate(samples):
        cut = max(0, len(s.story) - M)
        kept = s.story[cut:]
        for m, sentence in enumerate(kept):
            stories[n, m] = torch.tensor(ids(sentence))
        mask[n, : len(kept)] = True
        if cut:
            supporting = tuple(i - cut for i in s.supporting if i >= cut)
            lost += len(supporting) < len(s.supporting)
            s = BabiSample(tuple(kept), s.question, s.answer, supporting)
        encoded.append(s)
    if lost:
        warnings.warn(
            f"memory_size={M} cut a supporting fact from {lost} of {len(samples)} stories; their answers "
            "may not be in memory (raise memory_size to keep every sentence)",
            stacklevel=2,
        )
    questions = torch.tensor([ids(s.question) for s in samples], dtype=torch.long)
    answers = torch.tensor([known(s.answer, f"sample {n}'s answer") for n, s in enumerate(samples)],
                           dtype=torch.long)
    return BabiData(stories, mask, questions, answers, vocab, encoded)
