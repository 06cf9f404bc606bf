"""Show-Attend-Tell: shapes, doubly stochastic penalty, decoding, and training of each attention mode."""

import pytest
import torch

from attnkit.data.digits_canvas import caption_canvases
from attnkit.models import ShowAttendTell


@pytest.fixture(scope="module")
def data():
    return caption_canvases(8, rows=1, cols=3, min_digits=1, max_digits=3, seed=0)


def test_shapes_and_alphas_are_distributions(data):
    torch.manual_seed(0)
    model = ShowAttendTell(len(data.vocab), hidden_dim=16, feature_dim=8, embed_dim=8, attention_dim=8)
    logits, alphas, log_probs, _ = model(data.images, data.tokens)
    B, T = data.tokens.shape
    Hf, Wf = model.feature_grid(12, 36)
    assert logits.shape == (B, T, len(data.vocab)) and alphas.shape == (B, T, Hf * Wf)
    torch.testing.assert_close(alphas.sum(-1), torch.ones(B, T))
    assert torch.all(log_probs == 0)  # soft attention makes no choice


def test_doubly_stochastic_penalty_matches_eq_14(data):
    torch.manual_seed(0)
    model = ShowAttendTell(
        len(data.vocab), hidden_dim=16, feature_dim=8, embed_dim=8, attention_dim=8, penalty_weight=0.0
    )
    _, alphas, _, _ = model(data.images, data.tokens)
    valid = (data.tokens != 0).float()[..., None]
    expected = ((1 - (alphas * valid).sum(1)) ** 2).sum(1).mean()
    assert model.loss(data.images, data.tokens).penalty == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("mode", ["soft", "reinforce", "gumbel"])
def test_each_mode_fits_a_tiny_batch_under_fixed_seed(data, mode):
    torch.manual_seed(0)
    model = ShowAttendTell(
        len(data.vocab),
        attention=mode,
        hidden_dim=32,
        feature_dim=16,
        embed_dim=16,
        attention_dim=16,
        penalty_weight=0.0,
    )
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    first = None
    for _ in range(200):
        out = model.loss(data.images, data.tokens)
        first = out.nll if first is None else first
        opt.zero_grad()
        out.total.backward()
        opt.step()
    assert out.nll < 0.3 * first
    if mode == "reinforce":
        assert out.baseline != 0.0 and model.attend.score.w.grad.abs().sum() > 0
    model.eval()
    tokens, _ = model.greedy(data.images, data.tokens.shape[1])
    hyps = [data.vocab.decode(t) for t in tokens]
    if mode != "gumbel":  # straight-through Gumbel learns slower at this budget (nll still falls 3x)
        assert sum(h == r for h, r in zip(hyps, data.captions)) >= 6  # chance is about 1e-3 per caption


def test_beam_search_of_width_one_equals_greedy(data):
    torch.manual_seed(0)
    model = ShowAttendTell(len(data.vocab), hidden_dim=16, feature_dim=8, embed_dim=8, attention_dim=8).eval()
    tokens, alphas = model.greedy(data.images, 4)
    for i in range(3):
        ids, al = model.beam_search(data.images[i], beam=1, max_len=4)
        assert data.vocab.decode(ids) == data.vocab.decode(tokens[i])
        torch.testing.assert_close(al, alphas[i, : len(ids)])
    ids3, _ = model.beam_search(data.images[0], beam=3, max_len=4)
    assert 1 <= len(ids3) <= 4
    with pytest.raises(ValueError, match="attention="):
        ShowAttendTell(10, attention="hardest")


def _small(attention="soft", vocab_size=10):
    torch.manual_seed(0)
    return ShowAttendTell(
        vocab_size, attention=attention, feature_dim=8, embed_dim=8, hidden_dim=8, attention_dim=8
    ).eval()


IMAGES, TOKENS = torch.rand(2, 1, 8, 8), torch.tensor([[3, 4, 2], [5, 2, 0]])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(IMAGES, torch.tensor([[3, 10, 2], [5, 2, 0]])), r"tokens holds ids in \[0, 10\]"),
        (lambda m: m(IMAGES, TOKENS.float()), r"expected a LongTensor \(B, T\)"),
        (lambda m: m(IMAGES, TOKENS[:, :0]), r"tokens \(B, T >= 1\)"),
        (lambda m: m(IMAGES, TOKENS[:1]), "with the same B"),
        (lambda m: m(torch.rand(2, 3, 8, 8), TOKENS), r"expected \(B, C=1, H >= 4, W >= 4\)"),
        (lambda m: m(torch.rand(2, 1, 3, 3), TOKENS), r"expected \(B, C=1, H >= 4, W >= 4\)"),
        (lambda m: m.loss(IMAGES[:0], TOKENS[:0]), r"empty batch \(B=0\)"),
        (lambda m: m.greedy(IMAGES, 0), "max_len=0; expected a positive integer"),
        (lambda m: m.beam_search(IMAGES[0], 2, 0), "max_len=0; expected a positive integer"),
        (lambda m: m.beam_search(IMAGES, 2, 3), r"expected one image \(C, H, W\)"),
        (lambda m: ShowAttendTell(2), "vocab_size=2; expected at least 3"),
        (lambda m: ShowAttendTell(10, penalty_weight=float("nan")), "penalty_weight=nan"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_small())


