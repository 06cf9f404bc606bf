"""The alignment regularizer on Hugging Face models beyond BERT: grouped-query attention, fused
query/key/value projections, T5, encoders that compute attention themselves, and generation with the
regularizer attached."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from attnkit.align import AlignmentRegularizer  # noqa: E402

H, KV = 4, 2
SMALL = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
             max_position_embeddings=64, head_dim=8)
# model type -> config overrides (on top of SMALL where the config has those fields), expected key heads
FAMILIES = {
    "llama": (dict(num_key_value_heads=KV), KV),  # grouped-query, rotary
    "qwen2": (dict(num_key_value_heads=KV), KV),
    "mistral": (dict(num_key_value_heads=1), 1),  # multi-query
    "t5": (dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=H, decoder_start_token_id=0), H),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=H, n_positions=64), H),  # fused c_attn (Conv1D)
    "gpt_bigcode": (dict(n_embd=32, n_layer=2, n_head=H, n_positions=64, multi_query=True), 1),
    "gpt_bigcode-mha": (dict(n_embd=32, n_layer=2, n_head=H, n_positions=64, multi_query=False), H),
    "gpt_neox": (dict(), H),  # fused query_key_value, per head [q | k | v]
    "phi3": (dict(num_key_value_heads=KV, pad_token_id=0), KV),  # fused qkv_proj, grouped-query
    "modernbert": (dict(pad_token_id=0, global_attn_every_n_layers=1, local_attention=16), H),  # fused Wqkv
    "persimmon": (dict(qk_layernorm=False), H),  # fused query_key_value, per head [q | k | v]
    "ctrl": (dict(n_embd=32, n_layer=2, n_head=H, dff=64, n_positions=64), H),  # Wq / Wk
}


def _config(family: str):
    from transformers import CONFIG_MAPPING

    model_type = family if family in CONFIG_MAPPING else family.rsplit("-", 1)[0]
    overrides, _ = FAMILIES.get(family, (dict(), H))
    config = CONFIG_MAPPING[model_type]()
    for key, value in {**SMALL, **overrides}.items():
        if hasattr(config, key) or key in overrides:
            setattr(config, key, value)
    return config


def _model(family: str, cls=None):
    torch.manual_seed(0)
    cls = cls or transformers.AutoModel
    return cls.from_config(_config(family), attn_implementation="eager").eval()


def _batch(model):
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if model.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = ids[:, :4]
    return kwargs, mask


def _outputs(model, kwargs):
    with torch.no_grad():
        return model(**kwargs).last_hidden_state


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_captured_queries_and_keys_are_what_the_attention_function_receives(family, monkeypatch):
    """With rotary embeddings off, the attention function sees exactly the captured queries, and the captured
    keys of head h are its key head h // (H / Hkv) (as transformers' repeat_kv pairs them)."""
    model = _model(family)
    source = importlib.import_module(type(model).__module__)
    seen = []
    eager = source.eager_attention_forward

    def recording(module, query, key, *args, **kwargs):
        seen.append((query.detach().clone(), key.detach().clone()))
        return eager(module, query, key, *args, **kwargs)

    monkeypatch.setattr(source, "eager_attention_forward", recording)
    if hasattr(source, "apply_rotary_pos_emb"):
        monkeypatch.setattr(source, "apply_rotary_pos_emb", lambda q, k, *a, **kw: (q, k))
    kwargs, mask = _batch(model)
    before = _outputs(model, kwargs)
    reg = AlignmentRegularizer(model, method="mmd")
    after = _outputs(model, kwargs)
    assert torch.equal(before, after)
    sites, kv_heads = reg.sites, FAMILIES[family][1]
    assert len(sites) == 2 and all(s.num_heads == H and s.kv_heads == kv_heads for s in sites)
    captured = [c for _, c in reg._captured]
    assert len(captured) == 2
    second = seen[len(seen) // 2 :]  # the pass with the regularizer attached
    encoder_calls = second[:2]  # an encoder-decoder runs its encoder first
    for c, (query, key) in zip(captured, encoder_calls):
        assert c.q.shape == query.shape == (2, H, 9, sites[0].head_dim)
        assert key.shape[1] == kv_heads
        torch.testing.assert_close(c.q, query, rtol=0, atol=0)
        torch.testing.assert_close(c.k, key.repeat_interleave(H // kv_heads, dim=1), rtol=0, atol=0)
        assert torch.equal(c.q_mask, mask > 0) and torch.equal(c.k_mask, mask > 0)
    assert torch.isfinite(torch.tensor(reg.mmd()))


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "phi3", "t5"])
def test_alignment_gradients_reach_the_query_and_key_projections(family):
    model = _model(family).train()
    kwargs, _ = _batch(model)
    reg = AlignmentRegularizer(model, method="ct")
    model(**kwargs)
    reg.loss().backward()
    site = reg.sites[0]
    for layer in (site.proj.q_layer, site.proj.k_layer):  # one layer twice where q, k and v are fused
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["megatron-bert", "roformer", "mpnet", "layoutlm"])
def test_encoders_that_compute_attention_themselves_are_captured(family):
    """Encoders whose modules do not call an attention function are found by their query/key projections;
    the captures are those projections, split into heads, with the padding of the attention_mask."""
    model = _model(family)
    kwargs, mask = _batch(model)
    if family == "layoutlm":
        kwargs["bbox"] = torch.zeros(2, 9, 4, dtype=torch.long)
    before = _outputs(model, kwargs)
    reg = AlignmentRegularizer(model, method="gan")
    assert torch.equal(_outputs(model, kwargs), before)
    assert len(reg.sites) == 2 and len(reg._captured) == 2
    site, c = reg.sites[0], reg._captured[0][1]
    hidden = {}
    handle = site.module.register_forward_pre_hook(lambda m, args: hidden.setdefault("x", args[0]))
    _outputs(model, kwargs)
    handle.remove()
    d = site.head_dim
    q = site.proj.q_layer(hidden["x"]).view(2, 9, H, d).transpose(1, 2)
    k = site.proj.k_layer(hidden["x"]).view(2, 9, H, d).transpose(1, 2)
    c = reg._captured[0][1]
    assert torch.equal(c.q, q) and torch.equal(c.k, k) and torch.equal(c.k_mask, mask > 0)
    model.train()
    model(**kwargs)
    reg.loss().backward()
    assert site.proj.q_layer.weight.grad.abs().sum() > 0


