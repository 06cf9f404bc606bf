"""Models whose attention is more than softmax of q k^T plus a mask: T5's relative position bias is taken as
an additive score bias (outputs, gradients and generation equal the model's own attention); attention sinks,
logit soft-capping or any attention function that differs from softmax are refused at conversion, before the
model changes, instead of being replaced by plain softmax without a word."""

from __future__ import annotations

import pytest
import torch

import attnkit.hf as akhf
from attnkit.hf.attention_interface import attention_forward
from tests.hf._models import padded_batch, tiny_config, tiny_model, twin

pytestmark = pytest.mark.hf


def _t5(seed=0, generation=False):
    from transformers import T5ForConditionalGeneration

    if not generation:
        return tiny_model("t5", seed)
    torch.manual_seed(seed)
    return T5ForConditionalGeneration._from_config(tiny_config("t5"), attn_implementation="eager").eval()


def _t5_forward(model, ids, mask):
    decoder_ids = ids[:, :5].clone()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    return out.encoder_last_hidden_state, out.last_hidden_state  # (B, L, E), (B, 5, E)


def test_t5_softmax_equals_its_own_attention_with_the_position_bias_outputs_and_gradients():
    eager = _t5()
    converted = akhf.convert(twin(eager), "softmax")
    ids, mask = padded_batch()
    valid = mask[..., None].bool()  # (B, L, 1)
    outs = []
    for model in (eager, converted):
        model.zero_grad()
        enc, dec = _t5_forward(model, ids, mask)
        ((enc * valid).square().sum() + dec.square().sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((enc * valid, dec, grads))
    (enc_e, dec_e, grads_e), (enc_c, dec_c, grads_c) = outs
    torch.testing.assert_close(enc_c, enc_e, atol=1e-5, rtol=0)
    torch.testing.assert_close(dec_c, dec_e, atol=1e-5, rtol=0)
    assert grads_c.keys() == grads_e.keys()
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads_e[bias].abs().sum() > 0
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], atol=1e-4, rtol=1e-4, msg=name)


def test_t5_generation_after_softmax_conversion_gives_the_same_tokens_and_scores():
    eager = _t5(generation=True)
    converted = akhf.convert(twin(eager), "softmax")
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    ours, theirs = converted.generate(ids, **kwargs), eager.generate(ids, **kwargs)  # the decoder's cache on
    torch.testing.assert_close(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_t5_encoder_converts_with_its_position_bias_and_padding_equals_alone(mechanism):
    model = akhf.convert(_t5(), mechanism)
    assert all(".encoder." in f".{name}" for name in model.config.attnkit["modules"])
    ids, mask = padded_batch()
    with torch.no_grad():
        batch, _ = _t5_forward(model, ids, mask)
        for b, n in enumerate(mask.sum(1).tolist()):
            alone, _ = _t5_forward(model, ids[b : b + 1, :n], mask[b : b + 1, :n])
            torch.testing.assert_close(batch[b, :n], alone[0], atol=1e-5, rtol=0)
    unbiased = twin(model)
    with torch.no_grad():
        for module in unbiased.modules():
            if hasattr(module, "relative_attention_bias"):
                module.relative_attention_bias.weight.zero_()
        assert not torch.allclose(_t5_forward(unbiased, ids, mask)[0], batch)  # the bias is used


def test_t5_refuses_coda_at_conversion():
    model = _t5()
    with pytest.raises(ValueError, match="position bias.*CoDA cannot take"):
        akhf.convert(model, "coda")
    assert akhf.conversion(model) is None and model.config._attn_implementation == "eager"


@pytest.mark.parametrize(("family", "keyword"), [("gpt_oss", "s_aux="), ("gemma2", "softcap=")])
def test_attention_sinks_and_soft_capping_are_refused_before_the_model_changes(family, keyword):
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"passes {keyword}.*attnkit cannot replace its attention"):
        akhf.convert(model, "softmax")
    assert akhf.conversion(model) is None and model.config._attn_implementation == "eager"
    assert model.state_dict().keys() == before.keys()


def test_gemma3_without_soft_capping_converts_and_equals_its_own_attention():
    eager = tiny_model("gemma3")
    converted = akhf.convert(twin(eager), "softmax")
    ids, mask = padded_batch()
    with torch.no_grad():
        a = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        b = converted(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask[..., None].bool()
    torch.testing.assert_close(b * valid, a * valid, atol=1e-5, rtol=0)


def test_an_attention_function_that_is_not_softmax_is_refused(monkeypatch):
    from transformers.models.bert import modeling_bert

    plain = modeling_bert.eager_attention_forward

    def sharper(module, query, key, value, attention_mask, scaling=None, **kwargs):  # a different score scale
        return plain(module, query, key, value, attention_mask, scaling=2 * scaling, **kwargs)

    monkeypatch.setattr(modeling_bert, "eager_attention_forward", sharper)
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="does not compute plain softmax attention: .* differs .* by"):
        akhf.convert(model, "dnas")
    assert akhf.conversion(model) is None


def test_attention_function_refuses_soft_capping_and_sinks_when_called():
    model = akhf.convert(tiny_model("bert"), "softmax")
    module = akhf.converted_modules(model)[0]
    q = torch.randn(1, 4, 3, 8)
    for keyword in ("softcap", "s_aux", "sinks"):
        with pytest.raises(ValueError, match=f"passes {keyword}= to its attention function"):
            attention_forward(module, q, q, q, None, scaling=1.0, **{keyword: torch.ones(4)})
    out, _ = attention_forward(module, q, q, q, None, scaling=1.0, softcap=None, s_aux=None)
    assert out.shape == (1, 3, 4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["t5", "bert", "llama"])
