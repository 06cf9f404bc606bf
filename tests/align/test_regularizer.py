"""AlignmentRegularizer: attaches to attnkit, torch, Hugging Face and PyG models without changing outputs."""

from __future__ import annotations

import re

import pytest
import torch

import attnkit as ak
from attnkit.align import AlignmentRegularizer, mmd
from attnkit.align.regularizer import METHODS


def _encoder(mechanism="softmax", layers=2):
    torch.manual_seed(0)
    layer = ak.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, mechanism=mechanism)
    return ak.nn.TransformerEncoder(layer, layers).eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 16, generator=g)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 2:] = True
    return x, pad


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
@pytest.mark.parametrize("method", METHODS)
def test_attach_leaves_outputs_bit_identical(mechanism, method):
    model = _encoder(mechanism)
    x, pad = _batch()
    before = model(x, src_key_padding_mask=pad)
    hooks = _hook_count(model)
    reg = AlignmentRegularizer(model, method=method)
    during = model(x, src_key_padding_mask=pad)
    value = reg.loss()
    assert torch.equal(before, during)
    assert value.dim() == 0 and torch.isfinite(value)
    reg.remove()
    assert _hook_count(model) == hooks
    assert torch.equal(model(x, src_key_padding_mask=pad), before)


def test_captured_queries_are_the_modules_projections():
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="mmd")
    model(x, src_key_padding_mask=pad)
    attn = model.layers[0].self_attn
    w_q, w_k, _ = attn.in_proj_weight.chunk(3)
    b_q, b_k, _ = attn.in_proj_bias.chunk(3)
    _, captured = reg._captured[0]
    torch.testing.assert_close(captured.q, (x @ w_q.T + b_q).view(3, 6, 4, 4).transpose(1, 2))
    torch.testing.assert_close(captured.k, (x @ w_k.T + b_k).view(3, 6, 4, 4).transpose(1, 2))
    assert torch.equal(captured.k_mask, ~pad)


def test_loss_is_weight_times_mean_over_layers_and_mmd_sums_heads():
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="mmd", weight=0.5)
    model(x, src_key_padding_mask=pad)
    per_layer = []
    total = 0.0
    for _, c in reg._captured:
        values = mmd(c.q, c.k, key_mask=c.k_mask)  # (B, H)
        per_layer.append(values.mean())
        total += float(values.detach().mean(0).sum())
    torch.testing.assert_close(reg.loss(), 0.5 * torch.stack(per_layer).mean())
    assert reg.mmd() == pytest.approx(total, rel=1e-5)
    assert [tuple(v.shape) for v in reg.mmd_per_head()] == [(4,), (4,)]


def test_padding_changes_nothing():
    """The loss of a padded batch = the mean of each sample's loss computed alone (layer-wise, mmd)."""
    model = _encoder()
    x, pad = _batch()
    x_garbage = x.masked_fill(pad[..., None], 7.0)
    reg = AlignmentRegularizer(model, method="mmd")
    model(x_garbage, src_key_padding_mask=pad)
    batched = [mmd(c.q, c.k, key_mask=c.k_mask) for _, c in reg._captured]  # (B, H) per layer
    for b in range(3):
        n = int((~pad[b]).sum())
        model(x[b : b + 1, :n])
        alone = [mmd(c.q, c.k) for _, c in reg._captured]
        for layer in range(2):
            torch.testing.assert_close(batched[layer][b : b + 1], alone[layer], rtol=1e-4, atol=1e-5)


def test_gradients_reach_the_projections_and_own_parameters():
    model = _encoder().train()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="ct")
    model(x, src_key_padding_mask=pad)
    reg.loss().backward()
    assert model.layers[0].self_attn.in_proj_weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in reg.parameters())
    names = {n.split(".")[0] for n, _ in reg.named_parameters()}
    assert names == {"critics", "navigators"}


def test_torch_multihead_attention_and_layer_selection():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        layer, torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    )
    x, _ = _batch()
    before = model(x)
    reg = AlignmentRegularizer(model, method="gan", layers=[1])
    assert torch.equal(model(x), before)
    assert len(reg._captured) == 1 and reg._captured[0][1].q.shape == (3, 2, 6, 8)
    assert len(reg.discriminators) == 1


@pytest.mark.parametrize("family", ("bert", "roberta", "albert", "distilbert"))
@pytest.mark.parametrize("method", ("ct", "ot"))
def test_hugging_face_encoders(family, method):
    from tests.hf._models import tiny_model

    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    reg = AlignmentRegularizer(model, method=method)
    after = model(ids, mask).last_hidden_state  # positional attention_mask is found too
    assert torch.equal(before, after)
    assert len(reg._captured) == 2  # two layers (ALBERT: two calls of its shared layer)
    c = reg._captured[0][1]
    assert c.q.shape == (2, 4, 7, 8)
    assert torch.equal(c.k_mask, mask > 0)
    reg.loss().backward()
    reg.remove()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, before)