def test_decoder_cross_attention_is_not_captured():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(**{k: v for k, v in SMALL.items()}, is_decoder=True, add_cross_attention=True)
    model = BertModel(config).eval()
    kwargs, _ = _batch(model)
    kwargs["encoder_hidden_states"] = torch.randn(2, 5, 32)
    reg = AlignmentRegularizer(model, method="mmd")
    model(**kwargs)
    assert [s.name for s in reg.sites] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    assert len(reg._captured) == 2 and all(c.k.shape[2] == 9 for _, c in reg._captured)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_generate_with_the_regularizer_attached_gives_the_same_tokens(family):
    """Cached decoding steps (one query, the earlier keys in the cache) are not captured; they used to raise
    on the attention_mask's length."""
    model = _model(family, transformers.AutoModelForCausalLM)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    expected = model.generate(**gen)
    reg = AlignmentRegularizer(model, method="mmd")
    assert torch.equal(model.generate(**gen), expected)
    with pytest.raises(ValueError, match="last forward pass of the .* was a step of cached decoding"):
        reg.loss()  # it said to run a forward pass, though generate had just run several
    model(input_ids=ids, attention_mask=mask)
    assert len(reg._captured) == 2 and reg.mmd() > 0


def test_keys_that_are_not_whole_heads_are_named():
    model = _model("llama")
    attn = model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(32, 12, bias=False)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn.*keys \(width 12\).*heads of dim 8"):
        AlignmentRegularizer(model, method="mmd")