def test_beam_wider_than_the_vocabulary_keeps_every_word():
    words, alphas = _small(vocab_size=3).beam_search(IMAGES[0], beam=5, max_len=3)
    assert 1 <= len(words) <= 3 and alphas.shape == (len(words), 4)


def test_images_of_another_dtype_are_named(data):
    """float64 images into a float32 model raised torch's "Input type (double) and bias type (float)"."""
    model = ShowAttendTell(len(data.vocab), hidden_dim=8, feature_dim=4, embed_dim=4, attention_dim=4)
    with pytest.raises(ValueError, match=r"images have dtype torch.float64 but ShowAttendTell's parameters "
                       r"are torch.float32; cast the images with .to\(torch.float32\) or the model with"):
        model(data.images.double(), data.tokens)
    logits, _, _, _ = model.double()(data.images.double(), data.tokens)
    assert logits.dtype == torch.float64


@pytest.mark.parametrize("attention", ["soft", "reinforce", "gumbel", "none"])
def test_non_finite_pixels_are_refused(attention):
    """With attention="none" a NaN pixel gave a NaN loss and a caption; the other modes failed on the
    attention scores with a message about key_mask."""
    model = _small(attention)
    for bad in (float("nan"), float("inf")):
        images = IMAGES.clone()
        images[0, 0, 3, 3] = bad
        message = r"images hold NaN or infinite pixels; replace them \(e\.g\. torch\.nan_to_num\) first"
        with pytest.raises(ValueError, match=message):
            model.loss(images, TOKENS)
        with pytest.raises(ValueError, match=message):
            model.greedy(images, 3)
        with pytest.raises(ValueError, match=message):
            model.beam_search(images[0], beam=2, max_len=3)


@pytest.mark.parametrize("attention", ["reinforce", "gumbel"])
def test_hard_attention_decoding_returns_the_location_it_read(attention):
    """In eval a hard model reads the argmax location: greedy and beam_search return that one-hot row (they
    returned the soft alpha, drawn as if the model had looked everywhere), while forward keeps the soft alpha
    that eq. 14 penalizes."""
    model = _small(attention)
    images = torch.rand(2, 1, 16, 16)
    tokens, alphas = model.greedy(images, 3)  # (B, T), (B, T, L)
    assert alphas.shape == (2, 3, 16)
    assert torch.all((alphas == 0) | (alphas == 1)) and torch.all(alphas.sum(-1) == 1)
    a = model.annotations(images)
    h, c = model._init_state(a)
    soft = model.attend(h, a, mode="soft").weights  # (B, L): alpha of the first word
    assert torch.equal(alphas[:, 0].argmax(-1), soft.argmax(-1))
    ids, beam_alphas = model.beam_search(images[0], beam=1, max_len=3)
    assert torch.equal(beam_alphas, alphas[0, : len(ids)])
    _, forward_alphas, _, _ = model(images, tokens.clamp_min(2))
    assert torch.allclose(forward_alphas[:, 0], soft) and bool((forward_alphas < 1).all())


@pytest.mark.parametrize("row", [[3, 0, 4], [0, 5, 2]])
def test_pad_before_a_later_word_is_refused(row):
    """A caption is word ids, <eos>, then <pad>: [3, 0, 4, 2] was scored as 3 words with <pad> fed in."""
    model, tokens = _small(), torch.tensor([[3, 4, 2], row])
    message = r"tokens row 1 has <pad> \(id 0\) before a later word"
    with pytest.raises(ValueError, match=message):
        model.loss(IMAGES, tokens)
    with pytest.raises(ValueError, match=message):
        model(IMAGES, tokens)
    logits, _, _, _ = model(IMAGES, TOKENS)  # padding after <eos> only: accepted
    assert logits.shape == (2, 3, 10)


