"""DeBERTa (v1), DeBERTa-v2/v3 and MPNet, whose attention modules compute attention themselves (they do not
dispatch through transformers' AttentionInterface): converted by attnkit's own forward, their position terms
a score bias (all were refused)."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import attnkit.hf as akhf  # noqa: E402
from tests._reference import ref_dnas, ref_hybrid, ref_sinkhorn, ref_softmax  # noqa: E402

H = 4
POSITIONS = dict(
    relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16, position_buckets=8
)


def _deberta(cls=None, relative: bool = True, **kwargs):
    from transformers import DebertaV2Config, DebertaV2Model

    torch.manual_seed(0)
    config = DebertaV2Config(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
        **(POSITIONS if relative else {}), **kwargs,
    )
    return (cls or DebertaV2Model)(config).double().eval()


def _mpnet(cls=None, **kwargs):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    config = MPNetConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
        **kwargs,
    )
    return (cls or MPNetModel)(config).double().eval()


def _deberta_v1(cls=None, relative: bool = True, **kwargs):
    from transformers import DebertaConfig, DebertaModel

    torch.manual_seed(0)
    config = DebertaConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
        relative_attention=relative, pos_att_type=["p2c", "c2p"], max_relative_positions=16, **kwargs,
    )
    model = (cls or DebertaModel)(config).double().eval()
    for module in model.modules():  # zeros at initialisation
        if type(module).__name__ == "DisentangledSelfAttention":
            torch.nn.init.normal_(module.q_bias)
            torch.nn.init.normal_(module.v_bias)
    return model


def _bert_style(model_type: str, **fixed):
    def make(cls=None, **kwargs):
        from transformers import CONFIG_MAPPING, AutoModel

        torch.manual_seed(0)
        config = CONFIG_MAPPING[model_type](
            vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
            **fixed, **kwargs,
        )
        model = cls(config) if cls else AutoModel.from_config(config)
        return model.double().eval()

    return make


MODELS = {
    "deberta": _deberta_v1,
    "deberta-v2": _deberta,
    "mpnet": _mpnet,
    "roformer": _bert_style("roformer"),
    "roformer-rotary_value": _bert_style("roformer", rotary_value=True),
    "megatron-bert": _bert_style("megatron-bert"),
    "rembert": _bert_style("rembert", input_embedding_size=32, output_embedding_size=32, bos_token_id=1,
                           eos_token_id=2),
}
CLASSIFIERS = {
    "deberta": "DebertaForSequenceClassification",
    "deberta-v2": "DebertaV2ForSequenceClassification",
    "mpnet": "MPNetForSequenceClassification",
    "roformer": "RoFormerForSequenceClassification",
    "roformer-rotary_value": "RoFormerForSequenceClassification",
    "megatron-bert": "MegatronBertForSequenceClassification",
    "rembert": "RemBertForSequenceClassification",
}


def _batch():
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


REFERENCES = {
    "softmax": ref_softmax,
    "dnas": ref_dnas,
    "hnas": lambda s, valid: ref_hybrid(s, valid, 0.5),
    "sinkhorn": lambda s, valid: ref_sinkhorn(s, valid, 3),
}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mechanism", sorted(REFERENCES))
def test_converted_model_equals_its_own_scores_normalized_by_the_mechanism(family, mechanism, monkeypatch):
    """The reference is the stock model with its softmax swapped for the float64 reference of the mechanism
    (scores the model's mask pushes to finfo.min are masked: DeBERTa's mask is valid(query) x valid(key),
    MPNet's the key padding)."""
    ids, mask = _batch()
    converted = akhf.convert(MODELS[family](), mechanism)
    got = converted(input_ids=ids, attention_mask=mask).last_hidden_state
    softmax = torch.nn.functional.softmax

    def reference(scores, dim=-1, **kwargs):
        valid = scores > torch.finfo(scores.dtype).min / 2
        if not family.startswith("deberta"):  # a padded query sees every real key; its row stays out
            valid = valid & valid.any(dim=-2, keepdim=True).transpose(-1, -2)
        return REFERENCES[mechanism](scores.double(), valid).to(scores.dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", reference)
    expected = MODELS[family]()(input_ids=ids, attention_mask=mask).last_hidden_state
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-10, atol=1e-10)
    if mechanism != "softmax":
        stock = MODELS[family]()(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got[real] - stock[real]).abs().max() > 1e-6


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mechanism", ["dnas", "sinkhorn"])
def test_converted_model_padding_equals_the_sequence_alone(family, mechanism):
    ids, mask = _batch()
    model = akhf.convert(MODELS[family](), mechanism)
    batch = model(input_ids=ids, attention_mask=mask).last_hidden_state
    alone = model(input_ids=ids[1:, :6]).last_hidden_state
    torch.testing.assert_close(batch[1, :6], alone[0], rtol=1e-12, atol=1e-12)


def test_coda_is_refused_with_position_terms_and_runs_without_them():
    for make in (_deberta_v1, _deberta, _mpnet):
        with pytest.raises(ValueError, match="adds a position bias.*CoDA cannot take"):
            akhf.convert(make(), "coda")
    ids, mask = _batch()
    model = akhf.convert(_deberta(relative=False), "coda")
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_hnas_trains_theta_and_round_trips_through_save_and_load(family, tmp_path):
    ids, mask = _batch()
    cls = getattr(transformers, CLASSIFIERS[family])
    model = akhf.convert(MODELS[family](cls, num_labels=3).float(), "hnas", u0=0.2)
    with torch.no_grad():
        for module in akhf.converted_modules(model):
            module.attnkit_theta.add_(torch.randn(H))
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss.backward()
    assert all(m.attnkit_theta.grad.abs().sum() > 0 for m in akhf.converted_modules(model))
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = akhf.load(tmp_path).eval()
    assert type(loaded) is cls
    assert torch.equal(akhf.hybrid_weights(loaded), akhf.hybrid_weights(model))
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits for m in (loaded, model)]
    torch.testing.assert_close(*logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_output_attentions_are_the_mechanisms_weights(family):
    ids, mask = _batch()
    model = akhf.convert(MODELS[family](), "dnas")
    attentions = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(attentions) == 2 and attentions[0].shape == (2, H, 9, 9)
    w = attentions[0][1]  # the padded sequence: 6 real tokens
    assert not w[:, :, 6:].any() and not w[:, 6:].any()
    # Lemma 1 of "Attention that does not Explain Away": every real key receives at least 1/n_k in total
    assert (w[:, :6, :6].sum(dim=-2) >= 1 / 6 - 1e-12).all()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_converted_model_deep_copies_and_pickles(family):
    ids, mask = _batch()
    model = akhf.convert(MODELS[family](), "dnas")
    expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
    twin = copy.deepcopy(model)
    attn = akhf.converted_modules(twin)[0]
    assert attn.forward.args[0] is attn  # the copy's forward is its own
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (twin, torch.load(buffer, weights_only=False)):
        assert torch.equal(other(input_ids=ids, attention_mask=mask).last_hidden_state, expected)


def test_deberta_talking_head_attention_is_refused_by_name():
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self.*talking-head attention"):
        akhf.convert(_deberta_v1(talking_head=True), "dnas")


def test_a_model_that_computes_attention_itself_and_is_unknown_is_refused_by_name():
    from transformers import ConvBertConfig, ConvBertModel

    config = ConvBertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64
    )
    with pytest.raises(ValueError, match="ConvBertModel does not dispatch attention.*DeBERTa-v2/v3, MPNet"):
        akhf.convert(ConvBertModel(config), "dnas")