def test_converted_hf_model_with_dnas():
    import attnkit.hf as akhf
    from tests.hf._models import tiny_model

    model = tiny_model("bert", attn_implementation="eager")
    akhf.convert(model, "dnas")
    ids = torch.randint(5, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).last_hidden_state
    reg = AlignmentRegularizer(model, method="gan")
    assert torch.equal(model(input_ids=ids).last_hidden_state, before)
    assert torch.isfinite(reg.loss())


def test_gatconv_queries_and_keys():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GATConv

    torch.manual_seed(0)
    conv = GATConv(10, 8, heads=4, dropout=0.0)
    x = torch.randn(20, 10)
    edges = torch.randint(0, 20, (2, 60))
    before = conv(x, edges)
    reg = AlignmentRegularizer(conv, method="ot")
    assert torch.equal(conv(x, edges), before)
    c = reg._captured[0][1]
    wx = conv.lin(x).view(20, 4, 8)
    torch.testing.assert_close(c.q[0], (wx * conv.att_dst).transpose(0, 1))
    torch.testing.assert_close(c.k[0], (wx * conv.att_src).transpose(0, 1))
    # the coordinate sums are GAT's two halves of the attention logit
    torch.testing.assert_close(c.q[0].sum(-1), (wx * conv.att_dst).sum(-1).T)
    reg.loss().backward()
    assert conv.att_src.grad is not None


