"""End-to-end memory network: position encoding, masked memory slots, multi-hop training."""

import pytest
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


def test_temporal_index_counts_the_real_sentences_after_each_slot():
    """The newest real sentence gets temporal row 0 wherever the padding is: left-padded memory gives
    the same answer as right-padded memory."""
    torch.manual_seed(0)
    model = MemN2N(vocab_size=12, dim=6, hops=2, memory_size=4, sentence_len=2)
    sentences = torch.tensor([[3, 4], [5, 6], [7, 8]])
    pad = torch.zeros(1, 2, dtype=torch.long)
    right = torch.cat([sentences, pad])[None]  # (1, 4, 2)
    left = torch.cat([pad, sentences])[None]
    q = torch.tensor([[9, 10]])
    logits_r, att_r = model(right, q, torch.tensor([[True, True, True, False]]))
    logits_l, att_l = model(left, q, torch.tensor([[False, True, True, True]]))
    torch.testing.assert_close(logits_l, logits_r)
    torch.testing.assert_close(att_l[..., 1:], att_r[..., :3])


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m, s, q, k: m(s + 20, q, k),
            r"a story or question holds ids in \[1, 23\] but the vocabulary has 20",
        ),
        (lambda m, s, q, k: m(s, q - 2, k), r"holds ids in \[-1, "),
        (lambda m, s, q, k: m(s.float(), q, k), r"stories is .* expected a LongTensor \(B, M, S\)"),
        (lambda m, s, q, k: m(s[0], q, k), r"expected a LongTensor \(B, M, S\)"),
        (
            lambda m, s, q, k: MemN2N(10, position_encoding="no"),
            "position_encoding='no': expected True or False",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    model = MemN2N(vocab_size=20, dim=4, hops=2, memory_size=3, sentence_len=2)
    stories = torch.tensor([[[1, 2], [3, 0], [0, 0]]])
    with pytest.raises(ValueError, match=message):
        call(model, stories, torch.tensor([[1, 2]]), torch.tensor([[True, True, False]]))


def test_position_encoding_of_a_float64_model_matches_the_float64_reference():
    """The buffer was built in float32 and cast by .double(): 5.7e-8 off the float64 closed form."""
    model = MemN2N(10, dim=7, sentence_len=6).double()
    J, d = 6, 7
    j = torch.arange(1, J + 1, dtype=torch.float64)[:, None]  # (S, 1)
    k = torch.arange(1, d + 1, dtype=torch.float64)[None]  # (1, d)
    reference = (1 - j / J) - (k / d) * (1 - 2 * j / J)  # (S, d)
    assert model.pe.dtype == torch.float64
    torch.testing.assert_close(model.pe, reference, atol=0.0, rtol=1e-15)
    assert MemN2N(10, dim=7, sentence_len=6).pe.dtype == torch.float32
    no_position = MemN2N(10, dim=7, sentence_len=6, position_encoding=False).double()
    assert torch.equal(no_position.pe, torch.ones(6, 7, dtype=torch.float64))


@pytest.mark.parametrize("args, needle", [((3.5, 4), "sentence_len=3.5"), ((0, 4), "sentence_len=0"),
                                          ((3, 0), "dim=0"), ((3, 4, torch.long), "floating dtype")])
def test_position_encoding_matrix_refuses_sizes_and_dtypes_that_give_no_encoding(args, needle):
    """(3.5, 4) built a (4, 4) matrix with J = 3.5, (0, 4) an empty one, dtype=torch.long all zeros."""
    from attnkit.models.memn2n import position_encoding_matrix

    with pytest.raises(ValueError, match=needle):
        position_encoding_matrix(*args)


@pytest.mark.parametrize("trial", range(8))
def test_hops_match_a_float64_loop_over_the_papers_equations(trial):
    """Eqs. 1-3 of "End-To-End Memory Networks" (arXiv:1503.08895) with adjacent tying (A^{k+1} = C^k,
    W^T = C^K), position and temporal encoding, written as a loop over the real sentences: dropping the
    hop's residual u + o, shifting the temporal index or reading the answer from A^1 passed every test."""
    torch.manual_seed(trial)
    V, d, K, S = 11, (1, 4)[trial % 2], (1, 2, 3)[trial % 3], (1, 3, 5)[trial % 3]
    pe_on, te_on = bool(trial % 2), bool((trial // 2) % 2)
    model = MemN2N(V, dim=d, hops=K, memory_size=6, sentence_len=S, position_encoding=pe_on,
                   temporal_encoding=te_on).double()
    B, M = (1, 3)[trial % 2], (1, 4, 6)[trial % 3]
    stories, questions = torch.randint(0, V, (B, M, S)), torch.randint(0, V, (B, S))
    mask = torch.rand(B, M) < 0.7
    mask[:, 0] |= trial % 5 != 0  # trial 0 and 5: maybe an empty story
    logits, attention = model(stories, questions, mask)
    J = S
    l = torch.ones(J, d, dtype=torch.float64)  # eq. 4's l_kj = (1 - j/J) - (k/d)(1 - 2j/J), or none
    if pe_on:
        l = torch.tensor([[(1 - j / J) - (k / d) * (1 - 2 * j / J) for k in range(1, d + 1)]
                          for j in range(1, J + 1)], dtype=torch.float64)
    E, T = [e.weight for e in model.embed], list(model.temporal)
    for b in range(B):
        real = [i for i in range(M) if mask[b, i]]
        age = {i: sum(j > i for j in real) for i in real}  # 0 for the most recent real sentence
        u = (E[0][questions[b]] * l).sum(0)
        for k in range(K):
            m = {i: (E[k][stories[b, i]] * l).sum(0) + (T[k][age[i]] if te_on else 0) for i in real}
            c = {i: (E[k + 1][stories[b, i]] * l).sum(0) + (T[k + 1][age[i]] if te_on else 0) for i in real}
            o = 0
            if real:
                p = torch.softmax(torch.stack([m[i] @ u for i in real]), 0)
                o = sum(p[j] * c[i] for j, i in enumerate(real))
                torch.testing.assert_close(attention[b, k, real], p, atol=1e-12, rtol=0)
            u = u + o
        torch.testing.assert_close(logits[b], E[K] @ u, atol=1e-12, rtol=0)