def test_half_precision_models_pass_the_softmax_check(family, dtype):
    """The check compares in float32: a bfloat16 T5 differs from attnkit by its rounding alone (0.016 in
    bfloat16), which must not read as another attention function."""
    model = tiny_model(family).to(dtype)
    akhf.convert(model, "softmax")
    assert model.config._attn_implementation == "attnkit"


def test_a_model_on_the_meta_device_converts_without_the_check():
    """Built with empty weights (to load them later): nothing to compare with yet, and no error."""
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(tiny_config("bert"))
    akhf.convert(model, "hnas")
    assert {m.attnkit_theta.device.type for m in akhf.converted_modules(model)} == {"meta"}


def test_a_model_whose_other_attention_reads_the_mask_itself_is_refused():
    """GIT's text attention computes attention itself from the model's attention_mask, which the conversion
    replaces with attnkit's boolean masks: converting its vision encoder changed the text outputs (by 0.026)
    without a word."""
    from transformers import AutoModel, GitConfig

    config = GitConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8),
    )
    model = AutoModel.from_config(config, attn_implementation="eager")
    with pytest.raises(ValueError, match="GitSelfAttention .* computes attention itself from the model's"):
        akhf.convert(model, "softmax")
    assert akhf.conversion(model) is None


@pytest.mark.parametrize("gate", ["scaled", "sigmoid"])
def test_coda_on_a_model_that_scales_q_before_attention_reads_the_projections(gate):
    """OPT multiplies q by 1/sqrt(d) after its projection and calls attention with scaling=1.0. The scores
    are the same either way, but CoDA's L1 term was taken between that scaled q and an unscaled k; it now
    equals CoDA on the projections with scale 1/sqrt(d), as for a model that scales its scores."""
    import attnkit as ak
    from transformers import OPTConfig, OPTModel

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32)
    model = OPTModel._from_config(config, attn_implementation="eager").eval()
    akhf.convert(model, ak.CoDA(gate=gate))
    attn = model.decoder.layers[0].self_attn
    seen = {}
    attn.q_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    attn.out_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("out", args[0]))
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
        x = seen["x"]
        q, k, v = (p(x).view(2, 7, 4, 8).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        expected = ak.attention(q, k, v, ak.CoDA(gate=gate), causal=True, scale=8**-0.5)  # (B, H, L, d)
    torch.testing.assert_close(seen["out"], expected.transpose(1, 2).reshape(2, 7, 32), atol=1e-6, rtol=1e-5)
    # a scaling set after convert (a temperature) is read at its new value, as before convert: the source's
    # verdict is kept on the module, the factor is not (it was, 1.8e-3 off in the logits)
    attn.scaling = 2 * 8**-0.5
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids)
        expected = ak.attention(q, k, v, ak.CoDA(gate=gate), causal=True, scale=2 * 8**-0.5)
    torch.testing.assert_close(seen["out"], expected.transpose(1, 2).reshape(2, 7, 32), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("module_name, class_name", [
    ("opt", "OPTAttention"),  # q_proj(hidden_states) * self.scaling
    ("kosmos2_5", "Kosmos2_5TextAttention"),  # self.scaling * query_states
    ("openai_privacy_filter", "OpenAIPrivacyFilterAttention"),  # query_states * self.scaling
])
def test_coda_finds_the_query_prescale_however_the_model_writes_it(module_name, class_name):
    """Kosmos-2.5's text decoder writes ``self.scaling * query_states``: the pattern missed it, so CoDA's gate
    took the L1 distance of q / 8 and k (the outputs shrank to 7e-20 at head size 64)."""
    import importlib

    from attnkit.hf.attention_interface import _query_prescale

    cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"),
                  class_name)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.scaling = 0.125
    assert _query_prescale(module, 1.0) == 0.125


def test_coda_is_refused_for_a_model_whose_query_scale_cannot_be_undone():
    """TimesFM multiplies q by a learned per-dimension scale and calls attention with scaling=1.0: CoDA was
    accepted and took its L1 distance between that scaled q and an unscaled k."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("timesfm", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, head_dim=16)
    model = AutoModel.from_config(config)
    with pytest.raises(ValueError, match="TimesFmAttention scales its queries before attention"):
        akhf.convert(model, "coda")
    assert akhf.conversion(model) is None
    akhf.convert(model, "softmax")  # the scores are the model's own: the other mechanisms take them


@pytest.mark.parametrize("family", ["beit", "swin"])
def test_coda_is_refused_for_a_model_that_adds_a_bias_table_through_its_mask(family):
    """BEiT and Swin add their relative position bias to the scores through attention_mask: convert took
    CoDA, and the first forward failed on "an additive float mask" the user never passed (BEiT, built with a
    zero table, ran and dropped the bias until the table moved)."""
    from transformers import AutoConfig, AutoModel

    kwargs = (dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                   image_size=16, patch_size=8, use_relative_position_bias=True) if family == "beit" else
              dict(image_size=16, patch_size=2, embed_dim=8, depths=[2], num_heads=[2], window_size=4))
    model = AutoModel.from_config(AutoConfig.for_model(family, **kwargs))
    with pytest.raises(ValueError, match="adds a position bias to its attention scores .*relative_position"):
        akhf.convert(model, "coda")
    assert akhf.conversion(model) is None


def test_a_float_score_bias_reaching_coda_names_the_module_and_the_fix():
    import attnkit as ak

    module = torch.nn.Module()
    module.is_causal = False
    module.attnkit_mechanism = ak.CoDA()
    q = torch.randn(1, 2, 3, 4)
    bias = torch.randn(1, 2, 3, 3)
    with pytest.raises(ValueError, match="Module passes a float score bias as its attention_mask"):
        attention_forward(module, q, q, q, bias, scaling=0.5)
