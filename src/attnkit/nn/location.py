r"""Gaussian-mixture location-based attention of Graves, "Generating Sequences With Recurrent Neural Networks"
(arXiv:1308.0850), section 5.1, eqs. (46)-(51); lecture "Gaussian mixture location-based attention":

.. math::
    (\hat\alpha_t, \hat\beta_t, \hat\kappa_t) = W q_t + b, \qquad
    \alpha_t = f(\hat\alpha_t), \quad \beta_t = f(\hat\beta_t), \quad \kappa_t = \kappa_{t-1} +
    f(\hat\kappa_t)

.. math::
    \phi(t, u) = \sum_{k=1}^K \alpha_t^k \exp\left(-\beta_t^k (\kappa_t^k - u)^2\right), \qquad
    w_t = \sum_{u} \phi(t, u)\, c_u

with ``f = exp`` (the paper) or ``f = softplus`` (the stable option: no overflow for large pre-activations).
Positions are ``u = 1, ..., U`` (Graves's indexing) and ``kappa_0 = 0``. The window weights ``phi`` are *not*
normalized (as in the paper). Because every offset ``f(kappa_hat) > 0``, each ``kappa^k`` increases at every
step: the window only moves forward, which suits monotonic alignments and cannot express reordering.

Shapes: ``query (B, Dq)``; ``values (B, U, Dv)``; ``kappa (B, K)`` from the previous step
(``initial_kappa(B)`` for the first); ``key_mask (B, U)`` bool, True = real. Returns ``window (B, Dv)``,
``phi (B, U)`` (exactly 0 on padded positions, so padding = truncation, whatever the padded values hold, NaN
and inf included) and the new ``kappa (B, K)``. Positions count the real values only: padding before or
between them equals truncation too.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..validators import NotScriptable, check_not_traced
from .content import check_key_mask
from .module_utils import all_finite, zero_where

__all__ = ["GMMLocationAttention", "gmm_window_weights", "PARAMETERIZATIONS"]

PARAMETERIZATIONS = ("exp", "softplus")


def gmm_window_weights(alpha: Tensor, beta: Tensor, kappa: Tensor, length: int) -> Tensor:
    """``phi(u) = sum_k alpha_k exp(-beta_k (kappa_k - u)^2)`` for ``u = 1 .. length``, the numbering of
    Graves (arXiv:1308.0850, eqs. 46-51) and the lecture: with ``kappa_0 = 0`` and steps of about one
    position, step 1 is centred on the first value (``phi[:, 0]`` is position ``u = 1``).

    ``alpha, beta, kappa (B, K)`` -> ``phi (B, length)``.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length={length!r}; expected the number of positions, an integer >= 0")
    for name, t in (("alpha", alpha), ("beta", beta), ("kappa", kappa)):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} is {t.dtype if isinstance(t, Tensor) else type(t).__name__} of shape "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else ()}; expected a floating (B, K)")
    if not alpha.shape == beta.shape == kappa.shape:
        named = (("alpha", alpha), ("beta", beta), ("kappa", kappa))
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in named)
        raise ValueError(f"{shapes}: they must have one shape (B, K)")
    exact = _positions_dtype(kappa.dtype)  # positions past 256 exist in float32, not in bfloat16
    u = torch.arange(1, length + 1, device=kappa.device, dtype=exact)  # (U,): positions 1 .. U
    return _window_at(alpha, beta, kappa, u)


def _window_at(alpha: Tensor, beta: Tensor, kappa: Tensor, u: Tensor) -> Tensor:
    """``phi`` at positions ``u``: ``(U,)`` shared by the batch or ``(B, U)`` per example -> ``(B, U)``."""
    exact = u.dtype
    u = u if u.dim() == 2 else u[None]  # (B or 1, U)
    dist2 = (kappa.to(exact)[:, :, None] - u[:, None, :]) ** 2  # (B, K, U)
    phi = (alpha.to(exact)[:, :, None] * torch.exp(-beta.to(exact)[:, :, None] * dist2)).sum(dim=1)  # (B, U)
    return phi.to(alpha.dtype)


