"""Transformer layers, stacks and the encoder-decoder: torch equivalence with softmax, padding, causality,
the decoder's refusal of query-normalized mechanisms, per-layer mechanisms and argument checks."""

from __future__ import annotations

import re

import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn

D, NH, FF = 8, 2, 16
MECHANISMS = ["softmax", "dnas", "hnas", "sinkhorn", "coda", ak.CoDA(gate="centered", center_e=True)]
F64 = {"dtype": torch.float64}


def _x(B, L, seed=0):
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pad(lengths, L):
    return torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]  # (B, L) True = padding


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_softmax_encoder_layer_matches_torch(norm_first, activation):
    torch.manual_seed(0)
    kwargs = dict(
        dim_feedforward=FF, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first
    )
    theirs = torch.nn.TransformerEncoderLayer(D, NH, **kwargs, **F64).eval()
    ours = aknn.TransformerEncoderLayer(D, NH, **kwargs, **F64).eval()
    ours.load_state_dict(theirs.state_dict())
    x, pad = _x(3, 5), _pad([5, 3, 4], 5)
    src_mask = torch.zeros(5, 5, dtype=torch.bool)
    src_mask[:, 1] = True
    src_mask[1, 0] = False
    for masks in ({}, {"src_key_padding_mask": pad}, {"src_key_padding_mask": pad, "src_mask": src_mask}):
        expected = theirs(x, **masks)
        got = ours(x, **masks)
        real = ~pad[..., None] if masks else torch.ones(1, 1, 1, dtype=torch.bool)
        torch.testing.assert_close(got * real, expected * real, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True])
def test_softmax_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(0)
    kwargs = dict(dim_feedforward=FF, dropout=0.1, batch_first=True, norm_first=norm_first)
    theirs = torch.nn.TransformerDecoderLayer(D, NH, **kwargs, **F64).eval()
    ours = aknn.TransformerDecoderLayer(D, NH, **kwargs, **F64).eval()
    ours.load_state_dict(theirs.state_dict())
    tgt, memory = _x(2, 4, seed=1), _x(2, 6, seed=2)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    mem_pad = _pad([6, 3], 6)
    expected = theirs(tgt, memory, tgt_mask=causal, memory_key_padding_mask=mem_pad, tgt_is_causal=True)
    got = ours(tgt, memory, tgt_mask=causal, memory_key_padding_mask=mem_pad, tgt_is_causal=True)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    got_hint_only = ours(tgt, memory, memory_key_padding_mask=mem_pad, tgt_is_causal=True)
    torch.testing.assert_close(got_hint_only, expected, rtol=1e-10, atol=1e-12)


