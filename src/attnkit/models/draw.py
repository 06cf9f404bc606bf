r"""DRAW: a recurrent variational auto-encoder that reads and writes through Gaussian attention windows.

"DRAW: A Recurrent Neural Network For Image Generation" (Gregor, Danihelka, Graves, Rezende and Wierstra,
ICML 2015, arXiv:1502.04623), section 2 (eqs. 3-8, 9-12 for the loss) with the attentive read and write of
section 3.2 (eqs. 27 and 29, :mod:`attnkit.nn.draw`).

.. math::
    \hat x_t = x - \sigma(c_{t-1}), \quad r_t = \text{read}(x, \hat x_t, h^{dec}_{t-1}) \quad (3\text{-}4) \\
    h^{enc}_t = \text{RNN}^{enc}(h^{enc}_{t-1}, [r_t, h^{dec}_{t-1}]), \quad
    z_t \sim Q(Z_t | h^{enc}_t) = \mathcal N(\mu_t, \sigma_t) \quad (5\text{-}6) \\
    h^{dec}_t = \text{RNN}^{dec}(h^{dec}_{t-1}, z_t), \\
    c_t = c_{t-1} + \text{write}(h^{dec}_t) \quad (7\text{-}8) \\
    \mathcal L = -\log D(x | c_T)
    + \sum_t \tfrac12 (\mu_t^2 + \sigma_t^2 - \log \sigma_t^2) - T/2 \quad (9\text{-}11)

``D`` is a Bernoulli on ``sigma(c_T)`` (binary cross-entropy with the [0, 1] intensities, computed from the
canvas logits ``c_T``: ``sigma(c)`` rounds to 1 in float32 from ``c`` of about 17, where the loss of a dark
pixel would be clipped at 100 nats with no gradient). Shapes: ``x (B, 1, H, W)`` -> canvases
``(B, T, 1, H, W)`` (``sigma(c_t)``), the last canvas logits ``c_T`` ``(B, 1, H, W)``, read and write windows
per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.draw import DRAWRead, DRAWWindow, draw_write, window_from_params
from ..validators import check_int
from .building_blocks import check_loss_batch, check_positive_int
from .building_blocks import check_finite_pixels

__all__ = ["DRAW", "DRAWOutput"]


@dataclass
class DRAWOutput:
    canvases: Tensor
    kl: Tensor
    read_windows: list[DRAWWindow]
    write_windows: list[DRAWWindow]
    logits: Tensor  # (B, 1, H, W): c_T, whose sigmoid is canvases[:, -1]


class DRAW(nn.Module):
    """DRAW with attention: ``steps`` glimpses, ``read_n x read_n`` read, ``write_n x write_n`` write.

    ``forward`` samples ``z = mu + sigma * eps`` at every step in ``eval()`` too (the paper's generative
    model; unlike dropout, sampling is not switched off): two forwards of one image differ. Seed torch's
    generator (``torch.manual_seed``) before a forward for a reproducible reconstruction."""

    def __init__(
        self,
        height: int,
        width: int,
        steps: int = 8,
        read_n: int = 4,
        write_n: int = 4,
        hidden_dim: int = 64,
        latent_dim: int = 8,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        height, width, steps, read_n, write_n, hidden_dim, latent_dim = (
            check_positive_int(name, value)
            for name, value in (
                ("height", height),
                ("width", width),
                ("steps", steps),
                ("read_n", read_n),
                ("write_n", write_n),
                ("hidden_dim", hidden_dim),
                ("latent_dim", latent_dim),
            )
        )
        self.height, self.width, self.steps = height, width, steps
        self.write_n, self.hidden_dim, self.latent_dim = write_n, hidden_dim, latent_dim
        self.read = DRAWRead(hidden_dim, read_n, width, height)
        self.encoder = nn.LSTMCell(2 * read_n * read_n + hidden_dim, hidden_dim)
        self.posterior = nn.Linear(hidden_dim, 2 * latent_dim)
        self.decoder = nn.LSTMCell(latent_dim, hidden_dim)
        self.write_patch = nn.Linear(hidden_dim, write_n * write_n)
        self.write_params = nn.Linear(hidden_dim, 5)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.read.reset_parameters()
        for module in (self.encoder, self.posterior, self.decoder, self.write_patch, self.write_params):
            module.reset_parameters()

    def _write(self, h: Tensor) -> tuple[Tensor, DRAWWindow]:
        B = h.shape[0]
        window = window_from_params(self.write_params(h), self.width, self.height, self.write_n)
        patch = self.write_patch(h).view(B, 1, self.write_n, self.write_n)  # (B, 1, N, N)
        return draw_write(patch, window, self.width, self.height), window

    def forward(self, x: Tensor) -> DRAWOutput:
        if x.dim() != 4 or x.shape[1:] != (1, self.height, self.width):
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, 1, {self.height}, {self.width})")
        check_finite_pixels(x)  # a NaN failed later, blamed on the recurrent state's attention window
        B = x.shape[0]
        c = x.new_zeros(B, 1, self.height, self.width)
        h_enc = c_enc = h_dec = c_dec = x.new_zeros(B, self.hidden_dim)
        canvases, kls, reads, writes = [], [], [], []
        for _ in range(self.steps):
            x_hat = x - torch.sigmoid(c)  # eq. 3
            r_x, window = self.read(x, h_dec)  # eq. 27, (B, 1, N, N)
            r_hat, _ = self.read(x_hat, h_dec)
            r = torch.cat([r_x.flatten(1), r_hat.flatten(1)], dim=-1)  # (B, 2 N^2)
            h_enc, c_enc = self.encoder(torch.cat([r, h_dec], dim=-1), (h_enc, c_enc))
            mu, log_sigma = self.posterior(h_enc).chunk(2, dim=-1)  # (B, Z) each
            z = mu + torch.exp(log_sigma) * torch.randn_like(mu)
            h_dec, c_dec = self.decoder(z, (h_dec, c_dec))
            w, w_window = self._write(h_dec)
            c = c + w  # eq. 8
            kls.append(0.5 * (mu**2 + torch.exp(2 * log_sigma) - 2 * log_sigma - 1).sum(-1))  # (B,) eq. 11
            canvases.append(torch.sigmoid(c))
            reads.append(window)
            writes.append(w_window)
        return DRAWOutput(torch.stack(canvases, 1), torch.stack(kls, 1).sum(1), reads, writes, logits=c)

    def loss(self, x: Tensor) -> tuple[Tensor, DRAWOutput]:
        """Mean over images of ``L^x + L^z`` (eqs. 9-12), in nats."""
        check_loss_batch(x.shape[0], "x")
        low, high = (float(v) for v in torch.aminmax(x.detach()))  # one host sync; CUDA would assert
        if not (0.0 <= low and high <= 1.0):
            raise ValueError(
                f"x holds values in [{low:g}, {high:g}]; the Bernoulli reconstruction loss needs pixel "
                "intensities in [0, 1] (divide 8-bit images by 255)"
            )
        out = self(x)  # after the checks (a NaN pixel fails the range check)
        # -log D(x | c_T) from the logits: exact where sigma(c_T) rounds to 0 or 1
        recon = F.binary_cross_entropy_with_logits(out.logits, x, reduction="none").flatten(1).sum(1)  # (B,)
        return (recon + out.kl).mean(), out

    @torch.no_grad()
    def generate(self, num: int) -> Tensor:
        """Samples ``z_t ~ N(0, I)`` through the decoder: ``-> (num, T, 1, H, W)`` canvases (on the model's
        device, in its dtype)."""
        check_int(num, f"num={num!r}", "expected a number of samples >= 0", low=0)
        weight = self.write_patch.weight  # the samples follow the model's device and dtype
        h = c = weight.new_zeros(num, self.hidden_dim)
        canvas = weight.new_zeros(num, 1, self.height, self.width)
        out = []
        for _ in range(self.steps):
            z = torch.randn(num, self.latent_dim, device=weight.device, dtype=weight.dtype)
            h, c = self.decoder(z, (h, c))
            canvas = canvas + self._write(h)[0]
            out.append(torch.sigmoid(canvas))
        return torch.stack(out, 1)

    def extra_repr(self) -> str:
        return f"height={self.height}, width={self.width}, steps={self.steps}, write_n={self.write_n}"
