"""DRAW's Gaussian filterbank read and write (eqs. 19-29)."""

import pytest
import torch

from attnkit.nn import DRAWRead
from attnkit.nn.draw import DRAWWindow, draw_read, draw_write, filterbank, window_from_params


def _window(gx, gy, stride, sigma2, gamma=1.0, B=1):
    def t(v):
        return torch.full((B,), float(v), dtype=torch.float64)

    return DRAWWindow(t(gx), t(gy), t(stride), t(sigma2), t(gamma))


@pytest.mark.parametrize(
    "gx,stride,sigma2", [(5.5, 1.0, 1.0), (1.0, 3.0, 0.2), (-4.0, 2.0, 4.0), (20.0, 0.5, 9.0)]
)
def test_filterbank_rows_sum_to_one(gx, stride, sigma2):
    fx, fy = filterbank(_window(gx, 3.0, stride, sigma2), width=10, height=7, N=5)
    assert fx.shape == (1, 5, 10) and fy.shape == (1, 5, 7)
    torch.testing.assert_close(fx.sum(-1), torch.ones(1, 5, dtype=torch.float64))
    torch.testing.assert_close(fy.sum(-1), torch.ones(1, 5, dtype=torch.float64))
    assert (fx >= 0).all()


def test_centred_unit_stride_tiny_variance_read_recovers_patch():
    torch.manual_seed(0)
    x = torch.rand(2, 3, 9, 11, dtype=torch.float64)
    # whole image: N = A = B would need a square image; read the centred 5x5 patch of rows 2..6, cols 3..7
    window = _window(gx=(11 + 1) / 2, gy=(9 + 1) / 2, stride=1.0, sigma2=1e-4, gamma=1.0, B=2)
    patch = draw_read(x, window, N=5)
    torch.testing.assert_close(patch, x[:, :, 2:7, 3:8])
    # and the full square image from a centred grid with N = A
    sq = torch.rand(1, 1, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(draw_read(sq, _window(3.5, 3.5, 1.0, 1e-4), N=6), sq)


def test_intensity_scales_read_and_write_inverts_it():
    torch.manual_seed(0)
    x = torch.rand(1, 1, 6, 6, dtype=torch.float64)
    w = _window(3.5, 3.5, 1.0, 1e-4, gamma=2.5)
    torch.testing.assert_close(draw_read(x, w, N=6), 2.5 * x)
    torch.testing.assert_close(draw_write(draw_read(x, w, N=6), w, 6, 6), x)


def test_params_map_to_window_as_in_eqs_22_to_24():
    params = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0, 0.0]])
    w = window_from_params(params, width=28, height=20, N=5)
    torch.testing.assert_close(w.gx, torch.tensor([14.5, 0.0]))
    torch.testing.assert_close(w.gy, torch.tensor([10.5, 21.0]))
    torch.testing.assert_close(w.stride, torch.full((2,), 27 / 4))


def test_module_starts_with_whole_image_grid_and_checks_size():
    read = DRAWRead(state_dim=4, N=3, width=8, height=8)
    x = torch.rand(2, 1, 8, 8)
    glimpse, window = read(x, torch.zeros(2, 4))
    assert glimpse.shape == (2, 1, 3, 3)
    torch.testing.assert_close(window.gx, torch.full((2,), 4.5))
    with pytest.raises(ValueError, match="built for"):
        read(torch.rand(2, 1, 9, 8), torch.zeros(2, 4))


