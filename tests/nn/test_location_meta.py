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


def test_a_half_precision_draw_window_centre_is_exact_at_even_widths_past_256():
    """The centre (W + 1) / 2 = 150.5 of a width-300 image was 150 in bfloat16: every filter sat half a pixel
    left, so a unit-stride grid of tiny variance read pixel i - 1 (or a mix) for filter i. The read of a
    bfloat16 image equals the float32 read within bfloat16's rounding."""
    from attnkit.nn.draw import draw_read, filterbank, window_from_params

    W = 300
    params = torch.tensor([[0.0, 0.0, -30.0, 0.0, 0.0]], dtype=torch.bfloat16)
    window = window_from_params(params, W, W, W)
    assert float(window.gx) == 150.5 and float(window.stride) == 1.0
    fx, _ = filterbank(window, W, W, W)
    assert fx.dtype == torch.bfloat16
    assert torch.equal(fx[0].float().argmax(-1), torch.arange(W))
    image = torch.rand(2, 1, W, W, generator=torch.Generator().manual_seed(0))
    params32 = torch.tensor([[0.1, -0.2, 0.3, -0.1, 0.0]] * 2)
    expected = draw_read(image, window_from_params(params32, W, W, 4), 4)
    got = draw_read(image.bfloat16(), window_from_params(params32.bfloat16(), W, W, 4), 4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


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
