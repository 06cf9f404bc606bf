"""Seq2SeqTransformer: shapes, causality, source padding, mechanisms, greedy decoding, MLU overfitting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.data import CharTokenizer, MLUConfig, generate_mlu, sequence_accuracy
from attnkit.models import Seq2SeqTransformer

ENCODER_CASES = [*ak.MECHANISMS, ak.Sinkhorn(iters=5), ak.CoDA(gate="centered", center_e=True)]


def _model(**kw):
    torch.manual_seed(0)
    args = dict(
        src_vocab_size=20,
        tgt_vocab_size=15,
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=32,
        dropout=0.0,
        max_len=32,
    )
    return Seq2SeqTransformer(**{**args, **kw})


def test_logits_shape():
    src, tgt = torch.randint(1, 20, (3, 7)), torch.randint(1, 15, (3, 5))
    assert _model()(src, None, tgt, None).shape == (3, 5, 15)


@pytest.mark.parametrize("decoder", ["softmax", "coda"])
def test_decoder_is_causal(decoder):
    model = _model(decoder_mechanism=decoder, cross_mechanism=decoder).double().eval()
    src, tgt = torch.randint(1, 20, (2, 6)), torch.randint(1, 15, (2, 6))
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] % 14) + 1
    with torch.no_grad():
        a, b = model(src, None, tgt, None), model(src, None, changed, None)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-12)
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-6


@pytest.mark.parametrize("encoder", ENCODER_CASES, ids=str)
def test_source_padding_equals_each_source_alone(encoder):
    model = _model(encoder_mechanism=encoder).double().eval()
    torch.manual_seed(2)
    a, b = torch.randint(1, 20, (1, 4)), torch.randint(1, 20, (1, 7))
    src = torch.randint(1, 20, (2, 7))  # padded positions hold real-looking ids: only the mask hides them
    src[0, :4], src[1] = a[0], b[0]
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[0, 4:] = False
    tgt = torch.randint(1, 15, (2, 5))
    with torch.no_grad():
        batched = model(src, src_mask, tgt, None)
        alone = torch.cat([model(a, None, tgt[:1], None), model(b, None, tgt[1:], None)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("encoder", ["softmax", "dnas", "coda"])
def test_left_and_inner_source_padding_equal_the_source_alone(encoder):
    """Padding before or between source tokens moved their positions: the logits differed by up to 0.39."""
    model = _model(encoder_mechanism=encoder).double().eval()
    tgt = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        alone = model(torch.tensor([[5, 6, 7, 8, 9]]), None, tgt, None)
        for src in (torch.tensor([[0, 0, 5, 6, 7, 8, 9]]), torch.tensor([[5, 6, 0, 7, 8, 9]])):
            torch.testing.assert_close(model(src, None, tgt, None), alone, rtol=0, atol=1e-10)


def test_target_padding_leaves_real_positions_unchanged():
    model = _model().double().eval()
    src, tgt = torch.randint(1, 20, (1, 5)), torch.randint(1, 15, (1, 6))
    padded = torch.cat([tgt, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(src, None, padded, None)[:, :6], model(src, None, tgt, None), rtol=0, atol=1e-10
        )


def test_left_and_inner_target_padding_leave_the_real_positions_unchanged():
    """Target positions were numbered by column: padding before or between target tokens moved them (the
    real rows' logits differed by 1.41 and 0.39); they are numbered as the source's now."""
    model = _model().double().eval()
    src, tgt = torch.tensor([[4, 5, 6, 7]]), torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        alone = model(src, None, tgt, None)
        left = model(src, None, torch.tensor([[0, 0, 1, 5, 6, 7]]), None)
        inner = model(src, None, torch.tensor([[1, 5, 0, 6, 7]]), None)
    torch.testing.assert_close(left[:, 2:], alone, rtol=0, atol=1e-10)
    torch.testing.assert_close(inner[:, [0, 1, 3, 4]], alone, rtol=0, atol=1e-10)


def test_greedy_decoding_after_a_generated_pad_equals_teacher_forcing_on_its_output():
    """Greedy decoding attended to a <pad> it generated mid-sequence and numbered it, where teacher forcing on
    the same ids masks it and gives it no position: the next steps' logits differed by 0.62."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, max_len=16).double().eval()
    with torch.no_grad():
        model.generator.bias[model.pad_id] += 1.5  # <pad> now and then
        model.generator.bias[2] -= 100  # never <eos>: the output runs to max_len
    src = torch.tensor([[4, 5, 6, 7]])
    out = model.greedy_decode(src, None, max_len=8, bos_id=1, eos_id=2)  # (1, 8)
    row = out[0].tolist()
    assert 0 in row[:-1] and any(t != 0 for t in row[row.index(0) + 1:])  # a <pad> before real tokens
    with torch.no_grad():
        forced = model(src, None, torch.cat([torch.tensor([[1]]), out[:, :-1]], dim=1))  # (1, 8, V)
    assert forced.argmax(-1)[0].tolist() == row


def test_target_positions_need_a_positional_model():
    model = ak.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=16, batch_first=True, positional=None)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="tgt_positions given but the model has positional=None"):
        model.decode(x, x, tgt_positions=torch.arange(3)[None])


