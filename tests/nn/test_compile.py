"""torch.compile: a model with attnkit attention compiles, and gives the eager outputs and gradients.

The attention call itself runs eagerly inside the compiled model (one graph break: its route reads the masks,
and its C++ / Triton kernels are opaque to the tracer); the layers around it compile."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit as ak

pytestmark = pytest.mark.filterwarnings("ignore")


def _grads(module):
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def _run(layer, x, pad):
    layer.zero_grad()
    out = layer(x, src_key_padding_mask=pad)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), _grads(layer)


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_a_compiled_encoder_layer_matches_eager_outputs_and_gradients(mechanism):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = ak.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, mechanism=mechanism)
    x = torch.randn(2, 20, 32)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 12:] = True  # padding: the C++ kernels' route on the CPU
    eager, eager_grads = _run(layer, x, pad)
    compiled, compiled_grads = _run(torch.compile(layer, backend="aot_eager"), x, pad)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert len(compiled_grads) == len(eager_grads) > 0
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mechanism", ["dnas", "coda"])
def test_a_compiled_converted_hugging_face_model_matches_eager(mechanism):
    import attnkit.hf as akhf
    from tests.hf._models import tiny_model

    torch._dynamo.reset()
    model = akhf.convert(tiny_model("bert"), mechanism).eval()
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(compiled.last_hidden_state, eager, rtol=1e-5, atol=1e-6)
    # CoDA read its query prescale through an lru_cache at every call: Dynamo warned of "silent incorrectness"
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_inductor_compiles_a_padded_dnas_encoder():
    """The default backend (C++ code generation on the CPU), once."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = ak.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, mechanism="dnas")
    x = torch.randn(2, 20, 32)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 12:] = True
    eager, _ = _run(layer, x, pad)
    compiled, _ = _run(torch.compile(layer), x, pad)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_compiling_ak_attention_itself_gives_its_outputs_and_gradients(mechanism):
    """torch.compile(fn) compiles fn even where it is marked disabled; the kernels inside it stay eager."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 40, 8, generator=g).unbind(0)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    results = []
    for fn in (ak.attention, torch.compile(ak.attention, backend="aot_eager")):
        qg = q.clone().requires_grad_()
        out = fn(qg, k, v, mechanism, key_mask=mask, query_mask=mask)
        out.pow(2).sum().backward()
        results.append((out.detach(), qg.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_compiled_coda_scores_and_weights_match_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 2, 30, 8, generator=g).unbind(0)

    def weights(q, k):
        return ak.normalize(ak.scores.scaled_dot(q, k), "coda", gate_scores=ak.scores.neg_l1_distance(q, k))

    assert torch.equal(torch.compile(weights, backend="aot_eager")(q, k), weights(q, k))


def test_torchscript_is_refused_with_a_sentence_not_a_frozen_trace():
    """torch.jit.trace recorded the traced call's host decisions: a softmax module traced with a 0/-inf
    padding mask read a later additive bias as padding (0.54 off), a dnas trace of self-attention reused for
    cross-attention was 0.96 off; torch.jit.script failed on a type annotation."""
    module = ak.nn.MultiheadAttention(8, 2, mechanism="dnas", batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"MultiheadAttention cannot be traced with torch.jit.trace \(nor "
                                         r"exported by torch.onnx.export\(dynamo=False\), which traces\): .*"
                                         "use torch.compile"):
        torch.jit.trace(lambda a, b: module(a, b, b)[0], (x, x))
    with pytest.raises(ValueError, match="ak.normalize cannot be traced"):
        torch.jit.trace(lambda s: ak.normalize(s, "dnas"), (torch.randn(1, 1, 3, 3),))
    with pytest.raises(ValueError, match="ak.attention cannot be traced"):
        torch.jit.trace(lambda q: ak.attention(q, q, q), (torch.randn(1, 1, 3, 4),))
    for model in (module, torch.nn.Sequential(torch.nn.Linear(4, 4), ak.nn.DotAttention())):
        with pytest.raises(ValueError, match="cannot be compiled with torch.jit.script: .*use torch.compile"):
            torch.jit.script(model)


def test_the_classic_modules_refuse_torchscript_with_the_same_sentence():
    """GMM location, hard and DRAW-read attention failed torch.jit.script with an empty RuntimeError, an
    AttributeError about 'lineno' and an OSError about source, and torch.jit.trace with "length=tensor(6)" or
    "width=tensor(10)" (their host checks fed traced sizes)."""
    from attnkit.nn.draw import DRAWRead
    from attnkit.nn.hard import HardAttention
    from attnkit.nn.location import GMMLocationAttention

    q = torch.randn(2, 8)
    calls = (
        (GMMLocationAttention(8, 2), (q, torch.randn(2, 6, 4), torch.zeros(2, 2))),
        (HardAttention(8, 8), (q, torch.randn(2, 5, 8))),
        (DRAWRead(8, 3, 10, 10), (torch.randn(2, 1, 10, 10), q)),
    )
    for module, inputs in calls:
        name = type(module).__name__
        fix = ": .*use torch.compile"
        with pytest.raises(ValueError, match=f"^{name} cannot be traced with torch.jit.trace .*{fix}"):
            torch.jit.trace(module, inputs)
        with pytest.raises(ValueError, match=f"^{name} cannot be compiled with torch.jit.script{fix}"):
            torch.jit.script(torch.nn.Sequential(module))


def test_torch_export_is_refused_with_a_sentence_not_a_torch_internal_error():
    """torch.export (and torch.onnx.export, which runs it) failed with "Could not guard on data-dependent
    expression" or "Dynamo does not know how to trace method `set` of class `ContextVar` ... Please report an
    issue to PyTorch"."""
    module = ak.nn.MultiheadAttention(8, 2, mechanism="dnas", batch_first=True).eval()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = module

        def forward(self, x):
            return self.attn(x, x, x)[0] + ak.attention(x[:, None], x[:, None], x[:, None], "dnas")[:, 0]

    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"^MultiheadAttention cannot be exported \(torch.export, "
                                         r"torch.onnx.export\): .*run the model in PyTorch"):
        torch.export.export(Model(), (x,), strict=False)
    with pytest.raises(Exception, match="MultiheadAttention cannot be exported"):  # inside dynamo's report
        torch.export.export(Model(), (x,), strict=True)
    with pytest.raises(ValueError, match=r"^ak.attention cannot be exported"):
        bare = type("Bare", (torch.nn.Module,), {"forward": lambda self, q: ak.attention(q, q, q)})
        torch.export.export(bare(), (x[:, None],), strict=False)