def test_graph_transformer_queries_and_keys_give_its_attention_weights():
    """PyG's TransformerConv: the captures are its query and key projections, and softmax over each node's
    incoming edges of q_i . k_j / sqrt(C) from the captures is the layer's own attention."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import TransformerConv
    from torch_geometric.utils import softmax

    torch.manual_seed(0)
    conv = TransformerConv(10, 8, heads=4, dropout=0.0)
    x, edges = torch.randn(20, 10), torch.randint(0, 20, (2, 60))
    before = conv(x, edges)
    reg = AlignmentRegularizer(conv, method="ct")
    out, (edge_index, alpha) = conv(x, edges, return_attention_weights=True)
    assert torch.equal(out, before)
    c = reg._captured[0][1]
    assert c.q.shape == c.k.shape == (1, 4, 20, 8)
    src, dst = edge_index
    logits = (c.q[0][:, dst] * c.k[0][:, src]).sum(-1).T / 8**0.5  # (E, H)
    torch.testing.assert_close(softmax(logits, dst, num_nodes=20), alpha)
    reg.loss().backward()
    assert conv.lin_query.weight.grad.abs().sum() > 0 and conv.lin_key.weight.grad.abs().sum() > 0


def test_ot_scaling_reaches_the_sinkhorn_divergence():
    """The regularizer's OT value is ``ot_loss`` at its ``scaling``: 0.99 anneals closer to the converged
    divergence than geomloss's 0.5, which is all the regularizer could use before."""
    from attnkit.align import ot_loss

    x, pad = _batch()
    values = {}
    for scaling in (0.5, 0.99):
        model = _encoder()
        reg = AlignmentRegularizer(model, method="ot", scaling=scaling, layers=[0])
        model(x, src_key_padding_mask=pad)
        c = reg._captured[0][1]
        values[scaling] = reg.unweighted_loss()
        direct = ot_loss(c.q, c.k, c.q_mask, c.k_mask, scaling=scaling)  # (B, H), every sample has tokens
        torch.testing.assert_close(values[scaling], direct.mean())
    assert not torch.allclose(values[0.5], values[0.99], rtol=1e-4, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_losses_under_bfloat16_autocast_are_summed_in_float32(method):
    """Under ``torch.autocast("cpu", torch.bfloat16)`` mmd's kernel sums and ct's cosines ran in bfloat16:
    0.13% and 0.08% from the same captures' float32 value; the loss still trains the model."""
    torch.manual_seed(0)
    layer = ak.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = ak.nn.TransformerEncoder(layer, 1)
    reg = AlignmentRegularizer(model, method=method)
    x = torch.randn(4, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
        inside, mmd_inside = reg.unweighted_loss(), reg.mmd()
    outside = reg.unweighted_loss()
    assert reg._captured[0][1].q.dtype == torch.bfloat16
    assert inside.dtype == torch.float32 and torch.equal(inside, outside) and mmd_inside == reg.mmd()
    inside.backward()
    assert model.layers[0].self_attn.in_proj_weight.grad.abs().sum() > 0


def test_max_tokens_subsamples_and_keeps_outputs():
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="ot", max_tokens=3)
    model(x, src_key_padding_mask=pad)
    assert torch.isfinite(reg.loss())


def _subsampled_losses(before=None, after=None) -> list[float]:
    """Three forwards of an mmd regularizer with max_tokens=3, each read by loss(); ``before`` / ``after``
    (called with the model, the regularizer, x and the padding) run around every loss: diagnostics."""
    model = _encoder()
    reg = AlignmentRegularizer(model, method="mmd", max_tokens=3, seed=0)
    x, pad = _batch()
    out = []
    for _ in range(3):
        model(x, src_key_padding_mask=pad)
        if before is not None:
            before(model, reg, x, pad)
        out.append(float(reg.loss()))
        if after is not None:
            after(model, reg, x, pad)
    return out


def test_one_forward_has_one_subsample_whatever_is_read_from_it():
    """With max_tokens the tokens were redrawn at every call: mmd() twice gave two values, and logging it
    changed the losses of the following steps."""
    def log(model, reg, x, pad):
        assert reg.mmd() == reg.mmd() and float(reg.loss()) == float(reg.loss())

    assert _subsampled_losses() == _subsampled_losses(before=log)


def test_a_diagnostic_on_an_evaluation_forward_leaves_the_training_subsample_as_it_was():
    """mmd() after a forward under no_grad drew that forward's tokens from the training stream, so monitoring
    the MMD on held-out data changed every later training step's subsample (step-2 loss 0.00539 -> 0.00478).
    """
    def monitor(model, reg, x, pad):
        with torch.no_grad():
            model(x.flip(1), src_key_padding_mask=pad)
        reg.mmd()

    assert _subsampled_losses() == _subsampled_losses(after=monitor)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "wgan"}, "method='wgan'"),
        ({"weight": -0.1}, "weight=-0.1"),
        ({"weight": float("nan")}, "weight=nan"),
        ({"layers": [2]}, "index 2 is out of range"),
        ({"layers": [-1]}, "index -1 is out of range"),
        ({"layers": []}, "layers=()"),
        ({"layers": [0, 0]}, "repeats"),
        ({"layers": ["0"]}, "not an integer"),
        ({"hidden": 0}, "hidden=0"),
        ({"rho": 1.5}, "rho=1.5"),
        ({"unknown": 1}, "unknown option 'unknown'; the options are blur, gamma, hidden, max_tokens, rho, "
                            "scaling"),
        ({"method": "gan", "blur": 0.1}, "blur=0.1 does nothing for method='gan'; only method 'ot' uses it"),
        ({"method": "ot", "scaling": 1.0}, "scaling=1.0; expected a number in (0, 1)"),
        ({"method": "ot", "scaling": float("nan")}, "scaling=nan; expected a finite number"),
        ({"method": "ct", "scaling": 0.9}, "scaling=0.9 does nothing for method='ct'; only method 'ot'"),
        ({"method": "gan", "rho": 0.2}, "rho=0.2 does nothing for method='gan'; only method 'ct' uses it"),
        ({"method": "ot", "hidden": 3}, "hidden=3 does nothing for method='ot'; only method 'gan' or 'ct'"),
        ({"method": "mmd", "gamma": 2.0}, "gamma=2.0 does nothing for method='mmd'"),
        ({"seed": 2**70}, f"seed={2**70}; expected an integer in [0, 2**64)"),
        ({"seed": -1}, "seed=-1; expected an integer in [0, 2**64)"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    model = _encoder()
    with pytest.raises(ValueError, match=re.escape(match)):
        AlignmentRegularizer(model, **kwargs)


def test_model_without_attention_and_loss_before_forward_raise():
    with pytest.raises(ValueError, match="no self-attention layer"):
        AlignmentRegularizer(torch.nn.Linear(3, 3))
    reg = AlignmentRegularizer(_encoder())
    with pytest.raises(ValueError, match="run a forward pass"):
        reg.loss()
    reg.remove()
    with pytest.raises(ValueError, match="was removed"):
        reg.mmd()


def test_torch_encoder_in_eval_without_grad_packs_padding_and_still_captures():
    """torch's TransformerEncoder hands self_attn a nested tensor in eval mode under no_grad when padded."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2).eval()
    x, pad = _batch()
    with torch.no_grad():
        before = model(x, src_key_padding_mask=pad)
    reg = AlignmentRegularizer(model, method="mmd")
    with torch.no_grad():
        during = model(x, src_key_padding_mask=pad)
    assert torch.equal(during, before)
    packed = reg.mmd_per_head()
    assert torch.equal(reg._captured[0][1].k_mask, ~pad)
    model(x, src_key_padding_mask=pad)  # with grad: no nested tensor
    for a, b in zip(packed, reg.mmd_per_head()):
        torch.testing.assert_close(a, b)


def test_numpy_numbers_are_accepted_and_a_bad_seed_is_named():
    np = pytest.importorskip("numpy")
    reg = AlignmentRegularizer(
        _encoder(), method="gan", weight=np.float32(0.5), hidden=np.int64(4), layers=(np.int64(1),)
    )
    assert reg.config.weight == 0.5 and type(reg.config.weight) is float
    assert reg.config.hidden == 4 and reg.config.layers == (1,)
    with pytest.raises(ValueError, match="seed=1.5; expected an integer"):
        AlignmentRegularizer(_encoder(), seed=1.5)


@pytest.mark.parametrize("method", ("ot", "mmd", "gan", "ct"))
def test_float64_model_keeps_float64_loss(method):
    """gan's discriminator and ct's critic and navigator were built in float32 whatever the model, so their
    losses of a float64 model were computed in float32."""
    model = _encoder().double()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method=method)
    assert all(p.dtype == torch.float64 for p in reg.parameters())
    model(x.double(), src_key_padding_mask=pad)
    assert reg.loss().dtype == torch.float64


def test_half_model_gets_float32_networks():
    reg = AlignmentRegularizer(_encoder().to(torch.bfloat16), method="ct")
    assert {p.dtype for p in reg.parameters()} == {torch.float32}


def test_regularizer_left_behind_by_to_is_named():
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="gan").to("meta")  # stands for a model moved without it
    model(x, src_key_padding_mask=pad)
    with pytest.raises(ValueError, match=r"discriminator's parameters are torch.float32 on meta.*reg.to"):
        reg.loss()


def _hf_batch():
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return ids, mask


def _query_grad(model):
    return model.encoder.layer[0].attention.self.query.weight.grad.clone()


@pytest.mark.parametrize("method", ("mmd", "ct"))
def test_gradient_checkpointing_captures_each_layer_once_and_trains_alike(method):
    from tests.hf._models import tiny_model

    ids, mask = _hf_batch()
    results = []
    for checkpointing in (False, True):
        model = tiny_model("bert").train()
        for module in model.modules():  # dropout off: the two runs must see the same forward
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        reg = AlignmentRegularizer(model, method=method, weight=1.0)
        model(input_ids=ids, attention_mask=mask)
        loss = reg.loss()
        before = reg.mmd()
        loss.backward()  # checkpointing recomputes both layers here
        assert len(reg._captured) == 2
        assert reg.mmd() == before
        results.append((float(loss.detach()), _query_grad(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][1].abs().sum() > 0


def test_reentrant_checkpointing_is_named_instead_of_an_untrained_loss():
    from tests.hf._models import tiny_model

    model = tiny_model("bert").train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    reg = AlignmentRegularizer(model, method="mmd")
    ids, mask = _hf_batch()
    model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="use_reentrant"):
        reg.loss()
    assert reg.mmd() > 0  # the diagnostics need no gradient
    model.activation_checkpointing_disable()
    model(input_ids=ids, attention_mask=mask)
    assert reg.loss().requires_grad


def test_torch_checkpoint_in_a_users_model_captures_once():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.inner, self.reentrant = _encoder().train(), reentrant

        def forward(self, x, pad):
            return checkpoint(self.inner, x, None, pad, use_reentrant=self.reentrant)  # (src, mask, padding)

    x, pad = _batch()
    x.requires_grad_(True)
    model = Checkpointed(reentrant=False)
    reg = AlignmentRegularizer(model, method="ot")
    (model(x, pad).sum() + reg.loss()).backward()
    assert len(reg._captured) == 2
    model = Checkpointed(reentrant=True)
    reg = AlignmentRegularizer(model, method="ot")
    model(x, pad)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        reg.loss()


def test_a_submodule_called_alone_is_not_captured():
    from tests.hf._models import tiny_model

    model = tiny_model("bert")
    ids, mask = _hf_batch()
    reg = AlignmentRegularizer(model, method="mmd")
    model(input_ids=ids, attention_mask=mask)
    value = reg.mmd()
    for _ in range(3):  # neither piles up nor reads a mask the call was not given
        model.encoder(model.embeddings(ids))
    assert len(reg._captured) == 2 and reg.mmd() == value
    fresh = AlignmentRegularizer(_encoder(), method="mmd")
    fresh._model[0].layers[0](torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="TransformerEncoder the regularizer is attached to"):
        fresh.loss()


def test_layers_that_cannot_be_read_are_left_out_with_a_warning_unless_chosen_by_name():
    from tests.hf._models import tiny_model

    model = tiny_model("bert")
    reg = AlignmentRegularizer(model, method="mmd")
    ids, mask = _hf_batch()
    with pytest.warns(UserWarning, match=r"encoder\.layer\.0\.attention\.self.*left out"):
        with pytest.raises(RuntimeError):  # BERT itself then fails on a mask of the wrong length
            model(input_ids=ids, attention_mask=mask[:, :5].contiguous())
    with pytest.raises(ValueError, match=r"no self-attention layer was captured.*\(2, 7\)"):
        reg.loss()
    model(input_ids=ids, attention_mask=mask)
    assert len(reg._captured) == 2 and torch.isfinite(reg.loss())


def test_a_forward_that_raises_leaves_the_next_one_captured():
    from tests.hf._models import tiny_model

    model = tiny_model("bert")
    reg = AlignmentRegularizer(model, method="mmd", layers=[0, 1])  # chosen by name: a mismatch raises
    ids, mask = _hf_batch()
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self.*\(2, 7\).*\(2, 5\).*layers="):
        model(input_ids=ids, attention_mask=mask[:, :5].contiguous())  # refused by the capture
    model(input_ids=ids, attention_mask=mask)
    assert len(reg._captured) == 2
    model.encoder(model.embeddings(ids))
    assert len(reg._captured) == 2  # the failed forward did not leave the model marked as running


@pytest.mark.parametrize("family", ["attnkit", "bert", "gat", "graph_transformer"])
def test_a_deep_copy_of_the_model_does_not_write_into_the_regularizer(family):
    """copy.deepcopy (an EMA model, a best-so-far snapshot) copies the hooks; the copy's forward must not
    replace the original's captures."""
    import copy

    if family == "attnkit":
        model = _encoder()
        x, pad = _batch()
        run = lambda m, scale=1.0: m(x * scale, src_key_padding_mask=pad)  # noqa: E731
    elif family == "bert":
        from tests.hf._models import tiny_model

        model = tiny_model("bert")
        ids, mask = _hf_batch()
        run = lambda m, scale=1.0: m(input_ids=ids if scale == 1.0 else ids.flip(1), attention_mask=mask)  # noqa: E731
    else:
        pytest.importorskip("torch_geometric")
        from torch_geometric.nn import GATConv, TransformerConv

        torch.manual_seed(0)
        model = (GATConv if family == "gat" else TransformerConv)(10, 8, heads=4, dropout=0.0)
        x, edges = torch.randn(20, 10), torch.randint(0, 20, (2, 60))
        run = lambda m, scale=1.0: m(x * scale + (scale - 1.0), edges)  # noqa: E731 (MMD ignores a scale)
    reg = AlignmentRegularizer(model, method="mmd")
    run(model)
    value, calls = reg.mmd(), len(reg._captured)
    twin = copy.deepcopy(model)
    run(twin, 10.0)
    assert reg.mmd() == value and len(reg._captured) == calls
    run(model, 10.0)
    assert reg.mmd() != value  # the original is still captured


@pytest.mark.parametrize("method", ["gan", "ct", "mmd"])
def test_a_forward_under_inference_mode_gives_a_clear_error_from_loss(method):
    """It was torch's "Inference tensors cannot be saved for backward" from inside the loss."""
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method=method)
    with torch.inference_mode():
        model(x, src_key_padding_mask=pad)
    assert reg.mmd() > 0
    with pytest.raises(ValueError, match="ran under torch.inference_mode"):
        reg.loss()
    with torch.no_grad():
        model(x, src_key_padding_mask=pad)
    assert torch.isfinite(reg.loss())