class _LoraLike(torch.nn.Module):
    """A low-rank adapter around a linear layer, as PEFT's ``lora.Linear`` (not an ``nn.Linear`` itself)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_B.weight, std=0.1)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_projections_wrapped_by_low_rank_adapters_are_captured_and_trained():
    """LoRA fine-tuning wraps q_proj/k_proj in modules that are not nn.Linear; they were refused."""
    model = _model("llama").train()
    for layer in model.layers:
        layer.self_attn.q_proj = _LoraLike(layer.self_attn.q_proj)
        layer.self_attn.k_proj = _LoraLike(layer.self_attn.k_proj)
    kwargs, _ = _batch(model)
    reg = AlignmentRegularizer(model, method="ct")
    hidden = {}
    attn = model.layers[0].self_attn
    attn.q_proj.register_forward_pre_hook(lambda m, args: hidden.setdefault("x", args[0]))
    model(**kwargs)
    q = attn.q_proj(hidden["x"]).view(2, 9, H, 8).transpose(1, 2)
    torch.testing.assert_close(reg._captured[0][1].q, q, rtol=0, atol=0)
    assert reg.sites[0].kv_heads == KV
    reg.loss().backward()
    assert attn.q_proj.lora_A.weight.grad.abs().sum() > 0 and attn.k_proj.lora_B.weight.grad.abs().sum() > 0


class _AdapterWrapper(torch.nn.Module):
    """The shape of PEFT's PeftModel: the Hugging Face model inside, get_base_model(), forward passing on."""

    def __init__(self, model) -> None:
        super().__init__()
        self.base_model = model

    def get_base_model(self):
        return self.base_model

    def forward(self, **kwargs):
        return self.base_model(**kwargs)


def test_a_peft_style_wrapper_is_looked_through():
    model = _model("llama")
    wrapped = _AdapterWrapper(model)
    kwargs, mask = _batch(model)
    reg = AlignmentRegularizer(wrapped, method="mmd")
    wrapped(**kwargs)
    assert len(reg.sites) == 2 and len(reg._captured) == 2
    assert torch.equal(reg._captured[0][1].q_mask, mask > 0)


def test_a_model_with_layers_on_other_positions_keeps_the_layers_it_can_read():
    """CANINE's deep encoder runs on downsampled positions (9 characters -> 2), which the attention_mask does
    not describe: those layers are left out with a warning, the character-level layer is captured."""
    model = _model("canine")
    kwargs, mask = _batch(model)
    reg = AlignmentRegularizer(model, method="gan")
    with pytest.warns(UserWarning, match="runs over .* positions but the model's attention_mask"):
        model(**kwargs)
    assert [c.q.shape[2] for _, c in reg._captured] == [9]
    assert torch.isfinite(reg.loss())


def test_quantized_projections_that_return_tuples_are_captured():
    """I-BERT's QuantLinear returns (output, scaling factor); the hook raised on the tuple."""
    model = _model("ibert")
    kwargs, _ = _batch(model)
    before = _outputs(model, kwargs)
    reg = AlignmentRegularizer(model, method="mmd")
    assert torch.equal(_outputs(model, kwargs), before)
    assert len(reg._captured) == 2 and reg._captured[0][1].q.shape == (2, H, 9, 8)
    assert reg.mmd() > 0


# Models whose attention computes its scores itself from a fused q/k/v projection: model type -> (config, key
# heads, how the scores are computed: "baddbmm" (BLOOM), "sdpa" (Falcon), "matmul" (MPT, OpenAI GPT))
SELF_COMPUTING = {
    "bloom": (dict(vocab_size=120, hidden_size=32, n_layer=2, n_head=H), H, "baddbmm"),
    "falcon": (dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                    multi_query=False, new_decoder_architecture=False), H, "sdpa"),
    "falcon-multi_query": (dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                                multi_query=True, new_decoder_architecture=False), 1, "sdpa"),
    "falcon-new_decoder": (dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                                num_kv_heads=KV, new_decoder_architecture=True), KV, "sdpa"),
    "mpt": (dict(vocab_size=120, d_model=32, n_layers=2, n_heads=H, attn_config=dict(clip_qkv=0.05)), H,
            "matmul"),
    "openai-gpt": (dict(vocab_size=120, n_embd=32, n_layer=2, n_head=H, n_positions=64), H, "matmul"),
    "imagegpt": (dict(vocab_size=120, n_embd=32, n_layer=2, n_head=H, n_positions=64), H, "matmul"),
    "gpt_neox_japanese": (dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                               intermediate_multiple_size=2), H, "baddbmm"),
    "deberta": (dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                     intermediate_size=64), H, "matmul"),  # q_bias added after the split
}


