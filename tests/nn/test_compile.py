"""torch.compile: a model with attnkit attention compiles, and gives the eager outputs and gradients.

The attention call itself runs eagerly inside the compiled model (one graph break: its route reads the masks,
and its C++ / Triton kernels are opaque to the tracer); the layers around it compile."""

from __future__ import annotations

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
    compiled = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


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