def test_loss_under_no_grad_after_an_inference_mode_forward_is_read():
    model = _encoder()
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method="gan")
    with torch.inference_mode():
        model(x, src_key_padding_mask=pad)
    with torch.no_grad():
        assert torch.isfinite(reg.loss())


def test_a_data_parallel_replica_is_refused_by_name():
    # nn.DataParallel on several GPUs runs replicas, which no hook captured: reg.loss() then said "no queries
    # and keys captured yet; run a forward pass"
    from attnkit.align import AlignmentRegularizer
    from attnkit.models.classifier import TransformerClassifier

    torch.manual_seed(0)
    model = TransformerClassifier(50, 3, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.0)
    AlignmentRegularizer(model, "mmd")
    copies = {module: module._replicate_for_data_parallel() for module in model.modules()}  # as replicate()
    for module, replica in copies.items():
        for key, child in module._modules.items():
            if child is not None:
                setattr(replica, key, copies[child])
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        copies[model](torch.randint(1, 50, (2, 6)))


def test_a_regularizer_checkpoint_of_another_layout_names_what_differs(tmp_path):
    """The error said only "(Error(s) in loading state_dict for AlignmentRegularizer:)"; a checkpoint
    written before the highway layer had a separate gate and transform now says so."""
    from safetensors.torch import load_file, save_file

    from attnkit.align.trainer import REGULARIZER_FILE, load_regularizer, save_regularizer

    reg = AlignmentRegularizer(_encoder(), method="ct")
    save_regularizer(reg, tmp_path)
    load_regularizer(reg, tmp_path)  # its own file fits
    tensors = load_file(tmp_path / REGULARIZER_FILE)
    old = {k.replace(".highway.gate.", ".highway.linear."): v for k, v in tensors.items()
           if ".highway.transform." not in k}  # one matrix for both, as it was saved before
    save_file(old, tmp_path / REGULARIZER_FILE)
    with pytest.raises(ValueError, match=r"missing critics\.0\.highway\.gate\.weight.*unexpected "
                                         r"critics\.0\.highway\.linear.*earlier attnkit.*cannot be resumed"):
        load_regularizer(reg, tmp_path)