def _recording_scores(how: str, monkeypatch, seen: list) -> None:
    """Record the (queries (B, H, L, d), keys (B, Hk, L, d)) from which each layer computes its scores."""
    if how == "baddbmm":  # BLOOM: alibi.baddbmm(q (B H, L, d), k^T (B H, d, L)); NeoX-Japanese: torch.baddbmm
        method, function = torch.Tensor.baddbmm, torch.baddbmm

        def record(batch1, batch2):
            seen.append((batch1.view(2, H, *batch1.shape[1:]), batch2.transpose(1, 2).view(2, H, -1, 8)))

        def recording_method(self, batch1, batch2, **kwargs):
            record(batch1, batch2)
            return method(self, batch1, batch2, **kwargs)

        def recording_function(input, batch1, batch2, **kwargs):
            record(batch1, batch2)
            return function(input, batch1, batch2, **kwargs)

        monkeypatch.setattr(torch.Tensor, "baddbmm", recording_method)
        monkeypatch.setattr(torch, "baddbmm", recording_function)
    elif how == "sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def recording(query, key, *args, **kwargs):
            seen.append((query, key))
            return sdpa(query, key, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    else:  # q @ k^T with k^T (B, H, d, L); the weights @ v product has L = 9 columns in its first factor
        matmul = torch.matmul

        def recording(a, b, *args, **kwargs):
            if a.dim() == 4 and a.shape[-1] == 8 and b.shape[-2] == 8:
                seen.append((a, b.transpose(-1, -2)))
            return matmul(a, b, *args, **kwargs)

        monkeypatch.setattr(torch, "matmul", recording)


@pytest.mark.parametrize("family", sorted(SELF_COMPUTING))
def test_fused_projections_of_models_that_compute_their_scores_are_split_as_the_model_splits_them(
    family, monkeypatch
):
    """BLOOM, Falcon (its three layouts), MPT, OpenAI GPT, ImageGPT, GPT-NeoX-Japanese and DeBERTa were
    refused ("no self-attention layer"). With rotary embeddings and DeBERTa's scaling of q off, the captures
    equal the queries and keys the model multiplies, and the loss trains the fused projection."""
    from transformers import CONFIG_MAPPING

    overrides, kv_heads, how = SELF_COMPUTING[family]
    torch.manual_seed(0)
    config = CONFIG_MAPPING[family.split("-")[0] if family.startswith("falcon") else family](**overrides)
    implementation = "sdpa" if how == "sdpa" else "eager"
    model = transformers.AutoModel.from_config(config, attn_implementation=implementation).eval()
    source = importlib.import_module(type(model).__module__)
    if hasattr(source, "apply_rotary_pos_emb"):
        monkeypatch.setattr(source, "apply_rotary_pos_emb", lambda q, k, *a, **kw: (q, k))
    if family == "deberta":
        monkeypatch.setattr(source, "scaled_size_sqrt", lambda q, factor: torch.tensor(1.0))
        for layer in model.encoder.layer:
            torch.nn.init.normal_(layer.attention.self.q_bias)  # zeros at initialisation
    kwargs, mask = _batch(model)
    before = _outputs(model, kwargs)
    reg = AlignmentRegularizer(model, method="mmd")
    assert [(s.num_heads, s.kv_heads, s.head_dim) for s in reg.sites] == [(H, kv_heads, 8)] * 2
    seen: list = []
    _recording_scores(how, monkeypatch, seen)
    assert torch.equal(_outputs(model, kwargs), before)
    assert len(seen) == 2 and len(reg._captured) == 2
    for (_, c), (query, key) in zip(reg._captured, seen):
        assert c.q.shape == query.shape == (2, H, 9, 8)
        torch.testing.assert_close(c.q, query, rtol=0, atol=0)
        group = H // key.shape[1]  # Falcon's new layout hands SDPA keys already broadcast to every head
        torch.testing.assert_close(c.k, key.repeat_interleave(group, dim=1), rtol=0, atol=0)
        assert torch.equal(c.q_mask, mask > 0) and torch.equal(c.k_mask, mask > 0)
    if family == "mpt":  # captured after the clamp to clip_qkv, as the scores use them
        assert reg._captured[0][1].q.abs().max() <= 0.05
    model.train()
    monkeypatch.undo()
    model(**kwargs)
    reg.loss().backward()
    fused = reg.sites[0].proj.q_layer
    assert fused.weight.grad is not None and fused.weight.grad.abs().sum() > 0


def _clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=32)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  image_size=32, patch_size=8)  # 16 patches + the class token: 17 positions
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision)).eval()


