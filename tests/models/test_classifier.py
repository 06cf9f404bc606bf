"""TransformerClassifier: shapes, padding invariance, every mechanism trains, a tiny dataset is learned."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.data import WordTokenizer
from attnkit.models import POOLINGS, TransformerClassifier

MECHANISM_CASES = [
    *ak.MECHANISMS,
    ak.Sinkhorn(iters=5),
    ak.Hybrid(u0=0.1),
    ak.CoDA(gate="centered", center_e=True),
]


def _model(mechanism="softmax", pooling="mean", **kw):
    torch.manual_seed(0)
    args = dict(
        vocab_size=40, num_classes=3, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, dropout=0.0
    )
    return TransformerClassifier(**{**args, **kw}, mechanism=mechanism, pooling=pooling)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_logits_shape(pooling):
    ids = torch.randint(1, 40, (4, 9))
    assert _model(pooling=pooling)(ids).shape == (4, 3)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("mechanism", MECHANISM_CASES, ids=str)
def test_padding_equals_each_sequence_alone(mechanism, pooling):
    model = _model(mechanism, pooling).double().eval()
    torch.manual_seed(1)
    a, b = torch.randint(1, 40, (1, 5)), torch.randint(1, 40, (1, 8))
    ids = torch.randint(1, 40, (2, 8))  # padded positions hold real-looking ids: only the mask may hide them
    ids[0, :5], ids[1] = a[0], b[0]
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    with torch.no_grad():
        batched = model(ids, mask)
        alone = torch.cat([model(a), model(b)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "coda"])
def test_left_and_inner_padding_equal_the_sequence_alone(mechanism, pooling):
    """Padding on the left (Hugging Face's padding_side="left") or between tokens moved the real tokens'
    positions: the logits differed by up to 1.2."""
    model = _model(mechanism, pooling).double().eval()
    real = torch.tensor([[5, 6, 7, 8, 9]])
    left = torch.tensor([[0, 0, 5, 6, 7, 8, 9]])
    inner = torch.tensor([[5, 6, 0, 7, 8, 0, 0, 9]])
    with torch.no_grad():
        alone = model(real)
        for ids in (left, inner):
            torch.testing.assert_close(model(ids), alone, rtol=0, atol=1e-10)


def test_positions_given_per_token_are_checked():
    pe = ak.nn.SinusoidalPositionalEncoding(8, max_len=4)
    x = torch.zeros(1, 3, 8)
    torch.testing.assert_close(pe(x, positions=torch.tensor([[0, 0, 1]])), pe.pe[[0, 0, 1]][None])
    for bad, message in ((torch.tensor([[0, 1, 4]]), "outside"), (torch.tensor([[0.0, 1.0, 2.0]]), "integer"),
                         (torch.tensor([[0, 1]]), "shape")):
        with pytest.raises(ValueError, match=message):
            pe(x, positions=bad)


def test_default_mask_is_ids_not_pad():
    model = _model().eval()
    ids = torch.tensor([[5, 6, 7, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids, ids != 0))
        torch.testing.assert_close(model(ids), model(ids[:, :3]), rtol=1e-5, atol=1e-6)


def test_sequence_without_real_tokens_pools_to_zero():
    model = _model().eval()
    with torch.no_grad():
        logits = model(torch.tensor([[0, 0, 0]]), torch.zeros(1, 3, dtype=torch.bool))
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], model.head.bias)


@pytest.mark.parametrize("mechanism", MECHANISM_CASES, ids=str)
def test_every_mechanism_runs_forward_and_backward(mechanism):
    model = _model(mechanism, dropout=0.1).train()
    ids = torch.randint(1, 40, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[2, 3:] = False
    loss = F.cross_entropy(model(ids, mask), torch.tensor([0, 1, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    assert model.embed.embedding.weight.grad.abs().sum() > 0
    assert model.encoder.layers[0].self_attn.in_proj_weight.grad.abs().sum() > 0


def test_mechanism_per_layer():
    model = _model(["softmax", ak.Sinkhorn(iters=4)])
    assert "mechanism=[softmax, Sinkhorn(iters=4)]" in repr(model)
    assert "sinkhorn" in repr(model.encoder.layers[1].self_attn).lower()
    assert "sinkhorn" not in repr(model.encoder.layers[0].self_attn).lower()
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        _model(["softmax", "dnas", "coda"])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.rand(2, 3)), "expected a LongTensor"),
        (lambda m: m(torch.tensor([[1, 40]])), r"ids in \[1, 40\] but the vocabulary has 40"),
        (
            lambda m: m(torch.tensor([[1, 2]]), torch.ones(1, 3, dtype=torch.bool)),
            r"expected a BoolTensor \(B, L\) = \(1, 2\)",
        ),
        (lambda m: m(torch.ones(1, 20, dtype=torch.long)), "max_len=16"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_model(max_len=16))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="pooling='last'"):
        _model(pooling="last")
    with pytest.raises(ValueError, match="unknown attention mechanism 'bogus'"):
        _model("bogus")
    with pytest.raises(ValueError, match="pad_id=50"):
        _model(pad_id=50)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "coda"])
def test_tiny_model_overfits_tiny_dataset(mechanism):
    texts = [
        "good great fine",
        "great movie good",
        "nice good",
        "fine nice great",
        "bad awful poor",
        "awful movie bad",
        "poor bad",
        "terrible awful poor",
    ]
    labels = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])
    tok = WordTokenizer.fit(texts)
    ids, mask = tok.encode(texts, max_length=8)
    torch.manual_seed(0)
    model = TransformerClassifier(
        len(tok), 2, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.0, mechanism=mechanism
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(ids, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 20, losses[::10]
    assert (model.eval()(ids, mask).argmax(-1) == labels).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=0), "d_model=0; expected a positive integer"),
        (dict(d_model=8.0), "d_model=8.0; expected a positive integer"),
        (dict(norm_first="yes"), "norm_first='yes': expected True or False"),
    ],
)
def test_bad_sizes_and_flags_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerClassifier(10, 2, **kwargs)


def test_empty_sequence_is_refused_at_the_boundary():
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 0\): length 0"):
        _model()(torch.zeros(2, 0, dtype=torch.long))
