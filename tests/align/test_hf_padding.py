"""Where a Hugging Face model's padding is not a plain (B, L) attention_mask over the layers' positions:
multiple-choice masks (N, C, L), packed (padding-free) batches told apart by position_ids, and a Perceiver
whose layers run on latents."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from attnkit.align import AlignmentRegularizer  # noqa: E402


def test_a_multiple_choice_mask_equals_its_flattened_rows():
    """BertForMultipleChoice takes attention_mask (N, C, L), as DataCollatorForMultipleChoice makes it."""
    from transformers import BertConfig, BertForMultipleChoice

    torch.manual_seed(0)
    model = BertForMultipleChoice(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=32)).eval()
    ids = torch.randint(5, 90, (2, 3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 3, 6, dtype=torch.long)
    mask[:, :, 4:] = 0
    mask[1, 2, 2:] = 0
    reg = AlignmentRegularizer(model, method="mmd")
    model(input_ids=ids, attention_mask=mask)
    choices = reg.mmd_per_head()
    assert torch.equal(reg._captured[0][1].q_mask, mask.view(6, 6) > 0)
    model(input_ids=ids, attention_mask=mask.view(6, 6))
    for a, b in zip(choices, reg.mmd_per_head()):
        torch.testing.assert_close(a, b)


PADDED = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])  # (B, L) 0/1


def _assert_read_as(mask, extended) -> None:
    """A tiny BERT's regularizer reads the padding of ``extended`` (a form of attention_mask) as that of the
    (B, L) 0/1 ``mask``: the same key mask and the same loss."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).eval()
    ids = torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    reg = AlignmentRegularizer(model, method="mmd")
    model(ids, attention_mask=mask)
    expected = reg.mmd_per_head()
    model(ids, attention_mask=extended)
    assert torch.equal(reg._captured[0][1].k_mask, mask > 0)
    for a, b in zip(expected, reg.mmd_per_head()):
        torch.testing.assert_close(a, b)


def test_an_extended_additive_mask_equals_its_0_1_mask():
    """A (B, 1, 1, L) additive mask (0 = real, finfo.min = padding) gives the (B, L) 0/1 mask's loss, not a
    loss of 0.0 over all-padding rows."""
    additive = (1 - PADDED[:, None, None, :].float()) * torch.finfo(torch.float32).min  # (B, 1, 1, L)
    _assert_read_as(PADDED, additive)


@pytest.mark.parametrize("form", ["bool", "float01", "additive-unpadded"])  # sdpa refuses a long one
def test_every_extended_mask_form_is_read_as_the_model_reads_it(form):
    """transformers adds a non-bool (B, 1, 1, L) mask to the scores: a float 0/1 one pads nothing (+1 and +0
    are scores), so the regularizer reads it all real, as the model runs it; a bool one pads where False; a
    float one of zeros only (an additive one on a batch without padding) is all real, not refused."""
    mask = PADDED if form == "bool" else torch.ones_like(PADDED)
    extended = {"bool": PADDED.bool(), "float01": PADDED.float(),
                "additive-unpadded": torch.zeros(2, 6)}[form][:, None, None, :]  # (B, 1, 1, L)
    _assert_read_as(mask, extended)


@pytest.mark.parametrize("form", ["bool", "additive"])
def test_an_extended_mask_of_one_row_applies_to_every_row_as_in_the_model(form):
    """The attention broadcasts a (1, 1, 1, L) mask over the batch; the regularizer left every layer out
    (blaming a vision tower) and then found no layer."""
    row = torch.tensor([[1, 1, 1, 1, 1, 0]])
    extended = row.bool() if form == "bool" else (1 - row.float()) * torch.finfo(torch.float32).min
    _assert_read_as(row.expand(2, 6), extended.view(1, 1, 1, 6))


