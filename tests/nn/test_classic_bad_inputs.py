"""Bad input to the lecture's attention modules is a ValueError that says what to fix, never a NaN, an
empty answer or a torch error from deep inside (each case returned NaN or raised RuntimeError/TypeError)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn
from attnkit.nn.coda_cross import CoDACrossAttention
from attnkit.models.ctc import ctc_greedy_decode, ctc_prefix_beam_search
from attnkit.nn.draw import DRAWRead, DRAWWindow, draw_read, draw_write, filterbank, window_from_params
from attnkit.nn.hard import MovingAverageBaseline, hard_attention, reinforce_loss


@pytest.mark.parametrize("mode", ["soft", "reinforce", "gumbel", "argmax"])
def test_hard_attention_refuses_nan_scores_integer_scores_and_a_list_mask(mode):
    values = torch.randn(2, 4, 3)
    scores = torch.randn(2, 4)
    scores[0, 1] = float("nan")
    with pytest.raises(ValueError, match="scores contain NaN"):
        hard_attention(scores, values, mode=mode)
    with pytest.raises(ValueError, match="scores must be a floating tensor"):
        hard_attention(torch.zeros(2, 4, dtype=torch.long), values, mode=mode)
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        hard_attention(torch.randn(2, 4), values, mode=mode, key_mask=[[True] * 4] * 2)


def test_reinforce_refuses_a_nan_reward_and_the_baseline_a_decay_that_is_no_number():
    with pytest.raises(ValueError, match="reward contains NaN"):
        reinforce_loss(torch.zeros(3), torch.tensor([1.0, float("nan"), 0.0]))
    for decay in ("a", float("nan"), 1.0):
        with pytest.raises(ValueError, match="expected 0 <= decay < 1"):
            MovingAverageBaseline(decay)


def test_gmm_location_attention_names_the_bad_query():
    attn = ak.nn.GMMLocationAttention(4, 2)
    values, kappa = torch.randn(2, 5, 3), attn.initial_kappa(2)
    with pytest.raises(ValueError, match=r"expected \(B, Dq\) = \(B, 4\)"):
        attn(torch.randn(2, 5), values, kappa)
    with pytest.raises(ValueError, match="values has dtype torch.float64 but the module's weights are"):
        attn(torch.randn(2, 4), values.double(), kappa)
    with pytest.raises(ValueError, match="query contains NaN"):
        attn(torch.full((2, 4), float("nan")), values, kappa)
    with torch.no_grad():
        attn.proj.bias[4:].fill_(100.0)  # exp(100) overflows float32
    with pytest.raises(ValueError, match="parameterization='softplus'"):
        attn(torch.zeros(2, 4), values, kappa)


def test_a_draw_window_whose_variance_underflowed_reads_the_nearest_pixels():
    """log sigma^2 = -200 gave sigma^2 = 0 and a NaN glimpse; the limit sigma -> 0 is each filter on its
    nearest pixel, and every filter row still sums to 1."""
    x = torch.randn(2, 1, 6, 6)
    params = torch.tensor([[0.0, 0.0, -200.0, 0.0, 0.0]] * 2)  # centred, stride 1, sigma^2 -> 0
    window = window_from_params(params, 6, 6, 6)
    fx, fy = filterbank(window, 6, 6, 6)
    assert torch.isfinite(fx).all() and torch.allclose(fx.sum(-1), torch.ones(2, 6))
    glimpse = draw_read(x, window, 6)
    torch.testing.assert_close(glimpse, x)  # the identity read of the module docstring
    assert torch.isfinite(draw_write(glimpse, window, 6, 6)).all()


def test_draw_shapes_and_values_are_checked():
    x = torch.randn(2, 1, 6, 6)
    read = DRAWRead(4, 3, 6, 6)
    with pytest.raises(ValueError, match=r"h has shape \(2, 5\); expected \(B, state_dim\) = \(2, 4\)"):
        read(x, torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"h has shape \(3, 4\)"):
        read(x, torch.randn(3, 4))
    window = window_from_params(torch.zeros(3, 5), 6, 6, 3)
    with pytest.raises(ValueError, match=r"window.gx has shape \(3,\); expected \(2,\)"):
        draw_read(x, window, 3)
    with pytest.raises(ValueError, match="square N x N patch"):
        draw_write(torch.randn(3, 1, 3, 4), window, 6, 6)
    with pytest.raises(ValueError, match="params contain NaN"):
        window_from_params(torch.full((2, 5), float("nan")), 6, 6, 3)
    assert isinstance(window, DRAWWindow)


def test_ctc_decoding_refuses_nan_and_integer_scores():
    with pytest.raises(ValueError, match="log_probs contains NaN"):
        ctc_prefix_beam_search(torch.full((4, 3), float("nan")))
    with pytest.raises(ValueError, match="log_probs contains NaN"):
        ctc_greedy_decode(torch.full((1, 4, 3), float("nan")))
    with pytest.raises(ValueError, match="expected floating log-probabilities"):
        ctc_greedy_decode(torch.zeros(1, 3, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "field, value, rule",
    [("gx", float("nan"), "finite"), ("stride", float("inf"), "finite and >= 0"),
     ("stride", -1.0, "finite and >= 0"), ("sigma2", -1.0, "finite and > 0"),
     ("sigma2", 0.0, "finite and > 0")],
)
def test_a_hand_built_draw_window_with_invalid_values_is_named(field, value, rule):
    # a NaN centre gave an all-NaN glimpse, a negative variance one-hot filters, without a word
    ones = torch.ones(2)
    fields = dict(gx=4 * ones, gy=4 * ones, stride=ones, sigma2=ones, gamma=ones)
    fields[field] = torch.tensor([1.0, value])
    window = DRAWWindow(**fields)
    with pytest.raises(ValueError, match=rf"window\.{field} = .*{rule}"):
        draw_read(torch.rand(2, 1, 8, 8), window, 3)
    with pytest.raises(ValueError, match=rf"window\.{field} = .*{rule}"):
        draw_write(torch.rand(2, 1, 3, 3), window, 8, 8)


@pytest.mark.parametrize("cls", ["SinusoidalPositionalEncoding", "LearnedPositionalEncoding"])
def test_positional_encodings_refuse_token_ids(cls):
    # the encodings were cast to the ids' integer dtype: sinusoids truncated to 0/1, a learned table to 0
    module = getattr(ak.nn, cls)(8, max_len=16, batch_first=True)
    with pytest.raises(ValueError, match="expected the floating embeddings"):
        module(torch.randint(0, 10, (2, 5, 8)))


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_content_attention_refuses_a_single_step_with_a_query_normalized_mechanism(mechanism):
    # normalized over one query, every weight was 1 / Lk whatever the scores
    module = ak.nn.AdditiveAttention(4, 4, mechanism=mechanism)
    with pytest.raises(ValueError, match="single step"):
        module(torch.randn(2, 4), torch.randn(2, 5, 4))
    module(torch.randn(2, 3, 4), torch.randn(2, 5, 4))  # all queries at once: fine


def test_reinforce_loss_refuses_an_entropy_of_another_shape_and_non_finite_weights():
    log_prob, reward = torch.randn(3), torch.rand(3)
    with pytest.raises(ValueError, match=r"entropy has shape \(4,\); expected \(N,\) = \(3,\)"):
        reinforce_loss(log_prob, reward, entropy=torch.rand(4), entropy_weight=0.1)
    for name in ("reward_weight", "entropy_weight"):  # a NaN weight gave a NaN loss
        with pytest.raises(ValueError, match=f"{name}=nan"):
            reinforce_loss(log_prob, reward, entropy=torch.rand(3), **{name: float("nan")})


@pytest.mark.parametrize("attention", ["gmm", "none"])
def test_rnn_seq2seq_refuses_a_mechanism_its_attention_would_ignore(attention):
    from attnkit.models import RNNSeq2Seq

    with pytest.raises(ValueError, match=f"attention='{attention}' has no content scores"):
        RNNSeq2Seq(10, 10, attention=attention, mechanism="coda")
    RNNSeq2Seq(10, 10, attention=attention)  # the default mechanism is fine


def test_show_attend_tell_names_a_non_number_probability_and_non_tensor_images():
    from attnkit.models import ShowAttendTell

    for value in ("0.5", None):  # a TypeError traceback before
        with pytest.raises(ValueError, match="expectation_prob=.*expected a probability in"):
            ShowAttendTell(10, expectation_prob=value)
    model = ShowAttendTell(10, feature_dim=8, embed_dim=8, hidden_dim=16, attention_dim=8)
    with pytest.raises(ValueError, match="expected a floating tensor"):  # an AttributeError before
        model.greedy([[1.0]], 3)


def _mha():
    return aknn.MultiheadAttention(8, 2, batch_first=True)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x, m: _mha()(x, x, x, key_padding_mask=m),
         "key_padding_mask"),
        (lambda x, m: _mha()(x, x, x, query_padding_mask=m),
         "query_padding_mask"),
        (lambda x, m: _mha()(x, x, x, attn_mask=m[0] | m[0, :, None]),
         "attn_mask"),
        (lambda x, m: CoDACrossAttention(8)(x, x, a_mask=m), "a_mask"),
        (lambda x, m: CoDACrossAttention(8)(x, x, b_mask=m), "b_mask"),
        (lambda x, m: aknn.MultiViewAttention(8, 1)(x, [x], query_padding_mask=m), "query_padding_mask"),
        (lambda x, m: aknn.MultiViewAttention(8, 1)(x, [x], key_padding_masks=[m]),
         r"key_padding_masks\[0\]"),
    ],
)
def test_mask_on_another_device_is_named_by_the_modules_own_argument(call, name):
    """A mask on another device than the inputs is refused under the name the caller passed it by (the
    module's ``key_padding_mask``, not the functional core's ``key_mask``) with the ``.to`` that fixes it."""
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=rf"^{name} is on meta but .* on cpu; move it with \.to\('cpu'\)"):
        call(x, mask)