@pytest.mark.parametrize("encoder", ENCODER_CASES, ids=str)
def test_every_encoder_mechanism_runs_forward_and_backward(encoder):
    model = _model(encoder_mechanism=encoder, decoder_mechanism="coda", cross_mechanism="coda", dropout=0.1)
    src, tgt = torch.randint(1, 20, (2, 6)), torch.randint(1, 15, (2, 5))
    logits = model(src, None, tgt[:, :-1], None)
    loss = F.cross_entropy(logits.reshape(-1, 15), tgt[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.src_embed.embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("role", ["decoder_mechanism", "cross_mechanism"])
@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_query_normalized_mechanism_in_decoder_is_refused(role, mechanism):
    with pytest.raises(ValueError, match="not allowed in a decoder"):
        _model(**{role: mechanism})


def test_mechanisms_per_layer_are_reported():
    model = _model(encoder_mechanism=["dnas", "coda"], decoder_mechanism=["softmax", "coda"])
    assert "encoder=[dnas, coda]" in repr(model) and "decoder=[softmax, coda]" in repr(model)
    with pytest.raises(ValueError, match="encoder_mechanism has 1 entries for 2 layers"):
        _model(encoder_mechanism=["dnas"])


def test_greedy_decode_stops_at_eos():
    model = _model().eval()
    eos = 2
    with torch.no_grad():
        model.generator.weight.zero_()
        model.generator.bias.zero_()
        model.generator.bias[eos] = 5.0  # every step prefers <eos>
    out = model.greedy_decode(torch.randint(1, 20, (3, 5)), None, max_len=10, bos_id=1, eos_id=eos)
    assert out.shape == (3, 1) and (out == eos).all()


def test_greedy_decode_respects_max_len_and_validates():
    model = _model().eval()
    with torch.no_grad():
        model.generator.weight.zero_()
        model.generator.bias.zero_()
        model.generator.bias[7] = 5.0  # never <eos>
    out = model.greedy_decode(torch.randint(1, 20, (2, 5)), None, max_len=4, bos_id=1, eos_id=2)
    assert out.shape == (2, 4) and (out == 7).all()
    numpy = pytest.importorskip("numpy")  # a NumPy integer id was refused as out of range
    ids = torch.randint(1, 20, (2, 5))
    assert model.greedy_decode(ids, None, 4, numpy.int64(1), numpy.int64(2)).shape == (2, 4)
    with pytest.raises(ValueError, match="eos_id=15"):
        model.greedy_decode(torch.randint(1, 20, (2, 5)), None, max_len=4, bos_id=1, eos_id=15)
    with pytest.raises(ValueError, match="max_len=40 needs 40 target positions"):
        model.greedy_decode(torch.randint(1, 20, (2, 5)), None, max_len=40, bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match="max_len=33 needs 33 target positions; the model has max_len=32"):
        model.greedy_decode(torch.randint(1, 20, (2, 5)), None, max_len=33, bos_id=1, eos_id=2)
    # as many tokens as the model has positions: the last step reads <bos> and 31 tokens
    full = model.greedy_decode(torch.randint(1, 20, (2, 5)), None, max_len=32, bos_id=1, eos_id=2)
    assert full.shape == (2, 32) and (full == 7).all()


def test_greedy_decode_of_an_empty_batch_decodes_no_token():
    empty = torch.zeros(0, 5, dtype=torch.long)
    out = _model().eval().greedy_decode(empty, None, max_len=4, bos_id=1, eos_id=2)
    assert out.shape == (0, 0) and out.dtype == torch.long


@pytest.mark.parametrize("mechanism", ["softmax", "coda"])
def test_tiny_model_overfits_tiny_mlu(mechanism):
    """16 MLU samples: the loss drops by more than 100x and greedy decoding reproduces every target,
    ending each with <eos> and padding after it (targets have different lengths)."""
    data = generate_mlu(MLUConfig(num_train=16, num_test=0, low=0, high=10, seed=0))
    tok = CharTokenizer()
    src, src_mask = tok.encode(data.train_src)
    tgt, tgt_mask = tok.encode(data.train_tgt, add_bos=True, add_eos=True)
    assert len({len(t) for t in data.train_tgt}) > 1
    torch.manual_seed(0)
    model = Seq2SeqTransformer(
        len(tok),
        len(tok),
        d_model=64,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=128,
        dropout=0.0,
        encoder_mechanism=mechanism,
        decoder_mechanism=mechanism,
        cross_mechanism=mechanism,
        max_len=32,
    )
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(120):
        logits = model(src, src_mask, tgt[:, :-1], tgt_mask[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, len(tok)), tgt[:, 1:].reshape(-1), ignore_index=tok.pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 100, losses[::20]
    out = model.eval().greedy_decode(src, src_mask, max_len=8, bos_id=tok.bos_id, eos_id=tok.eos_id)
    assert sequence_accuracy(tok.decode(out), data.train_tgt) == 1.0
    lengths = torch.tensor([len(t) for t in data.train_tgt])
    assert (out[torch.arange(16), lengths] == tok.eos_id).all()
    after = torch.arange(out.shape[1])[None, :] > lengths[:, None]
    assert (out[after] == tok.pad_id).all()


def test_bad_d_model_raises_a_clear_error():
    with pytest.raises(ValueError, match="d_model=0; expected a positive integer"):
        Seq2SeqTransformer(10, 10, d_model=0)


@pytest.mark.parametrize("bos_id, eos_id", [(0, 2), (1, 0), (1, 1)])
def test_greedy_decode_needs_three_different_special_ids(bos_id, eos_id):
    """bos_id or eos_id equal to pad_id (0), or to each other, decoded without a word (RNNSeq2Seq refused)."""
    with pytest.raises(
        ValueError,
        match=rf"pad_id=0, bos_id={bos_id}, eos_id={eos_id}: the special tokens need three different ids",
    ):
        _model().eval().greedy_decode(torch.randint(1, 20, (2, 5)), None, 4, bos_id, eos_id)


def test_src_mask_defaults_to_ids_not_pad_in_forward_and_greedy_decode():
    """The class docstring says masks default to ``ids != pad_id`` (as RNNSeq2Seq's do), but forward and
    greedy_decode required src_mask: a TypeError for ``model(src, tgt_in_ids=tgt)``."""
    model = _model().eval()
    src = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    tgt = torch.tensor([[1, 3, 4], [1, 5, 0]])
    torch.testing.assert_close(model(src, tgt_in_ids=tgt), model(src, src != 0, tgt))
    assert torch.equal(model.greedy_decode(src, max_len=4, bos_id=1, eos_id=2),
                       model.greedy_decode(src, src != 0, 4, 1, 2))
    with pytest.raises(ValueError, match=r"tgt_in_ids is required \(teacher forcing\); use"):
        model(src)
    # nn.Transformer's order, model(src, tgt): the target went to src_mask and the error did not say so
    with pytest.raises(ValueError, match="the second positional argument is src_mask: pass the target as"):
        model(src, tgt)
    with pytest.raises(ValueError, match="the second positional argument is src_mask"):
        model(src, tgt.tolist())  # an AttributeError ('list' object has no attribute 'dtype')
    with pytest.raises(ValueError, match=r"greedy_decode needs bos_id \(keyword arguments"):
        model.greedy_decode(src, max_len=4, eos_id=2)
    with pytest.raises(ValueError, match=r"greedy_decode needs max_len, bos_id, eos_id"):
        model.greedy_decode(src)  # it said "max_len=None; expected a positive integer"


def test_an_unpadded_source_is_numbered_from_zero_up_to_max_len():
    """Source positions counted from 1 moved the logits by up to 0.04 and refused a source of max_len tokens
    ("positions span 1..8"), which no test ran; the output bias's documented zero start was unchecked."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(20, 15, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0, max_len=8).double().eval()
    assert torch.equal(model.generator.bias, torch.zeros_like(model.generator.bias))
    src = torch.randint(1, 20, (2, 8))  # Ls = max_len
    memory, _ = model.encode(src)
    plain = model.transformer.encode(model.src_embed(src), src_positions=torch.arange(8).expand(2, 8))
    torch.testing.assert_close(memory, plain, atol=1e-12, rtol=1e-10)
    assert model(src, None, torch.randint(1, 15, (2, 4))).shape == (2, 4, 15)