@pytest.mark.parametrize("dims", [2, 3])
def test_a_plain_mask_with_negative_entries_is_refused(dims):
    """A (B, L) mask is 1 = real, 0 = padding to transformers (any nonzero real); an additive one given there
    was read as 0 = real, the complement of what the model attends to."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).eval()
    AlignmentRegularizer(model, method="mmd")
    additive = (1 - PADDED.float()) * torch.finfo(torch.float32).min  # (B, L)
    ids = torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    if dims == 3:  # a multiple-choice model's (N, C, L) layout
        additive, ids = additive[:, None], ids
    with pytest.raises(ValueError, match="negative entries.*1 for real tokens and 0 for padding"):
        if dims == 2:
            model(ids, attention_mask=additive)
        else:
            from attnkit.align.hf_sites import _hf_valid

            _hf_valid(additive, 2, 6, "cpu")


def test_a_float_0_1_extended_mask_pads_nothing_in_the_model_either():
    """The reading above is the model's: under a float 0/1 (B, 1, 1, L) mask BERT's real tokens attend to the
    padding too (their outputs are not those of the (B, L) mask), while a bool one pads."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).eval()
    ids = torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        padded = model(ids, attention_mask=PADDED).last_hidden_state
        float01 = model(ids, attention_mask=PADDED.float()[:, None, None, :]).last_hidden_state
        bool4d = model(ids, attention_mask=PADDED.bool()[:, None, None, :]).last_hidden_state
    torch.testing.assert_close(bool4d[0, :4], padded[0, :4])
    assert not torch.allclose(float01[0, :4], padded[0, :4], atol=1e-4)  # PADDED's row 0 has padding


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("method", ("mmd", "ct"))
def test_a_packed_batch_equals_the_mean_of_its_sequences_run_apart(method):
    """DataCollatorWithFlattening packs sequences into one row, told apart by position_ids restarting at 0;
    the model attends per sequence, and the regularizer matched each query against every sequence's keys."""
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, 90, (1, n), generator=g) for n in (4, 3, 5)]
    packed = torch.cat(seqs, 1)  # (1, 12)
    positions = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]  # (1, 12): 0..3, 0..2, 0..4
    reg = AlignmentRegularizer(model, method=method, weight=1.0)
    with torch.no_grad():
        model(input_ids=packed, position_ids=positions, use_cache=False)
        together, per_head = reg.loss(), reg.mmd_per_head()
        assert [tuple(c.q.shape[::2]) for _, c in reg._captured] == [(3, 5)] * 2  # 3 sequences, up to 5 long
        apart, heads = [], []
        for s in seqs:
            model(input_ids=s, use_cache=False)
            apart.append(reg.loss())
            heads.append(reg.mmd_per_head())
    torch.testing.assert_close(together, torch.stack(apart).mean(), rtol=1e-5, atol=1e-6)
    for layer, values in enumerate(per_head):
        apart_mean = torch.stack([h[layer] for h in heads]).mean(0)  # (H,)
        torch.testing.assert_close(values, apart_mean, rtol=1e-5, atol=1e-6)


