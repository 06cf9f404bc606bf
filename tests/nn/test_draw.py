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