def _positions_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype positions are kept in: float32 for bfloat16 and float16 (whose integers end at 256 and
    2048: kappa stuck at 256 in bfloat16 with steps of 1), else ``dtype`` (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


class GMMLocationAttention(NotScriptable, nn.Module):
    """``GMMLocationAttention(query_dim, num_components, parameterization="exp", init_offset=1.0)``.

    ``init_offset``: the step size ``f(kappa_hat)`` of the initial bias (1 = one position per step).
    ``forward(query, values, kappa, key_mask=None) -> (window, phi, kappa)``.
    """

    def __init__(
        self, query_dim: int, num_components: int, parameterization: str = "exp", init_offset: float = 1.0
    ) -> None:
        super().__init__()
        for name, value in (("query_dim", query_dim), ("num_components", num_components)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(f"parameterization={parameterization!r}: expected one of {PARAMETERIZATIONS}")
        if (
            isinstance(init_offset, bool)
            or not isinstance(init_offset, (int, float))
            or not 0 < init_offset < math.inf
        ):
            raise ValueError(
                f"init_offset={init_offset!r}: expected a finite positive number (positions per step)"
            )
        self.num_components = num_components
        self.parameterization = parameterization
        self.init_offset = float(init_offset)
        self.proj = nn.Linear(query_dim, 3 * num_components)
        self.reset_parameters()

    def _inverse(self, y: float) -> float:
        """``f^{-1}(y)`` for the chosen parameterization (used to set the initial bias)."""
        # Python math, not a tensor: reset_parameters must also run under torch.device("meta")
        if self.parameterization == "exp":
            return math.log(y)
        return y + math.log(-math.expm1(-y))  # inverse softplus

    def reset_parameters(self) -> None:
        K = self.num_components
        nn.init.xavier_uniform_(self.proj.weight, gain=0.1)  # start near the bias: a steady, smooth window
        with torch.no_grad():
            self.proj.bias[:K].fill_(self._inverse(1.0))  # alpha = 1
            self.proj.bias[K : 2 * K].fill_(
                self._inverse(0.5)
            )  # beta = 0.5: a window about two positions wide
            self.proj.bias[2 * K :].fill_(self._inverse(self.init_offset))

    def initial_kappa(self, batch_size: int, device=None, dtype=None) -> Tensor:
        """``kappa_0 = 0``: ``(B, K)``, in float32 for a bfloat16 or float16 module (positions past 256
        are exact in float32; kappa stuck at 256 in bfloat16)."""
        return torch.zeros(
            batch_size, self.num_components, device=device,
            dtype=_positions_dtype(dtype or self.proj.weight.dtype),
        )

    def _f(self, x: Tensor) -> Tensor:
        return torch.exp(x) if self.parameterization == "exp" else F.softplus(x)

    def parameters_from(self, query: Tensor, kappa: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(alpha, beta, kappa_t)``, each ``(B, K)``, from ``query (B, Dq)`` and ``kappa_{t-1} (B, K)``."""
        a_hat, b_hat, k_hat = self.proj(query).chunk(3, dim=-1)  # 3 x (B, K)
        return self._f(a_hat), self._f(b_hat), kappa + self._f(k_hat).to(kappa.dtype)

    def forward(
        self, query: Tensor, values: Tensor, kappa: Tensor, key_mask: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        check_not_traced(type(self).__name__)
        Dq = self.proj.in_features
        if not isinstance(query, Tensor) or query.dim() != 2 or query.shape[1] != Dq:
            got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
            raise ValueError(f"query has shape {got}; expected (B, Dq) = (B, {Dq}) (one step)")
        autocast = torch.is_autocast_enabled(query.device.type)  # mixed dtypes are autocast's to reconcile
        weight = self.proj.weight.dtype
        for name, t in (("query", query), ("values", values), ("kappa", kappa)):
            if name == "kappa" and isinstance(t, Tensor) and t.dtype == _positions_dtype(weight):
                continue  # positions in float32 for a half-precision module (initial_kappa)
            if isinstance(t, Tensor) and t.dtype != weight and not autocast:
                raise ValueError(
                    f"{name} has dtype {t.dtype} but the module's weights are {self.proj.weight.dtype}; "
                    "convert one of them with .to(dtype)"
                )
        # value checks on the CPU only: on an accelerator each would synchronize the device at every step;
        # inside torch.func.vmap they read every example's values
        checked = query.device.type == "cpu"
        if checked and not all_finite(query):
            raise ValueError("query contains NaN or inf; check the decoder state that feeds the attention")
        B = query.shape[0]
        if not isinstance(values, Tensor) or values.dim() != 3 or values.shape[0] != B:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"values has shape {got}; expected (B, U, Dv) with B = {B}")
        if not isinstance(kappa, Tensor) or tuple(kappa.shape) != (B, self.num_components):
            got = tuple(kappa.shape) if isinstance(kappa, Tensor) else type(kappa).__name__
            raise ValueError(
                f"kappa has shape {got}; expected (B, K) = ({B}, {self.num_components}); start from "
                f"initial_kappa(B)"
            )
        if checked and not all_finite(kappa):
            raise ValueError(
                "kappa contains NaN or inf; pass the kappa returned by the previous step (initial_kappa(B) "
                "for the first)"
            )
        U = values.shape[1]
        check_key_mask(key_mask, B, U)
        if key_mask is not None and key_mask.device != values.device:
            raise ValueError(
                f"key_mask is on {key_mask.device} but values are on {values.device}; "
                "move it with .to(device)"
            )
        alpha, beta, kappa = self.parameters_from(query, kappa)  # (B, K) each
        if checked and not all_finite(torch.stack([alpha, beta, kappa])):
            raise ValueError(
                f"the window parameters (alpha, beta, kappa) are not finite: {self.parameterization} of the "
                "projected query overflowed (exp of more than about 88 in float32); use "
                "parameterization='softplus', which grows linearly, or keep the query smaller"
            )
        if key_mask is None:
            phi = gmm_window_weights(alpha, beta, kappa, U)  # (B, U)
        else:
            # positions count the real values only (1, 2, ... over True), so that padding anywhere, before
            # or between the real values too, equals truncation; absolute positions moved a left-padded
            # window by the padding's length (up to 5.3 off over 4 steps)
            u = key_mask.cumsum(-1, dtype=_positions_dtype(kappa.dtype))  # (B, U)
            phi = _window_at(alpha, beta, kappa, u).masked_fill(~key_mask, 0.0)
            # a select, not 0 * value: padded values that hold NaN or inf never reach the window
            values = zero_where(key_mask[:, :, None], values)  # (B, U, Dv)
        window = (phi.to(values.dtype)[:, None, :] @ values)[:, 0]  # (B, 1, U) @ (B, U, Dv) -> (B, Dv)
        return window, phi, kappa

    def extra_repr(self) -> str:
        return f"num_components={self.num_components}, parameterization={self.parameterization}"
