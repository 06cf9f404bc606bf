"""``RNNSeq2Seq``: padding = truncation, beam width 1 = greedy, alignments, and a copy model that learns."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import RNNSeq2Seq
from attnkit.models.rnn_seq2seq import ATTENTIONS


def _model(attention: str, cell: str = "gru", seed: int = 0) -> RNNSeq2Seq:
    torch.manual_seed(seed)
    model = RNNSeq2Seq(9, 8, embed_dim=8, hidden_dim=12, cell=cell, attention=attention).double().eval()
    for p in model.parameters():  # sharper random logits: decoding paths differ between models
        p.data.mul_(3.0)
    return model


def _batch():
    src = torch.tensor([[4, 5, 6, 7, 8, 4], [5, 6, 7, 0, 0, 0]])
    return src, src != 0


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_padding_equals_truncation(attention, cell):
    model = _model(attention, cell)
    src, mask = _batch()
    tgt = torch.tensor([[1, 4, 5, 6], [1, 7, 3, 5]])
    logits, weights = model(src, mask, tgt)
    alone, w_alone = model(src[1:, :3], mask[1:, :3], tgt[1:])
    torch.testing.assert_close(logits[1], alone[0], atol=1e-10, rtol=1e-8)
    if attention == "none":
        assert weights is None
    else:
        assert weights.shape == (2, 4, 6)
        torch.testing.assert_close(weights[1, :, :3], w_alone[0], atol=1e-10, rtol=1e-8)
        assert torch.all(weights[1, :, 3:] == 0)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_beam_width_one_equals_greedy(attention):
    model = _model(attention, seed=3)
    src, mask = _batch()
    tokens, align = model.greedy_decode(src, mask, max_len=10)
    beams, beam_aligns = model.beam_search(src, mask, beam_width=1, max_len=10)
    for b in range(2):
        row = tokens[b].tolist()
        row = row[: row.index(model.eos_id) + 1] if model.eos_id in row else row
        assert beams[b] == row
        if align is not None:
            n = int(mask[b].sum())
            torch.testing.assert_close(beam_aligns[b], align[b, : len(row), :n], atol=1e-10, rtol=1e-8)


def test_wider_beam_never_scores_below_greedy():
    model = _model("additive", seed=5)
    src, mask = _batch()

    def logp(b, tokens):
        tgt_in = torch.tensor([[model.bos_id] + tokens[:-1]])
        logits, _ = model(src[b : b + 1, : int(mask[b].sum())], None, tgt_in)
        return float(torch.log_softmax(logits[0].detach(), -1).gather(1, torch.tensor(tokens)[:, None]).sum())

    # (logits[0], -1).gather(1, torch.tensor(tokens)[:, None]).sum())

    greedy, _ = model.beam_search(src, mask, beam_width=1, max_len=12)
    wide, _ = model.beam_search(src, mask, beam_width=5, max_len=12)
    for b in range(2):
        assert logp(b, wide[b]) >= logp(b, greedy[b]) - 1e-9


def test_query_normalized_mechanism_is_refused():
    with pytest.raises(ValueError, match="row-normalized"):
        RNNSeq2Seq(5, 5, attention="dot", mechanism="dnas")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="attention="):
        RNNSeq2Seq(5, 5, attention="luong")
    with pytest.raises(ValueError, match="cell="):
        RNNSeq2Seq(5, 5, cell="rnn")
    with pytest.raises(ValueError, match="even"):
        RNNSeq2Seq(5, 5, hidden_dim=7)
    with pytest.raises(ValueError, match="need three different ids"):  # <bos> was the frozen padding row
        RNNSeq2Seq(5, 5, pad_id=0, bos_id=0, eos_id=2)
    with pytest.raises(ValueError, match="no real token"):
        RNNSeq2Seq(5, 5, hidden_dim=8)(
            torch.zeros(1, 3, dtype=torch.long), None, torch.ones(1, 2, dtype=torch.long)
        )


def test_tiny_copy_model_reaches_exact_held_out_accuracy():
    """Graves' location window (the lecture's monotonic-alignment attention) learns copying in ~100 steps."""
    from attnkit.data.synthetic import generate_synthetic
    from attnkit.data.transduction import TokenVocab

    data = generate_synthetic(
        "copy", num_train=2000, num_test=100, min_len=1, max_len=5, alphabet="abcde", seed=0
    )
    vocab = TokenVocab.fit(data.train_src, "chars")
    src, src_mask = vocab.encode(data.train_src)
    tgt, tgt_mask = vocab.encode(data.train_tgt, add_bos=True, add_eos=True)
    torch.manual_seed(0)
    model = RNNSeq2Seq(vocab.vocab_size, vocab.vocab_size, embed_dim=16, hidden_dim=32, attention="gmm")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        idx = torch.randint(0, len(src), (32,), generator=generator)
        logits, _ = model(src[idx], src_mask[idx], tgt[idx, :-1])
        gold = tgt[idx, 1:].masked_fill(~tgt_mask[idx, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    test_src, test_mask = vocab.encode(data.test_src)
    out, _ = model.greedy_decode(test_src, test_mask, max_len=8)
    preds = ["".join(vocab.decode_ids(row)) for row in out.tolist()]
    assert preds == data.test_tgt


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_empty_batch_runs(attention):
    model = _model(attention)
    src, tgt = torch.zeros(0, 4, dtype=torch.long), torch.ones(0, 3, dtype=torch.long)
    logits, weights = model(src, None, tgt)
    assert logits.shape == (0, 3, 8) and (weights is None or weights.shape == (0, 3, 4))
    tokens, align = model.greedy_decode(src, max_len=3)
    assert tokens.shape == (0, 0) and tokens.dtype == torch.long
    assert align is None or align.shape == (0, 0, 4)


@pytest.mark.parametrize(
    "src, mask",
    [
        (torch.tensor([[4, 0, 5]]), None),  # a pad id inside the source
        (torch.tensor([[0, 4, 5]]), torch.tensor([[False, True, True]])),  # left padding
    ],
)
def test_padding_before_a_real_token_is_refused(src, mask):
    """The packed encoder reads the first ``length`` tokens: any other mask would be read wrongly."""
    model = _model("additive")
    with pytest.raises(ValueError, match="src_mask row 0 has padding before a real token"):
        model(src, mask, torch.tensor([[1, 4]]))
    with pytest.raises(ValueError, match="src_mask row 0 has padding before a real token"):
        model.beam_search(src, mask, beam_width=2, max_len=3)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.tensor([[4, 5]]), None, torch.ones(1, 0, dtype=torch.long)), "length 0"),
        (
            lambda m: m(torch.tensor([[4, 5]]), None, torch.ones(2, 2, dtype=torch.long)),
            "batch 2 but src_ids has 1",
        ),
        (
            lambda m: RNNSeq2Seq(3, 10, pad_id=5),
            r"pad_id=5; expected an id in \[0, src_vocab_size\) = \[0, 3\)",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_model("dot"))


def test_beam_width_one_equals_greedy_for_near_tied_float64_logits():
    """A float64 model was ranked in float32, where logits 1e-9 apart tie: width 1 picked token 4 where
    greedy_decode picked 5."""
    model = _model("additive")
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.bias.zero_()
        model.output.bias[4] = 1.0
        model.output.bias[5] = 1.0 + 1e-9  # the arg-max in float64, a tie with token 4 in float32
    src = torch.tensor([[3, 4, 5]])
    tokens, _ = model.greedy_decode(src, max_len=3)
    beams, _ = model.beam_search(src, beam_width=1, max_len=3)
    assert tokens.tolist() == [[5, 5, 5]] and beams == [[5, 5, 5]]


@pytest.mark.parametrize(
    "tgt, mask",
    [
        (torch.tensor([[0, 1, 4]]), torch.tensor([[False, True, True]])),  # left padding
        (torch.tensor([[1, 4, 5]]), torch.tensor([[True, False, True]])),  # a hole
        (torch.tensor([[1, 0, 5]]), None),  # a pad id inside the target
    ],
)
def test_target_padding_before_a_real_token_is_refused(tgt, mask):
    """The decoder reads the target left to right: a tgt_mask other than right padding was validated and
    then ignored (left padding gave logits 0.046 away from the unpadded target's)."""
    with pytest.raises(ValueError, match="tgt_mask row 0 has padding before a real token; put the real"):
        _model("additive")(torch.tensor([[4, 5, 6]]), None, tgt, mask)


@pytest.mark.parametrize("attention", ["none", "additive", "gmm", "mixed"])
def test_target_right_padding_equals_truncation(attention):
    """A right-padded target (any mask marking its prefix) gives the unpadded target's logits there."""
    model = _model(attention)
    src, src_mask = _batch()
    tgt = torch.tensor([[1, 4, 5, 6], [1, 7, 0, 0]])
    tgt_mask = tgt != 0
    logits, weights = model(src, src_mask, tgt, tgt_mask)
    default, _ = model(src, src_mask, tgt)
    alone, w_alone = model(src[1:, :3], src_mask[1:, :3], tgt[1:, :2])
    torch.testing.assert_close(logits, default, rtol=0, atol=0)
    torch.testing.assert_close(logits[1, :2], alone[0], rtol=1e-12, atol=1e-12)
    if weights is not None:
        torch.testing.assert_close(weights[1, :2, :3], w_alone[0], rtol=1e-12, atol=1e-12)


def test_an_exact_width_beam_finds_the_exhaustive_best_with_its_teacher_forced_alignment():
    """A beam returning an unfinished hypothesis over finished ones (24 of 24 cases below the exhaustive
    best), or another beam's alignment rows (0.08 off teacher forcing), passed every test."""
    import itertools

    V, max_len = 5, 4
    src = torch.tensor([[4, 5, 6, 7, 8, 4], [5, 6, 7, 0, 0, 0]])
    alphabet = [t for t in range(V) if t != 2]  # 2 = <eos>
    for seed in range(6):
        torch.manual_seed(seed)
        model = RNNSeq2Seq(9, V, embed_dim=8, hidden_dim=12, attention="additive").double().eval()
        beams, aligns = model.beam_search(src, beam_width=len(alphabet) ** max_len, max_len=max_len)
        for b in range(2):
            n = int((src[b] != 0).sum())

            def scored(seqs):
                tgt = torch.tensor([[model.bos_id] + s[:-1] for s in seqs])
                logits, w = model(src[b : b + 1, :n].expand(len(seqs), n), None, tgt,
                                  torch.ones_like(tgt, dtype=torch.bool))
                logp = torch.log_softmax(logits, -1).gather(2, torch.tensor(seqs)[:, :, None]).sum((1, 2))
                return logp.detach(), w.detach()

            finished = [[*s, 2] for L in range(max_len) for s in itertools.product(alphabet, repeat=L)]
            best = max(float(scored([s])[0]) for s in finished)
            logp, w = scored([beams[b]])
            assert beams[b][-1] == 2 and float(logp) == pytest.approx(best, abs=1e-9)
            torch.testing.assert_close(aligns[b], w[0], atol=1e-12, rtol=0)


def test_a_narrow_beams_alignment_is_that_of_its_own_hypothesis():
    """Width 3: the returned alignment rows are teacher forcing's on the returned tokens (another beam's rows
    were 0.08 off in 5 of 60 models and passed every test)."""
    for seed in range(20):
        model = _model("additive", seed=seed)
        src = torch.tensor([[4, 5, 6, 7, 8, 4]])
        beams, aligns = model.beam_search(src, beam_width=3, max_len=6)
        tgt = torch.tensor([[model.bos_id] + beams[0][:-1]])
        with torch.no_grad():
            _, w = model(src, None, tgt, torch.ones_like(tgt, dtype=torch.bool))
        torch.testing.assert_close(aligns[0], w[0], atol=1e-12, rtol=0)


def test_greedy_pads_after_eos_and_beam_width_one_breaks_ties_as_greedy():
    """Tokens after a row's <eos> were not pad_id under a mutation no test caught; and a bfloat16 model's
    width-1 beam took the later of two tied logits where greedy's argmax takes the first (2 of 40 models)."""
    model = _model("additive", seed=0)
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.bias.zero_()
        model.output.bias[model.eos_id] = 1.0  # every row ends at once
    tokens, _ = model.greedy_decode(torch.tensor([[4, 5, 6], [5, 6, 0]]), max_len=4)
    assert tokens.tolist() == [[model.eos_id], [model.eos_id]]
    model = _model("additive", seed=17)  # row 1 ends at step 2, row 0 at step 9
    tokens, _ = model.greedy_decode(torch.tensor([[4, 5, 6, 7], [5, 6, 0, 0]]), max_len=12)
    rows = tokens.tolist()
    assert rows[0][-1] == model.eos_id and rows[1][1] == model.eos_id  # the case this test is about
    assert rows[1][2:] == [model.pad_id] * (len(rows[1]) - 2)
    with torch.no_grad():
        model.output.weight.zero_()
        model.output.bias.zero_()
        model.output.bias[4] = model.output.bias[6] = 1.0  # a tie: argmax takes 4
    model = model.to(torch.bfloat16)
    greedy, _ = model.greedy_decode(torch.tensor([[4, 5, 6]]), max_len=3)
    beam, _ = model.beam_search(torch.tensor([[4, 5, 6]]), beam_width=1, max_len=3)
    assert greedy.tolist() == [[4, 4, 4]] and beam == [[4, 4, 4]]


@pytest.mark.parametrize("attention", ["none", "additive", "mixed", "gmm"])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_teacher_forcing_follows_the_decoder_equations_step_by_step(attention, cell):
    """The module docstring's decoder, replayed in float64: s_0 = tanh(W_0 v) (and c_0 = 0 for an LSTM),
    c_i = attend(s_{i-1}, H) (the bottleneck v without attention; the previous step's weights for mixed
    attention, starting on the first source token), s_i = RNNCell([E y_{i-1}; c_i], s_{i-1}),
    logits = W_o tanh(W_h [s_i; c_i; E y_{i-1}]). Dropping the tanh of s_0, c_0 = h, a zero bottleneck or
    mixed attention's location feature never updated passed every test."""
    model = _model(attention, cell, seed=2)
    src, mask = _batch()
    tgt = torch.tensor([[1, 4, 5, 6, 3], [1, 7, 3, 5, 4]])
    logits, _ = model(src, mask, tgt)
    with torch.no_grad():
        enc = model.encode(src, mask)
        H, v = enc["memory"], enc["summary"]
        s = torch.tanh(v @ model.init_state.weight.T + model.init_state.bias)
        c_cell = torch.zeros_like(s)
        kappa = model.attention.initial_kappa(2, dtype=s.dtype) if attention == "gmm" else None
        prev = torch.zeros(2, 6, dtype=torch.float64)  # mixed: all of alpha_0 on the first source token
        prev[:, 0] = 1.0
        expected = []
        for t in range(tgt.shape[1]):
            if attention == "none":
                context = v
            elif attention == "mixed":
                context, prev = model.attention(s, H, prev, key_mask=mask)
            elif attention == "gmm":
                context, _, kappa = model.attention(s, H, kappa, key_mask=mask)
            else:
                context, _ = model.attention(s, H, key_mask=mask)
            e = model.tgt_embed.weight[tgt[:, t]]
            if cell == "lstm":
                s, c_cell = model.decoder(torch.cat([e, context], -1), (s, c_cell))
            else:
                s = model.decoder(torch.cat([e, context], -1), s)
            W_h, b_h = model.pre_output.weight, model.pre_output.bias
            hidden = torch.tanh(torch.cat([s, context, e], -1) @ W_h.T + b_h)
            expected.append(hidden @ model.output.weight.T + model.output.bias)
    torch.testing.assert_close(logits, torch.stack(expected, 1), atol=1e-12, rtol=1e-10)