def test_each_process_resumes_its_own_subsampling_stream(tmp_path):
    """With max_tokens each process draws over its own padded length, so the processes' generators part; the
    checkpoint held rank 0's alone and every process resumed on it (weights 5.7e-3 off the uninterrupted
    2-process run)."""
    import torch

    from attnkit.align.trainer import load_regularizer, save_regularizer

    model = _encoder()
    ranks = [AlignmentRegularizer(model, method="ct", seed=s) for s in (0, 1)]
    for r, reg in enumerate(ranks):
        torch.randperm(7 + r, generator=reg._generator)  # the streams part
    states = [reg._generator.get_state() for reg in ranks]
    save_regularizer(ranks[0], tmp_path, rank_generators=states)
    for rank in (0, 1):
        resumed = AlignmentRegularizer(model, method="ct", seed=0)
        load_regularizer(resumed, tmp_path, rank=rank, world=2)
        assert torch.equal(resumed._generator.get_state(), states[rank])
    resumed = AlignmentRegularizer(model, method="ct", seed=0)  # another number of processes: rank 0's
    load_regularizer(resumed, tmp_path, rank=1, world=3)
    assert torch.equal(resumed._generator.get_state(), states[0])


def test_a_regularizer_checkpoint_resumes_only_with_the_settings_it_was_saved_with(tmp_path):
    """A checkpoint of an mmd regularizer (no parameters) was taken by an ot one, or by one of another
    weight: the resumed run silently was not the uninterrupted one."""
    from safetensors.torch import load_file, save_file

    from attnkit.align.trainer import REGULARIZER_FILE, load_regularizer, save_regularizer

    model = _encoder()
    save_regularizer(AlignmentRegularizer(model, method="mmd", weight=0.01), tmp_path)
    load_regularizer(AlignmentRegularizer(model, method="mmd", weight=0.01, seed=3), tmp_path)  # state saved
    with pytest.raises(ValueError, match=r"method='mmd' \(now 'ot'\).*same settings"):
        load_regularizer(AlignmentRegularizer(model, method="ot", weight=0.01), tmp_path)
    with pytest.raises(ValueError, match=r"weight=0\.01 \(now 5\.0\)"):
        load_regularizer(AlignmentRegularizer(model, method="mmd", weight=5.0), tmp_path)
    with pytest.raises(ValueError, match=r"layers=None \(now \[0\]\)"):
        load_regularizer(AlignmentRegularizer(model, method="mmd", weight=0.01, layers=(0,)), tmp_path)
    save_file(load_file(tmp_path / REGULARIZER_FILE), tmp_path / REGULARIZER_FILE)  # older: no settings
    load_regularizer(AlignmentRegularizer(model, method="mmd", weight=5.0), tmp_path)