@pytest.mark.parametrize(
    "dtype, log_s2s",
    [
        (torch.float32, [-150.0, -103.0, -90.0, -87.0, -80.0, -60.0, -50.0, -44.0, -30.0, -10.0, 0.0, 5.0]),
        (torch.float64, [-800.0, -745.0, -705.0, -600.0, -500.0, -355.0, -200.0, -50.0, 0.0, 5.0]),
    ],
)
def test_read_and_write_gradients_are_finite_for_every_log_sigma2(dtype, log_s2s):
    """The backward of d2 / (2 sigma^2) formed sigma^2 * sigma^2, which underflowed: NaN gradients for
    log sigma^2 in -87..-44 (float32) and -705..-355 (float64)."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 7, dtype=dtype)
    for log_s2 in log_s2s:
        p = torch.tensor([[0.1, -0.2, log_s2, 0.0, 0.3]], dtype=dtype, requires_grad=True)
        window = window_from_params(p, 7, 5, 3)
        glimpse = draw_read(x, window, 3)
        image = draw_write(glimpse, window, 7, 5)
        (glimpse.sum() + image.sum()).backward()
        assert torch.isfinite(glimpse).all() and torch.isfinite(image).all(), log_s2
        assert torch.isfinite(p.grad).all(), (log_s2, p.grad)


def test_filters_are_those_of_the_division_formula_where_it_was_fine():
    """0.5 exp(-log sigma^2) replaces the division by 2 sigma^2: the same filters, from the window's
    log sigma^2 or from sigma^2 alone."""
    for log_s2 in [-40.0, -10.0, -2.0, 0.0, 1.5, 4.0]:
        p = torch.tensor([[0.1, -0.3, log_s2, -0.2, 0.0]], dtype=torch.float64)
        window = window_from_params(p, 9, 6, 4)
        fx, fy = filterbank(window, 9, 6, 4)
        mu = window.gx[:, None] + (torch.arange(1, 5, dtype=torch.float64) - 2.5) * window.stride[:, None]
        d2 = (torch.arange(1, 10, dtype=torch.float64) - mu[..., None]) ** 2  # (1, 4, 9)
        old = torch.softmax(-(d2 - d2.amin(-1, keepdim=True)) / (2 * window.sigma2[:, None, None]), dim=-1)
        torch.testing.assert_close(fx, old, atol=1e-12, rtol=1e-10)
        window.log_sigma2 = None  # a window built by hand has sigma^2 only
        torch.testing.assert_close(filterbank(window, 9, 6, 4)[0], fx, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_write_and_filterbank_sizes_must_be_positive_integers(bad):
    window = window_from_params(torch.zeros(1, 5), 6, 6, 3)
    with pytest.raises(ValueError, match=rf"width={bad!r}; expected a positive integer"):
        draw_write(torch.randn(1, 1, 3, 3), window, bad, 6)
    with pytest.raises(ValueError, match=rf"height={bad!r}; expected a positive integer"):
        draw_write(torch.randn(1, 1, 3, 3), window, 6, bad)
    with pytest.raises(ValueError, match=rf"width={bad!r}; expected a positive integer"):
        window_from_params(torch.zeros(1, 5), bad, 6, 3)


def test_mixed_dtypes_of_image_and_window_are_named():
    window = window_from_params(torch.zeros(1, 5), 6, 6, 3)  # float32
    with pytest.raises(ValueError, match="window.gx has dtype torch.float32 but the image torch.float64"):
        draw_read(torch.randn(1, 1, 6, 6, dtype=torch.float64), window, 3)
    with pytest.raises(ValueError, match="window.gx has dtype torch.float32 but the patch torch.float64"):
        draw_write(torch.randn(1, 1, 3, 3, dtype=torch.float64), window, 6, 6)


@pytest.mark.parametrize("log_gamma", [-104.0, -89.0, 89.0, 200.0])
def test_a_log_gamma_whose_exp_or_inverse_overflows_is_refused(log_gamma):
    """log gamma = -104 made write return inf (1 / gamma), 89 made read return inf (float32)."""
    with pytest.raises(ValueError, match=r"log gamma = \[.*\]: gamma = exp\(log gamma\) and 1 / gamma"):
        window_from_params(torch.tensor([[0.0, 0.0, 0.0, 0.0, log_gamma]]), 6, 6, 3)
    ok = window_from_params(torch.tensor([[0.0, 0.0, 0.0, 0.0, 88.0], [0.0, 0.0, 0.0, 0.0, -88.0]]), 6, 6, 3)
    patch = draw_read(torch.rand(2, 1, 6, 6), ok, 3)
    assert torch.isfinite(patch).all() and torch.isfinite(draw_write(patch, ok, 6, 6)).all()
    # a window built by hand is checked where it is used: read needs a finite gamma, write a finite 1 / gamma
    x, patch = torch.rand(1, 1, 6, 6, dtype=torch.float64), torch.rand(1, 1, 3, 3, dtype=torch.float64)
    assert torch.isfinite(draw_read(x, _window(3.5, 3.5, 1.0, 1.0, gamma=1e-320), 3)).all()
    for gamma in (0.0, 1e-320):
        with pytest.raises(ValueError, match="write divides by gamma: gamma and 1 / gamma must be finite"):
            draw_write(patch, _window(3.5, 3.5, 1.0, 1.0, gamma=gamma), 6, 6)
    with pytest.raises(ValueError, match=r"window.gamma = \[inf\]; gamma must be finite and positive"):
        draw_read(x, _window(3.5, 3.5, 1.0, 1.0, gamma=float("inf")), 3)


def test_a_stride_that_overflows_is_refused():
    with pytest.raises(ValueError, match=r"log delta = \[88.5\]: the stride .* overflows torch.float32"):
        window_from_params(torch.tensor([[0.0, 0.0, 0.0, 88.5, 0.0]]), 60, 60, 3)


def test_draw_read_module_names_inputs_of_another_dtype():
    """float64 images into a float32 DRAWRead raised torch's "mat1 and mat2 must have the same dtype"."""
    read = DRAWRead(4, 3, 6, 6)
    with pytest.raises(ValueError, match=r"image has dtype torch.float64 but DRAWRead's parameters are"):
        read(torch.rand(2, 1, 6, 6, dtype=torch.float64), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"h has dtype torch.float64 but DRAWRead's parameters are"):
        read(torch.rand(2, 1, 6, 6), torch.zeros(2, 4, dtype=torch.float64))
