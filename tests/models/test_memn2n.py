"""End-to-end memory network: position encoding, masked memory slots, multi-hop training."""

import torch

from attnkit.data.babi import encode_babi, generate_babi
from attnkit.models import MemN2N
from attnkit.models.memn2n import position_encoding_matrix


def test_position_encoding_matches_closed_form():
    pe = position_encoding_matrix(4, 3)
    J, d = 4, 3
    for j in range(1, J + 1):
        for k in range(1, d + 1):
            assert abs(pe[j - 1, k - 1].item() - ((1 - j / J) - (k / d) * (1 - 2 * j / J))) < 1e-6


def test_padded_memory_slots_get_zero_attention_and_do_not_change_the_answer():
    torch.manual_seed(0)
    model = MemN2N(vocab_size=20, dim=8, hops=3, memory_size=10, sentence_len=5)
    stories = torch.randint(1, 20, (2, 6, 5))
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    questions = torch.randint(1, 20, (2, 5))
    logits, att = model(stories, questions, mask)
    assert att.shape == (2, 3, 6)
    assert torch.all(att[0, :, 4:] == 0)
    torch.testing.assert_close(att.sum(-1), torch.ones(2, 3))
    # the content of padded slots is irrelevant, and truncating them gives the same result
    garbage = stories.clone()
    garbage[0, 4:] = torch.randint(1, 20, (2, 5))
    torch.testing.assert_close(model(garbage, questions, mask)[0], logits)
    torch.testing.assert_close(model(stories[:1, :4], questions[:1], mask[:1, :4])[0], logits[:1])
    # an empty story attends nowhere (no NaN)
    empty = model(stories, questions, torch.zeros(2, 6, dtype=torch.bool))
    assert torch.isfinite(empty[0]).all() and torch.all(empty[1] == 0)


def test_tiny_memn2n_learns_single_supporting_fact():
    torch.manual_seed(0)
    data = encode_babi(generate_babi("single-supporting-fact", 600, max_sentences=6, seed=0), memory_size=6)
    test = encode_babi(generate_babi("single-supporting-fact", 200, max_sentences=6, seed=1), memory_size=6)
    model = MemN2N(len(data.vocab), dim=20, hops=1, memory_size=6, sentence_len=8)
    opt = torch.optim.Adam(model.parameters(), 2e-2)
    for step in range(250):
        idx = torch.randint(0, 600, (32,))
        logits, _ = model(data.stories[idx], data.questions[idx], data.story_mask[idx])
        loss = torch.nn.functional.cross_entropy(logits, data.answers[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    logits, _ = model(test.stories, test.questions, test.story_mask)
    assert (logits.argmax(-1) == test.answers).float().mean() > 0.8