def test_a_damaged_or_diverged_regularizer_checkpoint_is_one_value_error(tmp_path):
    """A NaN critic loaded without a word (every later loss NaN), a float generator state was torch's
    TypeError, settings that are not a dict (or lack the method) skipped the settings check, and a folder in
    the file's place read as "saved without the alignment regularizer"."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from attnkit.align.trainer import REGULARIZER_FILE, load_regularizer, save_regularizer

    reg = AlignmentRegularizer(_encoder(), method="ct")
    save_regularizer(reg, tmp_path / "good")
    tensors = load_file(tmp_path / "good" / REGULARIZER_FILE)
    with safe_open(str(tmp_path / "good" / REGULARIZER_FILE), framework="pt") as f:
        metadata = f.metadata()
    settings = json.loads(metadata["attnkit.align.settings"])
    nan = {k: v.clone() for k, v in tensors.items()}
    name = next(k for k in nan if k.startswith("state.critics"))
    nan[name][..., 0] = float("nan")
    cases = {
        "diverged": (nan, metadata, r"non-finite values \(NaN or inf\) in critics\..*earlier checkpoint"),
        "float-generator": ({**tensors, "_generator_state": tensors["_generator_state"].float()}, metadata,
                            r"damaged _generator_state \(torch\.float32"),
        "settings-list": (tensors, {"attnkit.align.settings": "[1, 2]"}, "damaged settings"),
        "settings-without-method": (tensors, {"attnkit.align.settings": json.dumps(
            {k: v for k, v in settings.items() if k != "method"})}, "damaged settings"),
    }
    for case, (content, meta, message) in cases.items():
        (tmp_path / case).mkdir()
        save_file(content, tmp_path / case / REGULARIZER_FILE, metadata=meta)
        with pytest.raises(ValueError, match=message):
            load_regularizer(reg, tmp_path / case)
    (tmp_path / "folder" / REGULARIZER_FILE).mkdir(parents=True)
    with pytest.raises(ValueError, match="is a folder, not the regularizer's file"):
        load_regularizer(reg, tmp_path / "folder")
    load_regularizer(reg, tmp_path / "good")


@pytest.mark.parametrize("method", METHODS)
def test_building_the_regularizer_leaves_the_global_rng_as_it_was(method):
    """The discriminator / critic / navigator init drew from torch's global RNG, so every later dropout draw
    shifted: `compare --align none,gan` with weight 0 gave different numbers for the two rows."""
    model = _encoder()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    reg = AlignmentRegularizer(model, method=method, weight=0.0)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)  # the init still follows the global seed
    again = AlignmentRegularizer(model, method=method, weight=0.0)
    assert all(torch.equal(a, b) for a, b in zip(reg.parameters(), again.parameters()))


@pytest.mark.parametrize("float_mask", [False, True])
def test_query_padding_mask_keeps_padded_queries_out_of_mmd_per_head(float_mask):
    """attnkit's MultiheadAttention takes the queries' own padding; the capture read key_padding_mask for the
    queries too, so padded queries entered the loss."""
    torch.manual_seed(0)
    m = ak.nn.MultiheadAttention(8, 2, mechanism="dnas", batch_first=True).double()
    reg = AlignmentRegularizer(m, method="mmd")
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    qpad = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)  # True = padded query
    mask = torch.zeros(2, 5, dtype=torch.float64).masked_fill(qpad, float("-inf")) if float_mask else qpad
    m(x, x, x, query_padding_mask=mask)
    w_q, w_k, _ = m.in_proj_weight.chunk(3)
    b_q, b_k, _ = m.in_proj_bias.chunk(3)
    q = (x @ w_q.T + b_q).view(2, 5, 2, 4).transpose(1, 2)  # (B, H, L, D)
    k = (x @ w_k.T + b_k).view(2, 5, 2, 4).transpose(1, 2)  # (B, H, L, D)
    # by hand, over the real queries of each sample and every key
    expected = torch.stack([mmd(q[b:b + 1, :, : int((~qpad[b]).sum())], k[b:b + 1])[0] for b in range(2)])
    torch.testing.assert_close(reg.mmd_per_head()[0].double(), expected.mean(0), rtol=1e-5, atol=1e-6)
    assert torch.equal(reg._captured[0][1].q_mask, ~qpad)
    assert torch.equal(reg._captured[0][1].k_mask, torch.ones(2, 5, dtype=torch.bool))


def test_an_unbatched_call_keeps_its_query_padding_mask_in_the_capture():
    """An unbatched (L, E) call reshapes its masks to (1, L): dropping the query mask there let the padded
    queries into the loss (the keys' all-real mask served them)."""
    torch.manual_seed(0)
    m = ak.nn.MultiheadAttention(8, 2, mechanism="dnas", batch_first=True).double()
    reg = AlignmentRegularizer(m, method="mmd")
    x = torch.randn(5, 8, dtype=torch.float64)
    qpad = torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool)  # True = padded query
    m(x, x, x, query_padding_mask=qpad)
    c = reg._captured[0][1]
    assert torch.equal(c.q_mask, ~qpad[None]) and torch.equal(c.k_mask, torch.ones(1, 5, dtype=torch.bool))
    w_q, w_k, _ = m.in_proj_weight.chunk(3)
    b_q, b_k, _ = m.in_proj_bias.chunk(3)
    q = (x @ w_q.T + b_q).view(1, 5, 2, 4).transpose(1, 2)[:, :, :3]  # (1, H, 3 real queries, D)
    k = (x @ w_k.T + b_k).view(1, 5, 2, 4).transpose(1, 2)  # (1, H, 5, D)
    torch.testing.assert_close(reg.mmd_per_head()[0].double(), mmd(q, k)[0], rtol=1e-5, atol=1e-6)