def test_dynamic_quantization_leaves_the_output_projection_as_torch_does():
    """quantize_dynamic swapped out_proj for a quantized Linear, whose weight is a method, and the forward
    failed ('function' object has no attribute 'device'); torch's module keeps out_proj unquantized."""
    from torch.ao.quantization import quantize_dynamic

    torch.manual_seed(0)
    module = ak.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    stock = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    stock.load_state_dict(module.state_dict())
    x = torch.randn(2, 5, 8)
    quantized = quantize_dynamic(torch.nn.Sequential(module), {torch.nn.Linear}, dtype=torch.qint8)[0]
    torch.testing.assert_close(quantized(x, x, x)[0], module(x, x, x)[0])
    assert type(quantized.out_proj) is type(stock.out_proj)


@pytest.mark.parametrize("mechanism", ["softmax", "hnas", "coda"])
def test_fullgraph_compile_is_refused_with_attnkits_reason(mechanism):
    """torch.compile(fullgraph=True) stopped on "Dynamo does not know how to trace method `get` of class
    `ContextVar` ... Please report an issue to PyTorch" (softmax) or a disabled function with "reason: None"
    and the hint to remove the disable call (hnas, coda)."""
    torch._dynamo.reset()
    module = ak.nn.MultiheadAttention(16, 4, batch_first=True, mechanism=mechanism)
    x = torch.randn(2, 5, 16)
    with pytest.raises(Exception, match=r"(?s)attnkit's attention runs eagerly under torch\.compile.*"
                                        r"fullgraph=True\) is not supported, compile without fullgraph=True"):
        torch.compile(module, fullgraph=True, backend="aot_eager")(x, x, x, need_weights=False)
    torch._dynamo.reset()


def test_static_quantization_is_refused_with_a_fix_that_works():
    """Eager static quantization failed with "'function' object has no attribute 'device'" (the quantized
    out_proj's weight is a method); with the attention left out of it (qconfig = None) its quantized input
    was told to ".to(torch.float32)" (which raises for a quantized tensor) or the module ".to(torch.quint8)"
    (which nn.Module.to refuses)."""
    from torch.ao.quantization import DeQuantStub, QuantStub, convert, get_default_qconfig, prepare

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.quant, self.inner, self.dequant = QuantStub(), inner, DeQuantStub()

        def forward(self, x):
            return self.dequant(self.inner(self.quant(x)))

    x = torch.randn(2, 5, 8)
    torch.manual_seed(0)
    for leave_out in (False, True):
        layer = ak.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, mechanism="hnas")
        model = Wrapped(layer).eval()
        model.qconfig = get_default_qconfig("x86")
        if leave_out:
            layer.self_attn.qconfig = None
        prepared = prepare(model)
        prepared(x)  # calibration
        with pytest.raises(ValueError, match=r"^query is a quantized tensor \(torch\.quint8\); .*dequantize"):
            convert(prepared)(x)
    module = ak.nn.MultiheadAttention(8, 2, batch_first=True)
    module.out_proj = torch.ao.nn.quantized.Linear(8, 8)
    with pytest.raises(ValueError, match=r"^out_proj is statically quantized; .*qconfig = None"):
        module(x, x, x)
    with pytest.raises(ValueError, match=r"^query has dtype torch\.int64; expected floating embeddings"):
        ak.nn.MultiheadAttention(8, 2, batch_first=True)(x.long(), x, x)