def test_coda_of_deberta_v1_without_position_terms_is_coda_of_its_projections():
    """Its queries were divided by sqrt(d) before CoDA, so the L1 term was between q / sqrt(d) and k."""
    import attnkit as ak

    ids, mask = _batch()
    model = akhf.convert(_deberta_v1(relative=False), "coda")
    attn = akhf.converted_modules(model)[0]
    seen = {}
    attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0]), with_kwargs=True)
    attn.register_forward_hook(lambda m, args, out: seen.update(out=out[0]))
    model(input_ids=ids, attention_mask=mask)
    qkv = attn.transpose_for_scores(attn.in_proj(seen["x"])).chunk(3, dim=-1)  # (B, H, L, d) each
    q = qkv[0] + attn.transpose_for_scores(attn.q_bias[None, None, :])
    k, v = qkv[1], qkv[2] + attn.transpose_for_scores(attn.v_bias[None, None, :])
    scale = 1 / float(torch.sqrt(torch.tensor(8.0 * 3)))  # the model's sqrt(d (1 + 2 terms)), float32
    expected = ak.attention(q, k, v, "coda", key_mask=mask.bool(), scale=scale)
    real = mask.bool()
    torch.testing.assert_close(seen["out"][real], expected.transpose(1, 2).reshape(2, 9, -1)[real])


@pytest.mark.parametrize("family", ["roformer", "roformer-rotary_value", "megatron-bert"])
def test_coda_of_a_bert_style_encoder_is_coda_of_its_queries_and_keys(family, monkeypatch):
    """With no position bias, CoDA runs on the module's projections (after RoFormer's rotary embedding)."""
    import attnkit as ak

    ids, mask = _batch()
    model = akhf.convert(MODELS[family](), "coda")
    attn = akhf.converted_modules(model)[0]
    seen = {}
    rotary = getattr(attn, "apply_rotary_position_embeddings", None)
    if rotary is not None:
        def recording(*args):
            seen["rotated"] = rotary(*args)
            return seen["rotated"]

        monkeypatch.setattr(attn, "apply_rotary_position_embeddings", recording)
    attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0]), with_kwargs=True)
    attn.register_forward_hook(lambda m, args, out: seen.update(out=out[0]))
    model(input_ids=ids, attention_mask=mask)
    x = seen["x"]
    heads = lambda t: t.view(2, 9, H, 8).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.query(x)), heads(attn.key(x)), heads(attn.value(x))
    if "rotated" in seen:
        q, k = seen["rotated"][:2]
        v = seen["rotated"][2] if len(seen["rotated"]) == 3 else v
    expected = ak.attention(q, k, v, "coda", key_mask=mask.bool(), scale=8**-0.5)  # (B, H, L, d)
    real = mask.bool()
    torch.testing.assert_close(seen["out"][real], expected.transpose(1, 2).reshape(2, 9, -1)[real])