def test_a_vision_tower_never_reads_the_text_mask_even_when_the_lengths_match():
    """CLIP with 17 text tokens and 17 image positions: the text attention_mask was applied to the vision
    layer (the shape check passed), instead of leaving it out with a warning as for other lengths."""
    model = _clip()
    reg = AlignmentRegularizer(model, method="mmd")
    assert [s.name for s in reg.sites] == ["text_model.encoder.layers.0.self_attn",
                                           "vision_model.encoder.layers.0.self_attn"]
    ids = torch.randint(3, 60, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, 8:] = 0
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"vision_model\.encoder\.layers\.0\.self_attn.*outside 'text_model"):
        model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    assert [reg.sites[i].name for i, _ in reg._captured] == ["text_model.encoder.layers.0.self_attn"]
    assert torch.equal(reg._captured[0][1].q_mask, mask > 0)
    strict = AlignmentRegularizer(model, method="mmd", layers=[1])  # the vision layer chosen by name
    with pytest.raises(ValueError, match="outside 'text_model'"):
        model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    strict.remove()
    model(input_ids=ids, pixel_values=pixels)  # without a mask the vision layer is read, every position real
    assert sorted(i for i, _ in reg._captured) == [0, 1]


def test_a_projection_replaced_after_attaching_is_refused_instead_of_read_stale():
    """peft.get_peft_model replaces query/key by LoRA layers around them: the hooks stayed on the inner layer,
    whose outputs are no longer the queries (and the adapter got no alignment gradient)."""
    model = _model("llama")
    kwargs, _ = _batch(model)
    reg = AlignmentRegularizer(model, method="mmd")
    model(**kwargs)
    assert len(reg._captured) == 2
    attn = model.layers[0].self_attn
    attn.q_proj = _LoraLike(attn.q_proj)
    with pytest.raises(ValueError, match=r"query projection Linear of 'layers\.0\.self_attn' is no longer a "
                                         r"child.*after wrapping the model"):
        model(**kwargs)
    again = AlignmentRegularizer(model, method="mmd")  # attached after wrapping: the wrapper is read
    reg.remove()
    seen = {}
    attn.q_proj.register_forward_hook(lambda m, args, out: seen.setdefault("q", out))
    model(**kwargs)
    torch.testing.assert_close(again._captured[0][1].q, seen["q"].view(2, 9, H, 8).transpose(1, 2))


def test_xlm_padding_given_as_lengths_keeps_padded_tokens_out():
    """XLM and FlauBERT take their padding as lengths= (real tokens per sample); the capture ignored it and
    matched the padded tokens as real ones."""
    from transformers import XLMConfig, XLMModel

    torch.manual_seed(0)
    model = XLMModel(XLMConfig(vocab_size=50, emb_dim=16, n_layers=1, n_heads=2)).eval()
    reg = AlignmentRegularizer(model, method="mmd")
    ids = torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 3])
    model(ids, lengths=lengths)
    by_lengths = reg.mmd_per_head()[0]
    assert reg._captured[0][1].q_mask.sum(1).tolist() == [6, 3]
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    model(ids, attention_mask=mask)  # the same padding as a mask
    torch.testing.assert_close(by_lengths, reg.mmd_per_head()[0], rtol=0, atol=0)
