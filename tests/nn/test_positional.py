"""Positional encodings: the sinusoid closed form, offsets, layouts, learned tables and length checks."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit.nn as aknn


@pytest.mark.parametrize("d_model", [6, 7])
def test_sinusoidal_matches_closed_form(d_model):
    module = aknn.SinusoidalPositionalEncoding(d_model, max_len=12)
    out = module(torch.zeros(1, 12, d_model))[0]
    expected = torch.zeros(12, d_model)
    for pos in range(12):
        for i in range(d_model):
            angle = pos / 10000 ** ((i - i % 2) / d_model)
            expected[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_start_offset_continues_positions():
    module = aknn.SinusoidalPositionalEncoding(8, max_len=10)
    full = module(torch.zeros(2, 6, 8))
    tail = module(torch.zeros(2, 2, 8), start=4)
    torch.testing.assert_close(tail, full[:, 4:6])


def test_layouts_agree():
    module = aknn.LearnedPositionalEncoding(4, max_len=5)
    seq_first = aknn.LearnedPositionalEncoding(4, max_len=5, batch_first=False)
    seq_first.load_state_dict(module.state_dict())
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(seq_first(x.transpose(0, 1)).transpose(0, 1), module(x))
    torch.testing.assert_close(module(x[0]), module(x)[0])  # unbatched (L, d)


def test_learned_table_is_trained():
    module = aknn.LearnedPositionalEncoding(4, max_len=5)
    assert [name for name, _ in module.named_parameters()] == ["weight"]
    module(torch.randn(2, 3, 4)).sum().backward()
    assert module.weight.grad[:3].abs().sum() > 0 and module.weight.grad[3:].abs().sum() == 0


def test_sinusoidal_table_is_not_in_state_dict():
    assert len(aknn.SinusoidalPositionalEncoding(4).state_dict()) == 0


@pytest.mark.parametrize("cls", [aknn.SinusoidalPositionalEncoding, aknn.LearnedPositionalEncoding])
def test_too_long_input_raises_naming_max_len(cls):
    module = cls(4, max_len=5)
    with pytest.raises(ValueError, match="max_len=5"):
        module(torch.zeros(1, 6, 4))
    with pytest.raises(ValueError, match=r"\(B, L, 4\)"):
        module(torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="max_len=0"):
        cls(4, max_len=0)


def test_float64_rows_are_computed_at_the_positions_asked_for_and_nothing_is_kept():
    """Every float64 call rebuilt the whole table (2.7 ms per call at d_model 512, 69 ms at max_len 8192); a
    cached copy then travelled in pickles and stayed on the old device."""
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64)
    before = dict(pe.__dict__)
    rows = pe.rows(torch.tensor([[5, 50]]), torch.float64)
    assert rows.shape == (1, 2, 8) and rows.dtype == torch.float64
    assert abs(rows[0, 1, 6].item() - math.sin(50 / 10000 ** (6 / 8))) < 1e-15
    pe(torch.zeros(1, 3, 8, dtype=torch.float64))
    assert pe.__dict__.keys() == before.keys() and set(pe.state_dict()) == set()


def test_the_sinusoidal_table_keeps_float64_accuracy_in_float64_models():
    """The table was rounded to float32 when built: a float64 model's positions erred by 3e-8. Its buffer is
    float32 (as the module's other tensors: a float64 buffer cannot move to Apple's MPS device)."""
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64)
    assert pe.pe.dtype == torch.float32
    pos, i = 50, 3  # PE(pos, 2i) = sin(pos / 10000^(2i/d))
    out = pe.double()(torch.zeros(1, 51, 8, dtype=torch.float64))
    assert abs(out[0, pos, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / 8))) < 1e-15
    gathered = pe(torch.zeros(1, 1, 8, dtype=torch.float64), positions=torch.tensor([[pos]]))
    assert abs(gathered[0, 0, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / 8))) < 1e-15
    x = torch.zeros(1, 3, 8)
    assert pe.float()(x).dtype == torch.float32
    torch.testing.assert_close(pe(x), out[:, :3].float(), rtol=0, atol=6e-8)


@pytest.mark.parametrize("cls", [aknn.SinusoidalPositionalEncoding, aknn.LearnedPositionalEncoding])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_batch_numbers_each_sequence_as_the_padded_batch_does(cls, layout):
    """A nested batch (torch.nested) raised torch's internal "NestedTensorImpl doesn't support sizes"."""
    torch.manual_seed(0)
    pe = cls(4, max_len=8)
    seqs = [torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)]
    out = pe(torch.nested.as_nested_tensor(seqs, layout=layout), start=1)
    assert out.is_nested
    for got, seq in zip(out.unbind(), seqs):
        torch.testing.assert_close(got, pe(seq[None], start=1)[0])
    sum(part.sum() for part in out.unbind()).backward()
    assert all(seq.grad is not None for seq in seqs)
    x = torch.nested.as_nested_tensor([s.detach() for s in seqs], layout=layout)
    assert (pe(x) + x).is_nested  # a jagged result kept x's offsets: adding them raised torch's error
    with pytest.raises(ValueError, match="leave positions out"):
        pe(torch.nested.as_nested_tensor(seqs, layout=layout), positions=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len >= 9"):
        pe(torch.nested.as_nested_tensor(seqs, layout=layout), start=4)
    with pytest.raises(ValueError, match="batch_first=True"):
        cls(4, max_len=8, batch_first=False)(torch.nested.as_nested_tensor(seqs, layout=layout))


def test_positions_for_an_unbatched_x_name_the_missing_batch_dimension():
    """The message said to build the module with batch_first=True, which it already was."""
    pe = aknn.SinusoidalPositionalEncoding(8)
    with pytest.raises(ValueError, match=r"add the batch dimension \(x\[None\], positions\[None\]\)"):
        pe(torch.zeros(3, 8), positions=torch.arange(3))


# -- the sinusoidal table off the meta device; positions of every integer dtype ------------------------------

_TRANSFORMER = dict(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                    dropout=0.0, batch_first=True, max_len=32)


def test_a_meta_built_module_materialized_with_to_empty_equals_a_normal_one():
    """The table is not in the state_dict: to_empty left uninitialised memory (silently wrong positions)."""
    fresh = aknn.SinusoidalPositionalEncoding(8, max_len=16)
    with torch.device("meta"):
        module = aknn.SinusoidalPositionalEncoding(8, max_len=16)
    module = module.to_empty(device="cpu")
    module.load_state_dict(fresh.state_dict())
    assert torch.equal(module.pe, fresh.pe)
    x = torch.randn(2, 5, 8)
    assert torch.equal(module(x), fresh(x))
    assert torch.equal(module(x, positions=torch.tensor([[0, 3, 15, 1, 2]] * 2)),
                       fresh(x, positions=torch.tensor([[0, 3, 15, 1, 2]] * 2)))


def test_a_meta_built_transformer_materialized_with_to_empty_equals_a_normal_one():
    """Inside ak.nn.Transformer the garbage table raised a misleading score-overflow ValueError."""
    torch.manual_seed(0)
    fresh = aknn.Transformer(**_TRANSFORMER).eval()
    with torch.device("meta"):
        model = aknn.Transformer(**_TRANSFORMER)
    model = model.to_empty(device="cpu")
    model.load_state_dict(fresh.state_dict())
    model.eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), fresh(src, tgt))