def test_a_decoder_bert_style_model_is_refused_by_name():
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self.*is_decoder=True"):
        akhf.convert(MODELS["roformer"](is_decoder=True), "coda")


def _gpt_neo(seed: int = 0):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoConfig(
        vocab_size=120, hidden_size=32, num_layers=2, num_heads=H, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64,
    )
    return GPTNeoForCausalLM(config).eval()


def test_gpt_neo_softmax_is_the_models_and_query_normalized_mechanisms_are_refused():
    """GPT-Neo computes attention itself, unscaled, with a window of 4 keys in its local layer; it was
    refused ("does not dispatch attention")."""
    ids, mask = _batch()
    mask = mask.flip(1)  # left padding, as for generation
    model = _gpt_neo()
    expected = model(input_ids=ids, attention_mask=mask).logits
    converted = akhf.convert(_gpt_neo(), "softmax")
    got = converted(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot convert causal self-attention.*'dnas'"):
        akhf.convert(_gpt_neo(), "dnas")


def test_gpt_neo_coda_is_coda_of_its_projections_under_its_causal_window(tmp_path):
    import attnkit as ak

    ids, mask = _batch()
    mask = mask.flip(1)
    model = akhf.convert(_gpt_neo(), "coda")
    attn = akhf.converted_modules(model)[1]  # the local layer
    seen = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attn, name).register_forward_hook(lambda m, a, out, name=name: seen.update({name: out}))
    attn.out_proj.register_forward_pre_hook(lambda m, args: seen.update(merged=args[0]))
    model(input_ids=ids, attention_mask=mask)
    heads = lambda t: t.view(2, 9, H, 8).transpose(1, 2)  # noqa: E731
    i = torch.arange(9)
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)  # (Lq, Lk) causal, last 4 keys
    allowed = window[None, None] & mask.bool()[:, None, None, :]  # (B, 1, Lq, Lk)
    q, k, v = (heads(seen[name]) for name in ("q_proj", "k_proj", "v_proj"))
    expected = ak.attention(q, k, v, "coda", attn_mask=allowed, scale=1.0).transpose(1, 2).reshape(2, 9, -1)
    real = mask.bool()
    torch.testing.assert_close(seen["merged"][real], expected[real])
    model.generation_config.pad_token_id = 0
    run = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    tokens = model.generate(**run)
    assert torch.equal(tokens, model.generate(**run, use_cache=False))  # the cache path is the same attention
    model.save_pretrained(tmp_path)
    loaded = akhf.load(tmp_path).eval()
    assert akhf.conversion(loaded).name == "coda"
    assert torch.equal(loaded.generate(**run), tokens)


_PLAIN_LOAD = """
import sys
from transformers import AutoModel
try:
    AutoModel.from_pretrained(sys.argv[1])
except ValueError as error:
    print("refused:", error)
else:
    print("loaded")
"""


def test_a_saved_conversion_is_not_silently_loaded_as_the_stock_model(tmp_path):
    """Their conversion was kept in config.json's ``attnkit`` record alone: a plain ``from_pretrained`` in a
    process that had not registered attnkit built the stock model without a word (GPT-Neo converted to CoDA
    gave other logits). The config now names the attnkit implementation, as a converted BERT's does."""
    import subprocess
    import sys

    for name, model in (("deberta-v2", MODELS["deberta-v2"]()), ("gpt-neo", _gpt_neo())):
        akhf.convert(model, "coda" if name == "gpt-neo" else "dnas").save_pretrained(tmp_path / name)
        run = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(tmp_path / name)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert 'refused: Specified `attn_implementation="attnkit"`' in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("family", ["roformer", "deberta-v2"])
def test_a_partial_conversion_round_trips_bit_identically(family, tmp_path):
    """The layers left alone keep the model's own masks and attention after a reload (the restored model
    runs "eager", as the converted one did)."""
    ids, mask = _batch()
    # float32: in float64 the stock model itself reloads 4e-16 off
    model = akhf.convert(MODELS[family]().float(), "hnas", layers=[1])
    model.save_pretrained(tmp_path)
    for loaded in (akhf.load(tmp_path), transformers.AutoModel.from_pretrained(tmp_path)):
        assert loaded.config._attn_implementation == "eager"
        assert len(akhf.converted_modules(loaded)) == 1
        with torch.no_grad():
            out = [m.eval()(input_ids=ids, attention_mask=mask).last_hidden_state for m in (loaded, model)]
        assert out[0].dtype == out[1].dtype and torch.equal(*out), (out[0] - out[1]).abs().max()