def test_an_unpacked_row_with_position_ids_is_one_sample():
    model = _tiny_llama()
    ids = torch.randint(5, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    reg = AlignmentRegularizer(model, method="mmd")
    model(input_ids=ids, position_ids=torch.arange(6)[None], use_cache=False)
    assert [tuple(c.q.shape[::2]) for _, c in reg._captured] == [(2, 6)] * 2


def test_an_encoders_packed_row_is_one_sample_as_the_model_computes_it():
    """BERT's bidirectional mask ignores position_ids (transformers packs causal masks alone): its packed row
    attends across the sequences, so the regularizer's capture is the row's, as without position_ids; it
    was split into the sequences, which the model does not compute."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32)).eval()
    with torch.no_grad():  # the queries and keys the same with and without position_ids
        model.embeddings.position_embeddings.weight.zero_()
    ids = torch.randint(5, 50, (1, 7), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two sequences, 3 and 4 long
    reg = AlignmentRegularizer(model, method="mmd")
    with torch.no_grad():
        packed = model(ids, position_ids=positions).last_hidden_state
        first = model(ids[:, :3], position_ids=positions[:, :3]).last_hidden_state
        assert not torch.allclose(packed[:, :3], first, atol=1e-5)  # the model does not split the row
        model(ids, position_ids=positions)
        together = [c for _, c in reg._captured]
        per_head = reg.mmd_per_head()
        model(ids)
    assert [tuple(c.q.shape[::2]) for c in together] == [(1, 7)] * 2
    for c, plain in zip(together, (c for _, c in reg._captured)):
        assert torch.equal(c.q, plain.q) and torch.equal(c.k, plain.k) and bool(c.q_mask.all())
    for a, b in zip(per_head, reg.mmd_per_head()):
        torch.testing.assert_close(a, b)


def _perceiver():
    from transformers import PerceiverConfig, PerceiverModel

    torch.manual_seed(0)
    config = PerceiverConfig(num_latents=8, d_latents=16, d_model=16, num_blocks=1,
                             num_self_attends_per_block=1, num_self_attention_heads=2,
                             num_cross_attention_heads=1, qk_channels=16, v_channels=16)
    return PerceiverModel(config).eval()


@pytest.mark.parametrize("length", (8, 6))
def test_perceiver_latents_never_read_the_inputs_mask_even_when_the_lengths_match(length):
    """8 latents and 8 (or 6) input positions: the inputs' mask was applied to the latents (latents 5-7
    dropped) when the lengths matched, and the latent layers were left out (reg.loss() raised) when the inputs
    were padded. The latents have no padding: their masks are all real, with or without the inputs' mask."""
    import warnings

    model = _perceiver()
    x = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, 5:] = 0
    reg = AlignmentRegularizer(model, method="mmd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer is left out
        model(inputs=x, attention_mask=mask)
    assert torch.isfinite(reg.loss())
    assert [c.q_mask.shape == c.k_mask.shape == (2, 8) for _, c in reg._captured] == [True]
    assert [bool(c.q_mask.all() and c.k_mask.all()) for _, c in reg._captured] == [True]
    padded = reg.mmd_per_head()
    model(inputs=x)  # without a mask every latent is real
    assert [c.q_mask.all().item() for _, c in reg._captured] == [True]
    assert padded[0].shape == reg.mmd_per_head()[0].shape == (2,)


def test_perceiver_lists_only_the_layers_it_captures():
    """Its cross-attention (inputs -> latents) was listed as layer 0 but never captured: layers=[0] failed
    with "run a forward pass"."""
    model = _perceiver()
    reg = AlignmentRegularizer(model, method="mmd", layers=[0])
    assert [s.name for s in reg.sites] == ["encoder.self_attends.0.attention.self"]
    model(inputs=torch.randn(2, 8, 16))
    assert reg._captured[0][1].q.shape == (2, 2, 8, 8)
    model(inputs=torch.randn(2, 6, 16), attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6]))
    assert torch.isfinite(reg.loss()) and bool(reg._captured[0][1].q_mask.all())


def test_a_layer_after_the_cross_attention_with_a_mask_of_its_own_is_left_out():
    """A latent layer the model hands a mask of its own: the regularizer does not read that mask, so the layer
    is left out (a warning; a ValueError under layers=) rather than taken as all real."""
    model = _perceiver()
    layer = model.encoder.self_attends[0].attention.self

    def own_mask(module, args):  # (hidden_states, attention_mask, ...): an additive (B, 1, Lq, Lk) mask
        return (args[0], torch.zeros(args[0].shape[0], 1, 8, 8), *args[2:])

    layer.register_forward_pre_hook(own_mask, prepend=True)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    reg = AlignmentRegularizer(model, method="mmd")
    with pytest.warns(UserWarning, match="passes it an attention mask of its own"):
        model(inputs=x)
    assert reg._captured == []
    model = _perceiver()
    model.encoder.self_attends[0].attention.self.register_forward_pre_hook(own_mask, prepend=True)
    AlignmentRegularizer(model, method="mmd", layers=[0])
    with pytest.raises(ValueError, match="passes it an attention mask of its own"):
        model(inputs=x)