def test_a_model_holding_a_hugging_face_model_names_the_submodule_to_attach_to():
    from tests.hf._models import tiny_model

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = tiny_model("bert")
            self.head = torch.nn.Linear(self.bert.config.hidden_size, 2)

    match = r"holds one \(model\.bert \(BertModel\)\).*AlignmentRegularizer\(model\.bert, \.\.\.\)"
    with pytest.raises(ValueError, match=match):
        AlignmentRegularizer(Classifier(), method="ct")

    class Pooled(Classifier):  # attention beside the Hugging Face model: BERT's layers were left out silently
        def __init__(self) -> None:
            super().__init__()
            self.pool = torch.nn.MultiheadAttention(self.bert.config.hidden_size, 2, batch_first=True)

    with pytest.raises(ValueError, match=match):
        AlignmentRegularizer(Pooled(), method="ct")
    assert len(AlignmentRegularizer(Pooled(), method="ct", layers=[0]).sites) == 1  # its own, chosen
    wrapped = torch.nn.Sequential(Classifier())  # a sentence-transformers-like index: valid Python named
    with pytest.raises(ValueError, match=r"AlignmentRegularizer\(model\.get_submodule\('0\.bert'\), "):
        AlignmentRegularizer(wrapped, method="ct")


def test_a_held_attention_free_hugging_face_backbone_leaves_the_module_its_own_attention():
    """A captioner with a transformers ResNet backbone (no attention) beside its own attention was refused,
    and the suggested AlignmentRegularizer(model.backbone) failed: the ResNet has no attention layer."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)

    class Captioner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, img):
            f = self.backbone(pixel_values=img).last_hidden_state.flatten(2).transpose(1, 2)  # (B, L, E)
            return self.attn(f, f, f)[0]

    model = Captioner().eval()
    reg = AlignmentRegularizer(model, method="mmd")
    assert [site.name for site in reg.sites] == ["attn"]
    model(torch.randn(2, 3, 32, 32))
    assert torch.isfinite(reg.loss()) and reg.mmd() > 0


def test_the_layers_escape_is_offered_only_to_a_module_with_attention_of_its_own():
    """A module holding only a Hugging Face model was told to "pass layers= to take this module's own
    attention layers only", which it has none of, with layers= given or not."""
    from tests.hf._models import tiny_model

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = tiny_model("bert")
            self.head = torch.nn.Linear(self.bert.config.hidden_size, 2)

    for layers in (None, [0]):
        with pytest.raises(ValueError, match=r"AlignmentRegularizer\(model\.bert, \.\.\.\)") as error:
            AlignmentRegularizer(Classifier(), method="ct", layers=layers)
        assert "layers=" not in str(error.value)

    class Pooled(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.pool = torch.nn.MultiheadAttention(self.bert.config.hidden_size, 2, batch_first=True)

    with pytest.raises(ValueError, match=r"or pass layers= to take this module's own attention layers"):
        AlignmentRegularizer(Pooled(), method="ct")


def test_a_submodule_named_after_a_python_keyword_is_reached_by_valid_python():
    """``model.class`` is a syntax error: the message suggested it for a submodule named "class"."""
    from tests.hf._models import tiny_model

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, "class", tiny_model("bert"))

    with pytest.raises(ValueError, match=r"AlignmentRegularizer\(model\.get_submodule\('class'\), "):
        AlignmentRegularizer(Holder(), method="ct")


