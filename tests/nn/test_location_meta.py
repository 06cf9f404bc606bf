"""GMMLocationAttention builds on the meta device (its initial bias is computed with Python math)."""

import pytest
import torch

from attnkit.nn.location import GMMLocationAttention


def test_builds_on_meta_device():
    with torch.device("meta"):
        m = GMMLocationAttention(8, 2)
    assert m.proj.weight.is_meta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_window_keeps_its_positions_exact_past_256(dtype):
    """kappa accumulated in bfloat16 stuck at 256 (steps of 1: bfloat16 has no 257); it is kept in float32
    for a half-precision module, and the window's positions 1..U too."""
    torch.manual_seed(0)
    module = GMMLocationAttention(8, 1).to(dtype)
    with torch.no_grad():
        module.proj.weight.zero_()
        module.proj.bias.copy_(torch.tensor([0.0, 0.0, 0.0]))  # alpha = beta = 1, steps of f(0)
    step = float(module._f(torch.tensor(0.0)))
    kappa = module.initial_kappa(1)
    values = torch.randn(1, 600, 4, dtype=dtype)
    for _ in range(500):
        window, phi, kappa = module(torch.zeros(1, 8, dtype=dtype), values, kappa)
    assert kappa.dtype == torch.float32 and window.dtype == dtype and phi.dtype == dtype
    torch.testing.assert_close(kappa, torch.full_like(kappa, 500 * step), rtol=1e-3, atol=0)
    assert abs(int(phi.float().argmax()) + 1 - 500 * step) <= 1  # the window's peak where kappa is


def test_a_half_precision_draw_filterbank_reads_every_pixel_past_256():
    """The pixel grid in bfloat16 has no odd integers past 256: at width 300 only 98 of 300 filters sat on
    their own pixel. A centred unit-stride grid of tiny variance reads pixel i with filter i."""
    from attnkit.nn.draw import filterbank, window_from_params

    W = 301  # centre (W + 1) / 2 = 151 is a bfloat16 number, so the window itself is exact
    params = torch.tensor([[0.0, 0.0, -30.0, 0.0, 0.0]], dtype=torch.bfloat16)
    fx, fy = filterbank(window_from_params(params, W, W, W), W, W, W)
    assert fx.dtype == torch.bfloat16
    assert torch.equal(fx[0].float().argmax(-1), torch.arange(W))


@pytest.mark.parametrize("length, shapes, needle", [
    (2.5, ((2, 3),) * 3, "length=2.5"), (True, ((2, 3),) * 3, "length=True"),
    (-3, ((2, 3),) * 3, "length=-3"),
    (4, ((2, 1), (2, 3), (2, 3)), "must have one shape"), (4, ((3,), (3,), (3,)), "expected a floating"),
])
def test_gmm_window_weights_refuses_what_gives_no_window(length, shapes, needle):
    """length=2.5 gave 3 positions, True 1, alpha (B, 1) broadcast against kappa (B, K), 1-D inputs an
    IndexError, a negative length torch's arange error."""
    from attnkit.nn.location import gmm_window_weights

    with pytest.raises(ValueError, match=needle):
        gmm_window_weights(*(torch.ones(shape) for shape in shapes), length)