def test_a_meta_built_transformer_loaded_with_assign_equals_a_normal_one_and_moves():
    """load_state_dict(assign=True) has no table to assign (it stays on meta): forward raised torch's device
    error, and .to(device) could not copy it out of meta."""
    torch.manual_seed(0)
    fresh = aknn.Transformer(**_TRANSFORMER).eval()
    with torch.device("meta"):
        model = aknn.Transformer(**_TRANSFORMER)
    model.load_state_dict(fresh.state_dict(), assign=True)
    model.eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), fresh(src, tgt))
        model.to("cpu")
        assert torch.equal(model.src_position.pe, fresh.src_position.pe)
        assert torch.equal(model(src, tgt), fresh(src, tgt))


def test_reset_parameters_rebuilds_the_sinusoidal_table():
    fresh = aknn.SinusoidalPositionalEncoding(6, max_len=10)
    module = aknn.SinusoidalPositionalEncoding(6, max_len=10)
    module.pe.fill_(float("nan"))
    module.reset_parameters()
    assert torch.equal(module.pe, fresh.pe)
    doubled = aknn.SinusoidalPositionalEncoding(6, max_len=10).double()  # a cast rebuilds it in float64
    assert torch.equal(doubled.pe, aknn.SinusoidalPositionalEncoding(6, max_len=10).rows(torch.arange(10),
                                                                                       torch.float64))


@pytest.mark.parametrize("cls", [aknn.SinusoidalPositionalEncoding, aknn.LearnedPositionalEncoding])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions_dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_positions_of_every_integer_dtype_give_the_int64_rows(cls, x_dtype, positions_dtype):
    """int8/int16 raised torch's IndexError on the float32 table and uint8 was read as a boolean mask."""
    torch.manual_seed(0)
    pe = cls(8, max_len=64).to(x_dtype)
    x = torch.zeros(2, 5, 8, dtype=x_dtype)
    positions = torch.tensor([[3, 0, 63, 1, 2], [5, 5, 5, 5, 5]])
    assert torch.equal(pe(x, positions=positions.to(positions_dtype)), pe(x, positions=positions))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions_dtype", [torch.bool, torch.float32, torch.float64])
def test_boolean_or_floating_positions_raise_naming_the_dtype(x_dtype, positions_dtype):
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64)
    positions = torch.ones(2, 5, dtype=positions_dtype)
    with pytest.raises(ValueError, match=f"{positions_dtype}; expected integer positions of shape"):
        pe(torch.zeros(2, 5, 8, dtype=x_dtype), positions=positions)


def test_negative_positions_name_the_clamp_and_the_documented_expression_works():
    # the docs suggested attention_mask.cumsum(1) - 1, which gives -1 at left padding; the error then said to
    # build a larger max_len, which cannot help
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=16)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    x = torch.zeros(2, 5, 8)
    with pytest.raises(ValueError, match=r"positions span -1\.\.4.*clamp them"):
        pe(x, positions=mask.cumsum(1) - 1)
    out = pe(x, positions=(mask.cumsum(1) - 1).clamp(min=0))
    torch.testing.assert_close(out[0, 2:], out[1, :3])  # the real tokens at 0, 1, 2 either way
    with pytest.raises(ValueError, match="build the module with a larger max_len"):
        pe(x, positions=torch.full((2, 5), 16))