def _broadcast_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # no common seed before building the regularizer
        reg = AlignmentRegularizer(_encoder(), method="ct")
        reg.register_buffer("counter", torch.full((2,), float(rank)))  # buffers travel too
        built = [t.clone() for t in reg.state_dict().values()]
        reg.broadcast_parameters()
        torch.save({"built": built, "synced": list(reg.state_dict().values())}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_broadcast_parameters_gives_every_process_rank_zeros_regularizer(tmp_path):
    """DDP broadcasts the wrapped model only: processes that built the regularizer from different RNG states
    trained different critics forever (sync_gradients averages gradients, not weights)."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/rendezvous"
    mp.spawn(_broadcast_worker, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert any(not torch.equal(a, b) for a, b in zip(r0["built"], r1["built"]))  # they started apart
    assert all(torch.equal(a, b) for a, b in zip(r0["synced"], r1["synced"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["synced"], r0["built"]))  # rank 0's, unchanged


@pytest.mark.parametrize("method", ("mmd", "gan"))
def test_a_nan_query_of_a_real_token_is_named_by_layer_and_head_instead_of_a_nan_loss(method):
    """The first bad layer and, in it, the first bad head are named (later ones may be NaN through it)."""
    model = _encoder(layers=3)
    x, pad = _batch()
    reg = AlignmentRegularizer(model, method=method)
    model(x, src_key_padding_mask=pad)
    assert torch.isfinite(reg.loss())
    index, c = reg._captured[1]
    c.q[0, 2, 1, 0] = float("nan")  # sample 0, head 2, a real token of layer 1
    c.q[1, 3, 0, 1] = float("inf")  # a later head of the same layer
    reg._captured[2][1].k[0, 0, 0, 0] = float("nan")  # and a later layer
    reg._drawn = None
    with pytest.raises(ValueError, match=r"layer 'layers\.1\.self_attn', head 2, hold NaN or inf at real"):
        reg.loss()
    model(x, src_key_padding_mask=pad)
    c = reg._captured[0][1]
    padded = int((~c.k_mask[1]).nonzero()[0])
    c.k[1, 0, padded] = float("inf")  # a padded key changes nothing
    assert torch.isfinite(reg.loss())


def test_a_chosen_layer_that_the_forward_never_ran_as_self_attention_is_named():
    class Cross(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, memory):
            return self.attn(x, memory, memory)[0]

    model = Cross()
    reg = AlignmentRegularizer(model, method="mmd", layers=[0])
    model(torch.randn(2, 3, 8), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"called none of the chosen self-attention layers \('attn'\)"):
        reg.loss()
