r"""DRAW's selective attention: an ``N x N`` grid of Gaussian filters read from (or written to) an image.

"DRAW: A Recurrent Neural Network For Image Generation" (Gregor et al., ICML 2015, arXiv:1502.04623),
section 3.2, eqs. (19)-(29). Pixel coordinates are 1-based as in the paper (``a = 1..A``, ``b = 1..B``).

.. math::
    (\tilde g_X, \tilde g_Y, \log\sigma^2, \log\tilde\delta, \log\gamma) = W(h) \quad (21) \\
    g_X = \tfrac{A+1}{2}(\tilde g_X + 1), \quad g_Y = \tfrac{B+1}{2}(\tilde g_Y + 1), \quad
    \delta = \tfrac{\max(A, B) - 1}{N - 1}\,\tilde\delta \quad (22\text{-}24) \\
    \mu_X^i = g_X + (i - N/2 - 0.5)\,\delta, \\
    \mu_Y^j = g_Y + (j - N/2 - 0.5)\,\delta \quad (19\text{-}20) \\
    F_X[i, a] = \tfrac{1}{Z_X} \exp\!\Big(-\tfrac{(a - \mu_X^i)^2}{2\sigma^2}\Big), \quad
    F_Y[j, b] = \tfrac{1}{Z_Y} \exp\!\Big(-\tfrac{(b - \mu_Y^j)^2}{2\sigma^2}\Big) \quad (25\text{-}26) \\
    \text{read}(x) = \gamma\, F_Y\, x\, F_X^T \quad (27), \qquad
    \text{write}(w) = \tfrac{1}{\hat\gamma}\, \hat F_Y^T\, w\, \hat F_X \quad (29)

Invariant: every filter row sums to 1 (``Z`` is the row sum, computed as a softmax over pixels, so a filter
whose centre lies outside the image still sums to 1 and then weighs the nearest border pixels). With
``N = A``, unit stride, centred grid and ``sigma -> 0`` the read returns the image itself.

Shapes: images ``x (B, C, Bh, Aw)`` (height ``B``, width ``A`` in the paper's letters), parameters ``(B,)``,
filterbanks ``F_X (B, N, A)``, ``F_Y (B, N, Bh)``, glimpses ``(B, C, N, N)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from ..validators import NotScriptable, check_not_traced
from .module_utils import check_like_parameters, check_same_device_dtype

__all__ = ["DRAWRead", "DRAWWindow", "draw_read", "draw_write", "filterbank", "window_from_params"]


@dataclass
class DRAWWindow:
    """The attention window in pixel units: centre ``gx, gy`` (1-based), ``stride``, ``sigma2`` (variance),
    ``gamma`` (intensity); each ``(B,)``, in the image's dtype (``gx``, ``gy`` and ``stride`` may be float32
    for a bfloat16 / float16 image, as ``window_from_params`` makes them). ``log_sigma2 (B,)``, when given,
    is what the filters are computed from (``sigma2`` then only reports it): their gradient stays finite
    where ``sigma2`` underflows."""

    gx: Tensor
    gy: Tensor
    stride: Tensor
    sigma2: Tensor
    gamma: Tensor
    log_sigma2: Optional[Tensor] = None  # known from ``window_from_params``: finite gradients


def window_from_params(params: Tensor, width: int, height: int, N: int) -> DRAWWindow:
    """``params (B, 5)`` = ``(g~X, g~Y, log sigma^2, log delta~, log gamma)`` (eq. 21) -> window (22-24)."""
    if params.dim() != 2 or params.shape[-1] != 5:
        raise ValueError(f"params has shape {tuple(params.shape)}; expected (B, 5)")
    if not params.dtype.is_floating_point:
        raise ValueError(
            f"params has dtype {params.dtype}; expected a floating dtype (cast it with .float())"
        )
    for name, value in (("width", width), ("height", height), ("N", N)):
        _check_size(name, value)
    gx_t, gy_t, log_s2, log_d, log_g = params.unbind(-1)
    # centres and stride in float32 for bfloat16 / float16 params (a centre of 150.5 in bfloat16 is 150: the
    # grid half a pixel off at widths past 256); the filters come out in the params' dtype
    positions = torch.promote_types(params.dtype, torch.float32)
    gx_t, gy_t, log_d = (t.to(positions) for t in (gx_t, gy_t, log_d))
    gx = (width + 1) / 2 * (gx_t + 1)
    gy = (height + 1) / 2 * (gy_t + 1)
    stride = (max(width, height) - 1) / max(N - 1, 1) * torch.exp(log_d)
    if params.device.type == "cpu":  # no device sync per step on an accelerator
        if not bool(torch.isfinite(params).all()):
            raise ValueError("params contain NaN or inf; check the state the window is computed from")
        # gamma scales read and divides write: gamma and 1 / gamma must both be finite
        limit = math.log(torch.finfo(params.dtype).max)  # 88.7 in float32, 709.8 in float64
        if not bool((log_g.abs() <= limit).all()):
            raise ValueError(
                f"log gamma = {log_g.tolist()}: gamma = exp(log gamma) and 1 / gamma overflow {params.dtype} "
                f"outside [-{limit:.1f}, {limit:.1f}]; keep log gamma in that range (e.g. clamp the layer's "
                "output)"
            )
        if not bool(torch.isfinite(stride).all()):
            raise ValueError(
                f"log delta = {log_d.tolist()}: the stride exp(log delta) * {max(width, height) - 1} / "
                f"{max(N - 1, 1)} overflows {params.dtype}; keep log delta smaller (e.g. clamp the layer's "
                "output)"
            )
    return DRAWWindow(gx, gy, stride, torch.exp(log_s2), torch.exp(log_g), log_sigma2=log_s2)


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected a positive integer")


def filterbank(window: DRAWWindow, width: int, height: int, N: int) -> tuple[Tensor, Tensor]:
    """Filterbanks ``F_X (B, N, width)``, ``F_Y (B, N, height)`` (eqs. 19-20, 25-26); rows sum to 1."""
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ValueError(f"N={N!r}; expected a grid size >= 1")
    for name, value in (("width", width), ("height", height)):
        _check_size(name, value)
    device, given = window.gamma.device, window.gamma.dtype
    # positions in float32 for a bfloat16 / float16 window (whose integers end at 256 / 2048: at width 300
    # in bfloat16 only 98 of 300 filters sat on their own pixel); the filters are returned in its dtype
    dtype = torch.promote_types(given, torch.float32)
    gx, gy, stride = (t.to(dtype) for t in (window.gx, window.gy, window.stride))
    offsets = torch.arange(1, N + 1, device=device, dtype=dtype) - N / 2 - 0.5  # (N,)
    mu_x = gx[:, None] + offsets * stride[:, None]  # (B, N)
    mu_y = gy[:, None] + offsets * stride[:, None]  # (B, N)
    a = torch.arange(1, width + 1, device=device, dtype=dtype)  # (A,)
    b = torch.arange(1, height + 1, device=device, dtype=dtype)  # (Bh,)
    # sigma^2 that underflowed to 0 (log sigma^2 = -200) is the limit sigma -> 0: each filter on its nearest
    # pixel. The nearest squared distance is taken out of each row first (softmax does not change), so the
    # nearest pixel's exponent is 0, not -inf - (-inf) = NaN. 1 / (2 sigma^2) is 0.5 exp(-log sigma^2), not a
    # division: the backward of d2 / (2 sigma^2) forms sigma^2 * sigma^2, which underflows to 0 (NaN
    # gradients for log sigma^2 below -44 in float32, -355 in float64). log sigma^2 is floored at log(tiny)
    # so that 1 / (2 sigma^2) stays finite (the floor passes no gradient; the filters are one-hot there).
    tiny = torch.finfo(given).tiny  # the window's own range: its sigma^2 underflows there
    if window.log_sigma2 is not None:
        log_s2 = window.log_sigma2.to(dtype).clamp_min(math.log(tiny))
    else:
        log_s2 = torch.log(window.sigma2.to(dtype).clamp_min(tiny))
    inv_2s2 = (0.5 * torch.exp(-log_s2))[:, None, None]  # (B, 1, 1) = 1 / (2 sigma^2)

    def bank(pixels: Tensor, mu: Tensor) -> Tensor:
        d2 = (pixels - mu[..., None]) ** 2  # (B, N, pixels)
        return torch.softmax(-(d2 - d2.amin(dim=-1, keepdim=True)) * inv_2s2, dim=-1)

    return bank(a, mu_x).to(given), bank(b, mu_y).to(given)  # (B, N, A), (B, N, Bh)


def _check_image(x: Tensor, what: str = "image") -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating tensor, got "
                         f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{what} has shape {tuple(x.shape)}; expected (B, C, H, W)")


def _check_window(window: DRAWWindow, x: Tensor, what: str = "image") -> None:
    B = x.shape[0]
    names = ["gx", "gy", "stride", "sigma2", "gamma"] + ([] if window.log_sigma2 is None else ["log_sigma2"])
    for name in names:
        t = getattr(window, name)
        if not isinstance(t, Tensor) or tuple(t.shape) != (B,):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"window.{name} has shape {got}; expected ({B},), one value per image")
        if name in ("gx", "gy", "stride") and t.dtype == torch.promote_types(x.dtype, torch.float32):
            like = x.new_empty(0, dtype=t.dtype)  # positions may be float32 for a half-precision image
        else:
            like = x
        check_same_device_dtype(t, f"window.{name}", like, f"the {what}",
                                hint=" (e.g. the module that computes the window)")


def _check_values(window: DRAWWindow, write: bool) -> None:
    """Finite centres and a finite stride >= 0, a variance that is finite and > 0 (or a finite
    ``log_sigma2``, which the filters use then), and a valid ``gamma``; on the CPU (no device sync per step
    on an accelerator). A NaN centre gave an all-NaN glimpse, a negative variance one-hot filters."""
    if window.gamma.device.type != "cpu":
        return
    checks = [
        ("gx", window.gx, "finite"), ("gy", window.gy, "finite"), ("stride", window.stride, "finite and >= 0")
    ]
    checks.append(
        ("sigma2", window.sigma2, "finite and > 0") if window.log_sigma2 is None
        else ("log_sigma2", window.log_sigma2, "finite")
    )
    for name, t, rule in checks:
        ok = torch.isfinite(t)
        if name == "stride":
            ok = ok & (t >= 0)
        elif name == "sigma2":
            ok = ok & (t > 0)
        if not bool(ok.all()):
            raise ValueError(f"window.{name} = {t.tolist()}; it must be {rule} for every image")
    _check_gamma(window.gamma, write)


def _check_gamma(gamma: Tensor, write: bool) -> None:
    """``gamma`` finite and positive, and for write (which divides by it) ``1 / gamma`` finite too."""
    if gamma.device.type != "cpu":  # no device sync per step on an accelerator
        return
    ok = torch.isfinite(gamma) & (gamma > 0)
    if write:
        ok = ok & torch.isfinite(1 / gamma)
    if not bool(ok.all()):
        limit = math.log(torch.finfo(gamma.dtype).max)
        what = "write divides by gamma: gamma and 1 / gamma" if write else "gamma"
        raise ValueError(
            f"window.gamma = {gamma.tolist()}; {what} must be finite and positive: keep log gamma within "
            f"[-{limit:.1f}, {limit:.1f}] for {gamma.dtype}"
        )


def draw_read(x: Tensor, window: DRAWWindow, N: int) -> Tensor:
    """``gamma F_Y x F_X^T`` (eq. 27): ``x (B, C, H, W)`` -> glimpse ``(B, C, N, N)``."""
    _check_image(x)
    _check_window(window, x)
    _check_values(window, write=False)
    fx, fy = filterbank(window, x.shape[-1], x.shape[-2], N)
    glimpse = torch.einsum("bjh,bchw,biw->bcji", fy, x, fx)  # (B, C, N, N)
    return window.gamma[:, None, None, None] * glimpse


def draw_write(w: Tensor, window: DRAWWindow, width: int, height: int) -> Tensor:
    """``(1 / gamma) F_Y^T w F_X`` (eq. 29): patch ``w (B, C, N, N)`` -> image ``(B, C, height, width)``."""
    _check_image(w, "patch")
    _check_window(window, w, "patch")
    if w.shape[-1] != w.shape[-2]:
        raise ValueError(f"patch has shape {tuple(w.shape)}; expected a square N x N patch (B, C, N, N)")
    for name, value in (("width", width), ("height", height)):
        _check_size(name, value)
    _check_values(window, write=True)
    N = w.shape[-1]
    fx, fy = filterbank(window, width, height, N)
    image = torch.einsum("bjh,bcji,biw->bchw", fy, w, fx)  # (B, C, H, W)
    return image / window.gamma[:, None, None, None]


class DRAWRead(NotScriptable, nn.Module):
    """Read an ``N x N`` glimpse at a window computed from a state ``h`` by a linear layer (eq. 21).

    ``forward(x (B, C, H, W), h (B, state_dim)) -> (glimpse (B, C, N, N), DRAWWindow)``. The linear layer
    starts at zero weights and zero bias: a centred grid covering the whole image, ``sigma = 1``,
    ``gamma = 1``.
    """

    def __init__(self, state_dim: int, N: int, width: int, height: int) -> None:
        super().__init__()
        for name, value in (("state_dim", state_dim), ("N", N), ("width", width), ("height", height)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive integer")
        self.N, self.width, self.height = N, width, height
        self.params = nn.Linear(state_dim, 5)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.params.weight)
        nn.init.zeros_(self.params.bias)

    def window(self, h: Tensor) -> DRAWWindow:
        return window_from_params(self.params(h), self.width, self.height, self.N)

    def forward(self, x: Tensor, h: Tensor) -> tuple[Tensor, DRAWWindow]:
        check_not_traced(type(self).__name__)
        _check_image(x)
        if x.shape[-2:] != (self.height, self.width):
            raise ValueError(
                f"image is {tuple(x.shape[-2:])} (H, W); "
                f"this DRAWRead was built for ({self.height}, {self.width})"
            )
        state = self.params.in_features
        if not isinstance(h, Tensor) or h.dim() != 2 or tuple(h.shape) != (x.shape[0], state):
            got = tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__
            raise ValueError(f"h has shape {got}; expected (B, state_dim) = ({x.shape[0]}, {state})")
        for name, t in (("image", x), ("h", h)):
            check_like_parameters(t, self.params.weight, name, "DRAWRead")
        window = self.window(h)
        return draw_read(x, window, self.N), window

    def extra_repr(self) -> str:
        return f"N={self.N}, width={self.width}, height={self.height}"