def test_softmax_stacks_and_transformer_match_torch():
    torch.manual_seed(0)
    theirs = torch.nn.Transformer(D, NH, 2, 2, FF, dropout=0.1, batch_first=True, **F64).eval()
    ours = aknn.Transformer(
        D, NH, 2, 2, FF, dropout=0.1, encoder_mechanism="softmax", positional=None, batch_first=True, **F64
    ).eval()
    ours.load_state_dict(theirs.state_dict())
    src, tgt = _x(2, 6, seed=3), _x(2, 4, seed=4)
    src_pad = _pad([6, 4], 6)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    expected = theirs(
        src,
        tgt,
        tgt_mask=causal,
        src_key_padding_mask=src_pad,
        memory_key_padding_mask=src_pad,
        tgt_is_causal=True,
    )
    got = ours(src, tgt, src_key_padding_mask=src_pad)  # causal decoder and memory padding by default
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_torch_transformer_state_dict_loads_into_hnas_encoder_whose_theta_keeps_u0():
    theirs = torch.nn.Transformer(D, NH, 3, 1, FF, batch_first=True)
    ours = aknn.Transformer(D, NH, 3, 1, FF, encoder_mechanism="hnas", positional="sinusoidal")
    result = ours.load_state_dict(theirs.state_dict())  # strict
    assert result.unexpected_keys == [] and result.missing_keys == []
    for i in range(3):
        torch.testing.assert_close(ours.encoder.layers[i].self_attn.u, torch.full((NH,), 0.5))


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=str)
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_padding_equals_truncation(mechanism, norm_first, backend):
    torch.manual_seed(0)
    layer = aknn.TransformerEncoderLayer(
        D, NH, FF, mechanism=mechanism, norm_first=norm_first, backend=backend, batch_first=True, **F64
    ).eval()
    lengths = [5, 2, 3]
    x, pad = _x(3, 5, seed=5), _pad(lengths, 5)
    out = layer(x, src_key_padding_mask=pad)
    for b, n in enumerate(lengths):
        alone = layer(x[b : b + 1, :n])
        torch.testing.assert_close(out[b : b + 1, :n], alone, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", ak.Sinkhorn(iters=2)], ids=str)
@pytest.mark.parametrize("form", ["bool (B*H, L, L)", "float (B*H, L, L)"])
def test_padding_given_as_an_attn_mask_alone_equals_truncation(mechanism, form, backend):
    """Padding passed only as an attn_mask that hides the padded keys from every query (torch accepts it):
    the padded queries stayed in the column sums of dnas / hnas / sinkhorn, 0.11-0.23 off the sequence run
    alone (key_padding_mask, and converted models, which infer it from such a mask, were exact)."""
    torch.manual_seed(0)
    layer = aknn.TransformerEncoderLayer(D, NH, FF, mechanism=mechanism, backend=backend, batch_first=True,
                                         **F64).eval()
    lengths = [5, 2, 3]
    x, pad = _x(3, 5, seed=5), _pad(lengths, 5)  # pad: (B, L) True = padded
    hidden = pad[:, None, None, :].expand(3, NH, 5, 5).reshape(3 * NH, 5, 5)  # (B*H, L, L) True = not allowed
    mask = {"bool (B*H, L, L)": hidden,
            "float (B*H, L, L)": torch.zeros(hidden.shape, **F64).masked_fill(hidden, float("-inf"))}[form]
    out = layer(x, src_mask=mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b : b + 1, :n], layer(x[b : b + 1, :n]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", ak.Sinkhorn(iters=2), "softmax"], ids=str)
@pytest.mark.parametrize("form", ["(L, L) hiding key 0", "(B*H, L, L) hiding key 0 and one pair"])
def test_a_structural_mask_that_hides_a_key_from_every_query_keeps_that_query(mechanism, form):
    """Only a per-example mask in a key padding mask's form is read as padding: a real query whose own key a
    structural mask hides from everyone (a BOS key hidden, rows not alike) stays a query, as with the same
    call made as cross-attention (its output row was zeroed and the other rows moved by up to 0.08)."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(D, NH, mechanism=mechanism, batch_first=True, **F64).eval()
    x = _x(2, 5, seed=3)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[:, 0] = True  # key 0 hidden from every query
    if form.startswith("(B*H"):
        mask = mask.expand(2 * NH, 5, 5).clone()
        mask[:, 2, 3] = True  # one more pair: the rows are not alike
    self_out = module(x, x, x, attn_mask=mask)[0]
    cross_out = module(x, x.clone(), x.clone(), attn_mask=mask)[0]  # never read as self-attention
    torch.testing.assert_close(self_out, cross_out, atol=1e-12, rtol=0)
    assert self_out[:, 0].abs().max() > 0


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", ak.Sinkhorn(iters=2)], ids=str)
def test_decoder_refuses_query_normalized_self_attention(mechanism):
    with pytest.raises(ValueError, match="self_mechanism=.*future-token leak"):
        aknn.TransformerDecoderLayer(D, NH, self_mechanism=mechanism)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_decoder_refuses_query_normalized_cross_attention(mechanism):
    with pytest.raises(ValueError, match="cross_mechanism=.*teacher forcing"):
        aknn.TransformerDecoderLayer(D, NH, cross_mechanism=mechanism)
    with pytest.raises(ValueError, match="cross_mechanism"):
        aknn.Transformer(D, NH, 1, 1, FF, cross_mechanism=mechanism)


@pytest.mark.parametrize("role", ["self_mechanism", "cross_mechanism"])
@pytest.mark.parametrize("mechanism", [ak.CoDA(gate="centered"), ak.CoDA(center_e=True)], ids=str)
def test_decoder_refuses_coda_with_global_means(role, mechanism):
    """Centered CoDA cross-attention was accepted: its means over every (query, key) pair mix in later
    target positions (changing the last target token moved position 0's output by 1.4e-2)."""
    with pytest.raises(ValueError, match=f"{role}=.*subtracts means over every.*future-token leak"):
        aknn.TransformerDecoderLayer(D, NH, **{role: mechanism})
    with pytest.raises(ValueError, match=role):
        arg = "decoder_mechanism" if role == "self_mechanism" else role
        aknn.Transformer(D, NH, 1, 1, FF, **{arg: mechanism})


def test_coda_decoder_is_allowed_and_causal():
    torch.manual_seed(0)
    model = aknn.Transformer(
        D, NH, 1, 2, FF, decoder_mechanism="coda", cross_mechanism="coda", batch_first=True, **F64
    ).eval()
    src, tgt = _x(1, 5, seed=6), _x(1, 4, seed=7)
    out = model(src, tgt)
    changed = tgt.clone()
    changed[:, 3] += 1.0
    out_changed = model(src, changed)
    torch.testing.assert_close(out_changed[:, :3], out[:, :3])  # the future does not leak back
    assert not torch.allclose(out_changed[:, 3], out[:, 3])


def test_encoder_with_causal_mask_raises_for_dnas():
    layer = aknn.TransformerEncoderLayer(D, NH, FF, mechanism="dnas", batch_first=True)
    encoder = aknn.TransformerEncoder(layer, 2)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(4)
    with pytest.raises(ValueError, match="future-token leak"):
        encoder(torch.randn(1, 4, D), mask=causal)
    with pytest.raises(ValueError, match="future-token leak"):
        hnas = aknn.TransformerEncoderLayer(D, NH, FF, mechanism="hnas", batch_first=True)
        hnas(torch.randn(1, 4, D), is_causal=True)
    with pytest.raises(ValueError, match="causal pattern.*future-token leak"):
        layer(torch.randn(1, 4, D), src_mask=causal)  # one layer, the mask's causality not declared


def test_mechanism_per_layer_and_hybrid_weights():
    model = aknn.Transformer(D, NH, 3, 1, FF, encoder_mechanism=["hnas", "dnas", ak.Hybrid(u0=0.1)])
    names = [layer.self_attn.mechanism for layer in model.encoder.layers]
    assert names == ["hnas", "dnas", "hnas"]
    u = aknn.hybrid_weights(model)
    assert u.shape == (2, NH)
    torch.testing.assert_close(u, torch.tensor([[0.5, 0.5], [0.1, 0.1]]))


def test_encoder_stack_copies_layer_without_mechanism():
    layer = aknn.TransformerEncoderLayer(D, NH, FF, mechanism="dnas", batch_first=True)
    encoder = aknn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(D))
    assert [m.self_attn.mechanism for m in encoder.layers] == ["dnas", "dnas"]
    torch.testing.assert_close(encoder.layers[1].linear1.weight, layer.linear1.weight)
    assert encoder(torch.randn(2, 3, D)).shape == (2, 3, D)


def test_layers_built_per_mechanism_own_their_activation_and_keep_dtype():
    """Layers rebuilt for a mechanism shared one nn.PReLU (a torch state_dict's four per-layer weights
    collapsed into one) and went back to the dtype the template was built with (float32 after .double())."""
    model = aknn.Transformer(D, NH, 2, 2, FF, activation=torch.nn.PReLU(), encoder_mechanism="dnas")
    names = [n for n, _ in model.named_parameters() if n.endswith("activation.weight")]
    assert len(names) == 4
    with torch.no_grad():
        for i, layer in enumerate([*model.encoder.layers, *model.decoder.layers]):
            layer.activation.weight.fill_(0.1 * i)
    assert [layer.activation.weight.item() for layer in model.encoder.layers] == pytest.approx([0.0, 0.1])
    template = aknn.TransformerEncoderLayer(D, NH, FF, batch_first=True).double()
    stack = aknn.TransformerEncoder(template, 2, mechanism="dnas")
    assert {p.dtype for p in stack.parameters()} == {torch.float64}
    assert stack(_x(2, 3)).dtype == torch.float64


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_an_encoder_stack_takes_a_nested_batch_as_its_layers_do(mechanism):
    """The stack read src.shape to detect a causal mask: a nested tensor raised an internal torch error."""
    layer = aknn.TransformerEncoderLayer(D, NH, FF, batch_first=True, mechanism=mechanism, **F64)
    encoder = aknn.TransformerEncoder(layer, 2).eval()
    seqs = [_x(1, 3, seed=1)[0], _x(1, 5, seed=2)[0]]
    with torch.no_grad():
        out = encoder(torch.nested.nested_tensor(seqs))
        for got, x in zip(out.unbind(), seqs):
            torch.testing.assert_close(got, encoder(x[None])[0])
    model = aknn.Transformer(D, NH, 1, 1, FF, batch_first=True, encoder_mechanism=mechanism, **F64).eval()
    with torch.no_grad():  # its positional encoding read the nested batch's shape: torch's internal error
        memory = model.encode(torch.nested.nested_tensor(seqs))
        for got, x in zip(memory.unbind(), seqs):
            torch.testing.assert_close(got, model.encode(x[None])[0])


def test_torchs_private_reset_names_exist_and_contradictory_positions_are_refused():
    """Code written for torch calls _reset_parameters (an AttributeError); start and positions together
    took positions silently."""
    torch.manual_seed(0)
    mha = aknn.MultiheadAttention(D, NH)
    before = mha.in_proj_weight.clone()
    mha._reset_parameters()
    assert not torch.equal(mha.in_proj_weight, before)
    aknn.Transformer(D, NH, 1, 1, FF)._reset_parameters()
    pe = aknn.SinusoidalPositionalEncoding(D, max_len=16)
    with pytest.raises(ValueError, match="start=5 and positions given"):
        pe(torch.zeros(1, 3, D), start=5, positions=torch.zeros(1, 3, dtype=torch.long))


def test_decoder_stack_per_layer_mechanisms():
    layer = aknn.TransformerDecoderLayer(D, NH, FF)
    decoder = aknn.TransformerDecoder(layer, 2, self_mechanism=["softmax", "coda"])
    assert [m.self_attn.mechanism for m in decoder.layers] == ["softmax", "coda"]
    assert [m.multihead_attn.mechanism for m in decoder.layers] == ["softmax", "softmax"]
    with pytest.raises(ValueError, match="future-token leak"):
        aknn.TransformerDecoder(layer, 2, self_mechanism=["softmax", "dnas"])


def test_per_layer_mechanisms_of_a_layer_built_on_meta_and_given_memory():
    """A layer built with device="meta", then to_empty(device="cpu"): the stacks rebuilt it from its
    arguments on meta and failed copying out of it (NotImplementedError: Cannot copy out of meta tensor)."""
    encoder_layer = aknn.TransformerEncoderLayer(D, NH, FF, batch_first=True, device="meta")
    encoder_layer.to_empty(device="cpu")
    encoder = aknn.TransformerEncoder(encoder_layer, 2, mechanism=["dnas", "hnas"])
    assert [m.self_attn.mechanism for m in encoder.layers] == ["dnas", "hnas"]
    assert all(p.device.type == "cpu" for p in encoder.parameters())
    decoder_layer = aknn.TransformerDecoderLayer(D, NH, FF, batch_first=True, device="meta")
    decoder_layer.to_empty(device="cpu")
    decoder = aknn.TransformerDecoder(decoder_layer, 2, self_mechanism=["softmax", "coda"])
    assert all(p.device.type == "cpu" for p in decoder.parameters())


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_transformer_adds_positions(positional):
    torch.manual_seed(0)
    model = aknn.Transformer(D, NH, 1, 1, FF, positional=positional, max_len=16, batch_first=True).eval()
    bare = aknn.Transformer(D, NH, 1, 1, FF, positional=None, batch_first=True).eval()
    bare.load_state_dict(model.state_dict(), strict=False)
    src, tgt = torch.randn(2, 5, D), torch.randn(2, 3, D)
    assert model(src, tgt).shape == (2, 3, D)
    assert not torch.allclose(model(src, tgt), bare(src, tgt))
    if positional == "learned":
        assert model.src_position.weight.shape == (16, D)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"positional": "rotary"}, "positional='rotary'"),
        ({"encoder_mechanism": ["hnas"]}, "encoder_mechanism has 1 entries"),
        ({"encoder_mechanism": "nope"}, "nope"),
        ({"nhead": 3}, "embed_dim=8 is not divisible by num_heads=3"),
        ({"activation": "swish"}, "activation='swish'"),
        ({"num_encoder_layers": 0}, "num_encoder_layers=0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, needle):
    args = {
        "d_model": D,
        "nhead": NH,
        "num_encoder_layers": 2,
        "num_decoder_layers": 1,
        "dim_feedforward": FF,
        **kwargs,
    }
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        aknn.Transformer(**args)


def test_seq_first_layout():
    torch.manual_seed(0)
    ours = aknn.TransformerEncoderLayer(D, NH, FF, batch_first=False, **F64).eval()
    theirs = torch.nn.TransformerEncoderLayer(D, NH, FF, batch_first=False, **F64).eval()
    ours.load_state_dict(theirs.state_dict())
    x = _x(3, 4).transpose(0, 1)  # (L, B, D)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-12)


LAYERS = {
    "encoder_layer": lambda **kw: aknn.TransformerEncoderLayer(D, NH, **{"dim_feedforward": FF, **kw}),
    "decoder_layer": lambda **kw: aknn.TransformerDecoderLayer(D, NH, **{"dim_feedforward": FF, **kw}),
    "transformer": lambda **kw: aknn.Transformer(
        D, NH, num_encoder_layers=1, num_decoder_layers=1, **{"dim_feedforward": FF, **kw}
    ),
}


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), True, "1e-5"])
@pytest.mark.parametrize("make", list(LAYERS))
def test_layer_norm_eps_must_be_finite_and_positive(make, eps):
    with pytest.raises(ValueError, match=re.escape(f"layer_norm_eps={eps!r}; expected a finite number > 0")):
        LAYERS[make](layer_norm_eps=eps)