def test_an_all_pad_caption_is_refused():
    """An all-<pad> row scored nothing (nll 0) and added a constant penalty of L to the batch's mean."""
    model, tokens = _small(), torch.tensor([[3, 4, 2], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"tokens row 1 is all <pad> \(id 0\): an empty caption"):
        model.loss(IMAGES, tokens)
    model.loss(IMAGES, torch.tensor([[3, 4, 2], [2, 0, 0]]))  # <eos> alone: a caption


def test_reset_parameters_resets_the_reinforce_baseline_as_batchnorm_resets_its_statistics():
    """The moving-average baseline kept its value and count through reset_parameters (and, after meta ->
    to_empty -> reset_parameters, whatever memory held became the REINFORCE baseline)."""
    model = ShowAttendTell(10, hidden_dim=16, feature_dim=8, embed_dim=8, attention_dim=8)
    for reward in (torch.tensor([-7.0]), torch.tensor([-8.0])):
        model.baseline.update(reward)
    assert model.baseline.count == 2
    model.reset_parameters()
    assert model.baseline.count == 0 and model.baseline.value == 0
    assert model.baseline.update(torch.tensor([3.0, 5.0])).tolist() == [5.0, 3.0]  # a first batch again
    assert model.baseline.value == 4.0


def _caption_log_prob(model, image, ids) -> float:
    """log p(ids | image) by teacher forcing through ``_step`` (soft attention, as decoding reads)."""
    from attnkit.models.show_attend_tell import BOS

    a = model.annotations(image[None])
    state, prev, total = model._init_state(a), torch.tensor([BOS]), 0.0
    for w in ids:
        logits, state, *_ = model._step(a, prev, state, mode="soft")
        total += torch.log_softmax(logits, -1)[0, w].item()
        prev = torch.tensor([w])
    return total


def test_a_beam_as_wide_as_every_caption_finds_the_most_probable_one_and_beam_three_beats_greedy():
    """Beam search against exhaustive search on a 4-word vocabulary (captions of up to 4 words ending in
    <eos>); sorting the candidates worst-first passed every test (it kept the least probable ones)."""
    import itertools

    from attnkit.models.show_attend_tell import EOS

    for seed in range(6):
        torch.manual_seed(seed)
        model = ShowAttendTell(4, feature_dim=4, embed_dim=3, hidden_dim=5, attention_dim=3).double().eval()
        image = torch.randn(1, 8, 8, dtype=torch.float64)
        captions = [[*body, EOS] for n in range(4) for body in itertools.product((0, 1, 3), repeat=n)]
        best = max(captions, key=lambda ids: _caption_log_prob(model, image, ids))
        assert model.beam_search(image, beam=500, max_len=4)[0] == best, seed
        greedy = [w for w in model.greedy(image[None], 4)[0][0].tolist()]
        greedy = greedy[: greedy.index(EOS) + 1] if EOS in greedy else greedy
        three = model.beam_search(image, beam=3, max_len=4)[0]
        assert _caption_log_prob(model, image, three) >= _caption_log_prob(model, image, greedy) - 1e-12, seed


@pytest.mark.parametrize("attention", ["soft", "none"])
def test_teacher_forcing_matches_the_papers_equations_in_float64(attention):
    """Eqs. 4-7 of "Show, Attend and Tell" (arXiv:1502.03044) with the gate beta = sigmoid(f_beta(h))
    (sec. 4.2.1) and the deep output, as a loop: dropping the gate passed every test."""
    torch.manual_seed(1)
    model = ShowAttendTell(7, attention=attention, feature_dim=5, embed_dim=4, hidden_dim=6,
                           attention_dim=3).double().eval()
    images, tokens = torch.randn(3, 1, 8, 12, dtype=torch.float64), torch.randint(3, 7, (3, 4))
    logits, alphas, _, _ = model(images, tokens)
    a = model.annotations(images)  # (B, L, D)
    B, L, _ = a.shape
    s, mean = model.attend.score, a.mean(1)
    h, c = torch.tanh(model.init_h(mean)), torch.tanh(model.init_c(mean))
    prev = torch.full((B,), 1)  # <bos>
    with torch.no_grad():
        for t in range(4):
            if attention == "none":
                alpha = torch.full((B, L), 1.0 / L, dtype=torch.float64)
            else:  # eq. 4: e = w^T tanh(W_q h + W_k a + b)
                alpha = torch.softmax(torch.tanh((h @ s.w_q.T + s.bias)[:, None, :] + a @ s.w_k.T) @ s.w, -1)
            z = torch.sigmoid(h @ model.gate.weight.T + model.gate.bias) * (alpha[:, :, None] * a).sum(1)
            e = model.embed.weight[prev]
            gates = torch.cat([e, z], -1) @ model.lstm.weight_ih.T + model.lstm.bias_ih \
                + h @ model.lstm.weight_hh.T + model.lstm.bias_hh
            i, f, g, o = gates.chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            deep = e + model.out_h(h) + model.out_z(z)  # eq. 7's L_0 (E y + L_h h + L_z z)
            torch.testing.assert_close(logits[:, t], model.out(deep), atol=1e-12, rtol=0)
            torch.testing.assert_close(alphas[:, t], alpha, atol=1e-12, rtol=0)
            prev = tokens[:, t]


def test_the_logged_baseline_of_the_first_batch_is_its_mean_reward():
    """The first batch's baseline is per sample (leave-one-out); the loss logs their mean, which equals the
    batch's mean reward (one sample's leave-one-out value would not)."""
    torch.manual_seed(0)
    model = ShowAttendTell(10, attention="reinforce", hidden_dim=16, feature_dim=8, embed_dim=8,
                           attention_dim=8)
    images = torch.rand(3, 1, 12, 36)
    tokens = torch.tensor([[3, 4, 2], [5, 2, 0], [6, 7, 2]])
    out = model.loss(images, tokens)
    assert out.baseline == pytest.approx(out.reward)
    assert model.loss(images, tokens).baseline == pytest.approx(out.reward)  # the estimate after batch one