@pytest.mark.parametrize("make", list(LAYERS))
def test_small_positive_layer_norm_eps_gives_finite_outputs(make):
    layer = LAYERS[make](layer_norm_eps=1e-12, batch_first=True, **F64).eval()
    x = _x(2, 4)
    out = layer(x) if make == "encoder_layer" else layer(x, x)
    assert out.shape == (2, 4, D) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"dim_feedforward": 0}, "dim_feedforward=0; expected a positive integer"),
        ({"dim_feedforward": -4}, "dim_feedforward=-4; expected a positive integer"),
        ({"dim_feedforward": 16.0}, "dim_feedforward=16.0; expected a positive integer"),
        ({"dim_feedforward": True}, "dim_feedforward=True; expected a positive integer"),
        ({"dropout": -0.1}, "dropout=-0.1; expected a probability in [0, 1)"),
        ({"dropout": 1.0}, "dropout=1.0; expected a probability in [0, 1)"),
        ({"dropout": float("nan")}, "dropout=nan; expected a probability in [0, 1)"),
        ({"dropout": "0.1"}, "dropout='0.1'; expected a probability in [0, 1)"),
        ({"batch_first": "no"}, "batch_first='no'; expected True or False"),
        ({"norm_first": None}, "norm_first=None; expected True or False"),
        ({"bias": 1}, "bias=1; expected True or False"),
    ],
)
@pytest.mark.parametrize("make", list(LAYERS))
def test_feedforward_size_dropout_and_flags_are_checked(make, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LAYERS[make](**kwargs)


@pytest.mark.parametrize("cls", [aknn.TransformerEncoderLayer, aknn.TransformerDecoderLayer])
def test_numpy_sizes_and_flags_build_the_same_layer(cls):
    import numpy as np

    torch.manual_seed(0)
    ours = cls(np.int64(D), np.int32(NH), np.int64(FF), np.float32(0.0), batch_first=np.bool_(True), **F64)
    torch.manual_seed(0)
    plain = cls(D, NH, FF, 0.0, batch_first=True, **F64)
    assert ours.self_attn.embed_dim == D and type(ours.self_attn.embed_dim) is int
    assert ours.self_attn.batch_first is True
    x = _x(2, 4)
    run = (lambda m: m.eval()(x)) if cls is aknn.TransformerEncoderLayer else (lambda m: m.eval()(x, x))
    assert torch.equal(run(ours), run(plain))
    stack = aknn.TransformerEncoder(aknn.TransformerEncoderLayer(D, NH, FF, batch_first=True), np.int64(2))
    assert stack.num_layers == 2 and len(stack.layers) == 2


# -- drop-in signatures: torch's positional arguments, attnkit's additions keyword-only --------------------

@pytest.mark.parametrize(
    "name", ["TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder"]
)
@pytest.mark.parametrize("method", ["__init__", "forward"])
def test_signature_and_defaults_match_torch(name, method):
    import inspect

    theirs = inspect.signature(getattr(getattr(torch.nn, name), method)).parameters
    ours = inspect.signature(getattr(getattr(aknn, name), method)).parameters
    assert list(ours)[: len(theirs)] == list(theirs)  # same names, same positions
    for param_name, param in theirs.items():
        expected = "relu" if param_name == "activation" else param.default  # torch's default is F.relu
        assert ours[param_name].default == expected, param_name
    extra = list(ours)[len(theirs):]
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extra), extra


def test_layers_take_device_and_dtype_positionally_as_torch():
    args = (D, NH, FF, 0.1, "relu", 1e-5, True, False, True, "cpu", torch.float64)
    for make in (torch.nn.TransformerEncoderLayer, aknn.TransformerEncoderLayer,
                 torch.nn.TransformerDecoderLayer, aknn.TransformerDecoderLayer):
        layer = make(*args)
        assert {p.dtype for p in layer.parameters()} == {torch.float64}, make
    assert aknn.TransformerEncoderLayer(*args).self_attn.mechanism == "softmax"


@pytest.mark.parametrize("training", [False, True])
def test_encoder_stack_takes_torch_nested_tensor_arguments(training):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, NH, FF, dropout=0.0, batch_first=True, **F64)
    theirs = torch.nn.TransformerEncoder(layer, 2, None, False, False).train(training)
    ours = aknn.TransformerEncoder(
        aknn.TransformerEncoderLayer(D, NH, FF, dropout=0.0, batch_first=True, **F64), 2, None, False, False
    ).train(training)
    ours.load_state_dict(theirs.state_dict())
    assert ours.enable_nested_tensor is False and ours.mask_check is False and ours.use_nested_tensor is False
    x, pad = _x(2, 5), _pad([5, 3], 5)
    torch.testing.assert_close(
        ours(x, src_key_padding_mask=pad), theirs(x, src_key_padding_mask=pad), rtol=1e-10, atol=1e-10
    )
    with pytest.raises(TypeError):  # mechanism is keyword-only: the 4th positional is enable_nested_tensor
        aknn.TransformerEncoder(layer, 2, None, True, True, "dnas")


def test_transformer_forward_takes_torch_causal_arguments():
    torch.manual_seed(0)
    theirs = torch.nn.Transformer(D, NH, 1, 1, FF, dropout=0.0, batch_first=True, **F64)
    ours = aknn.Transformer(
        D, NH, 1, 1, FF, dropout=0.0, encoder_mechanism="softmax", positional=None, batch_first=True, **F64
    )
    ours.load_state_dict(theirs.state_dict())
    src, tgt = _x(2, 6, seed=3), _x(2, 4, seed=4)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    for call in (
        {"src_is_causal": False, "tgt_is_causal": None, "memory_is_causal": False},
        {"tgt_mask": causal, "src_is_causal": None, "tgt_is_causal": None},
        {"tgt_mask": causal, "tgt_is_causal": True},
    ):
        torch.testing.assert_close(ours(src, tgt, **call), theirs(src, tgt, **call), rtol=1e-10, atol=1e-10)
