r"""Recurrent Attention Model: multi-resolution glimpses, a recurrent core and a location policy (REINFORCE).

"Recurrent Models of Visual Attention" (Mnih, Heess, Graves and Kavukcuoglu, NIPS 2014, arXiv:1406.6247),
section 3 (model), 3.2 (training, eq. 1-2) and 4 (the classification networks).

.. math::
    \rho(x, l) = k \text{ patches of side } g, 2g, \dots, 2^{k-1} g \text{ centred at } l,
    \text{ each average-pooled to } g \times g \quad (\text{glimpse sensor}) \\
    g_t = \text{ReLU}(W_g h_g + W_l h_l), \quad h_g = \text{ReLU}(\theta_g^0 \rho(x_t, l_{t-1})), \quad
    h_l = \text{ReLU}(\theta_g^1 l_{t-1}) \\
    h_t = \text{ReLU}(W_h h_{t-1} + W_c g_t), \qquad l_t \sim \mathcal N(\tanh(W_\mu h_t), \sigma^2), \qquad
    a_T = \text{softmax}(W_a h_T) \\
    \nabla J \approx \tfrac{1}{M} \sum_i \sum_t \nabla \log \pi(l_t^i | s_{1:t}^i) (R^i - b_t) \quad (2)

``R = 1`` when the class at the last step is right, else 0; ``b_t`` is a learned baseline (a linear
function of the detached ``h_t`` fitted to ``R`` by squared error), as in the paper. The classifier is
trained by cross-entropy; the glimpse choice has no gradient other than REINFORCE (hard attention).
In ``eval()`` the policy's mean is used instead of a sample.

Locations are ``(y, x)`` in ``[-1, 1]^2`` (-1 = top/left pixel centre, +1 = bottom/right). **Border
padding**: patches are cut from the image zero-padded by half the largest patch on every side, so the
part of a glimpse outside the image reads 0 (never wraps or clamps to the border pixels).

Shapes: ``images (B, C, H, W)`` -> ``logits (B, classes)``, ``locations (B, T, 2)``,
``glimpses (B, T, k, C, g, g)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hard import reinforce_loss
from ..validators import check_number
from .building_blocks import check_loss_batch, check_positive_int, check_token_ids, describe
from .building_blocks import check_finite_pixels, check_input_dtype

__all__ = ["RAMOutput", "RecurrentAttentionModel", "glimpse_sensor", "location_to_pixels"]


def location_to_pixels(loc: Tensor, height: int, width: int) -> Tensor:
    """``loc (B, 2)`` ``(y, x)`` in [-1, 1] -> integer pixel centres ``(B, 2)`` (row, column), 0-based.

    Computed in float32 (float64 stays float64), so bfloat16/float16 locations reach every pixel.
    """
    check_positive_int("height", height)
    check_positive_int("width", width)
    if not loc.is_floating_point() or not bool(torch.isfinite(loc).all()):
        raise ValueError(f"loc is {describe(loc)} with non-finite or integer entries; expected finite (y, x) "
                         "in [-1, 1]")
    dtype = torch.float64 if loc.dtype == torch.float64 else torch.float32
    scale = torch.tensor([height - 1, width - 1], device=loc.device, dtype=dtype)
    return torch.round((loc.to(dtype).clamp(-1, 1) + 1) / 2 * scale).long()  # (B, 2)


def glimpse_sensor(images: Tensor, loc: Tensor, size: int, scales: int) -> Tensor:
    """Retina ``rho(x, l)``: ``images (B, C, H, W)``, ``loc (B, 2)`` -> ``(B, scales, C, size, size)``.

    Scale ``i`` cuts a ``size * 2**i`` square centred at the pixel of ``loc`` (top-left corner at
    ``centre - side // 2``) and average-pools it by ``2**i``. Outside the image the patch reads 0.
    """
    if not isinstance(images, Tensor) or not isinstance(loc, Tensor):
        raise ValueError(f"images are {describe(images)}, loc {describe(loc)}; expected tensors (B, C, H, W) "
                         "and (B, 2)")
    if images.dim() != 4 or loc.shape != (images.shape[0], 2):
        raise ValueError(
            f"images {tuple(images.shape)}, loc {tuple(loc.shape)}; expected (B, C, H, W) and (B, 2)"
        )
    if not loc.is_floating_point() or not bool(torch.isfinite(loc).all()):
        raise ValueError(f"loc is {describe(loc)} with non-finite or integer entries; expected finite (y, x) "
                         "in [-1, 1] (values outside are clamped to the border)")
    check_positive_int("size", size)
    check_positive_int("scales", scales)
    B, _, H, W = images.shape
    largest = size * 2 ** (scales - 1)
    pad = largest // 2 + 1
    padded = F.pad(images, (pad, pad, pad, pad))  # (B, C, H + 2p, W + 2p), zeros outside
    centre = location_to_pixels(loc, H, W) + pad  # (B, 2) in padded coordinates
    batch = torch.arange(B, device=images.device)[:, None, None]
    out = []
    for i in range(scales):
        side = size * 2**i
        offs = torch.arange(side, device=images.device) - side // 2  # (side,)
        rows = (centre[:, 0, None] + offs)[:, :, None]  # (B, side, 1)
        cols = (centre[:, 1, None] + offs)[:, None, :]  # (B, 1, side)
        patch = padded.permute(0, 2, 3, 1)[batch, rows, cols]  # (B, side, side, C)
        patch = patch.permute(0, 3, 1, 2)  # (B, C, side, side)
        out.append(F.avg_pool2d(patch, 2**i) if i else patch)
    return torch.stack(out, dim=1)  # (B, k, C, size, size)


@dataclass
class RAMOutput:
    logits: Tensor
    locations: Tensor
    log_probs: Tensor
    baselines: Tensor
    glimpses: Tensor


class RecurrentAttentionModel(nn.Module):
    """RAM classifier with ``glimpses`` steps of ``scales`` patches of side ``glimpse_size``."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        glimpse_size: int = 6,
        scales: int = 3,
        glimpses: int = 6,
        hidden_dim: int = 128,
        glimpse_dim: int = 64,
        location_dim: int = 32,
        location_std: float = 0.15,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        num_classes, in_channels, glimpse_size, scales, glimpses, hidden_dim, glimpse_dim, location_dim = (
            check_positive_int(name, value)
            for name, value in (
                ("num_classes", num_classes),
                ("in_channels", in_channels),
                ("glimpse_size", glimpse_size),
                ("scales", scales),
                ("glimpses", glimpses),
                ("hidden_dim", hidden_dim),
                ("glimpse_dim", glimpse_dim),
                ("location_dim", location_dim),
            )
        )
        std = check_number(
            location_std,
            f"location_std={location_std!r}",
            "expected a standard deviation > 0",
            low=0.0,
            low_open=True,
        )
        self.size, self.scales, self.steps, self.std = glimpse_size, scales, glimpses, std
        self.hidden_dim, self.num_classes, self.in_channels = hidden_dim, num_classes, in_channels
        self.theta_g = nn.Linear(scales * in_channels * glimpse_size**2, glimpse_dim)
        self.theta_l = nn.Linear(2, location_dim)
        self.glimpse_g = nn.Linear(glimpse_dim, hidden_dim)
        self.glimpse_l = nn.Linear(location_dim, hidden_dim)
        self.core_h = nn.Linear(hidden_dim, hidden_dim)
        self.core_g = nn.Linear(hidden_dim, hidden_dim)
        self.policy = nn.Linear(hidden_dim, 2)
        self.baseline = nn.Linear(hidden_dim, 1)
        self.classify = nn.Linear(hidden_dim, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.children():
            module.reset_parameters()

    def forward(self, images: Tensor) -> RAMOutput:
        if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
            raise ValueError(f"images are {describe(images)}; expected a floating tensor (B, C, H, W)")
        if images.shape[1] != self.in_channels:
            raise ValueError(
                f"images have shape {tuple(images.shape)}; expected (B, C={self.in_channels}, H, W)"
            )
        if 0 in images.shape[2:]:
            raise ValueError(
                f"images have shape {tuple(images.shape)}: an image with no pixels has nothing to glimpse; "
                "give images of height and width >= 1"
            )
        check_input_dtype(images, self.classify.weight, "RecurrentAttentionModel")
        check_finite_pixels(images)
        B = images.shape[0]
        h = images.new_zeros(B, self.hidden_dim)
        locs, log_probs, baselines, glimpses = [], [], [], []
        for _ in range(self.steps):
            mean = torch.tanh(self.policy(h.detach()))  # (B, 2); the policy learns from REINFORCE only
            if self.training:
                sample = mean.detach() + self.std * torch.randn_like(mean)  # l ~ N(mean, std^2)
            else:
                sample = mean.detach()
            # the score function of the sample drawn, not of the clamped location (the log-density of the
            # clamped value gave a biased gradient near the border, of the wrong sign at mean 0.9)
            log_probs.append(torch.distributions.Normal(mean, self.std).log_prob(sample).sum(-1))  # (B,)
            loc = sample.clamp(-1, 1)  # where the glimpse is taken: the image's border bounds it
            baselines.append(self.baseline(h.detach()).squeeze(-1))  # (B,)
            rho = glimpse_sensor(images, loc, self.size, self.scales)  # (B, k, C, g, g)
            hg = F.relu(self.theta_g(rho.flatten(1)))
            hl = F.relu(self.theta_l(loc))
            g = F.relu(self.glimpse_g(hg) + self.glimpse_l(hl))  # (B, hidden)
            h = F.relu(self.core_h(h) + self.core_g(g))  # (B, hidden)
            locs.append(loc)
            glimpses.append(rho)
        return RAMOutput(
            self.classify(h),
            torch.stack(locs, 1),
            torch.stack(log_probs, 1),
            torch.stack(baselines, 1),
            torch.stack(glimpses, 1),
        )

    def loss(self, images: Tensor, labels: Tensor) -> tuple[Tensor, RAMOutput]:
        """Cross-entropy + REINFORCE (eq. 2, reward = correct class) + baseline regression."""
        check_token_ids(labels, 1, self.num_classes, "labels", "(B,)", "num_classes is")  # one fused sync
        out = self(images)
        check_loss_batch(out.logits.shape[0], "images")
        if labels.shape[0] != out.logits.shape[0]:
            raise ValueError(f"labels {tuple(labels.shape)} for {out.logits.shape[0]} images; expected (B,)")
        ce = F.cross_entropy(out.logits, labels)
        reward = (out.logits.argmax(-1) == labels).float()  # (B,)
        T = out.log_probs.shape[1]
        reinforce = (
            reinforce_loss(
                out.log_probs.flatten(), reward[:, None].expand(-1, T).flatten(), out.baselines.flatten()
            )
            * T
        )  # sum over steps, mean over images
        baseline_mse = F.mse_loss(out.baselines, reward[:, None].expand(-1, T))
        return ce + reinforce + baseline_mse, out

    def extra_repr(self) -> str:
        return (
            f"glimpse_size={self.size}, scales={self.scales}, glimpses={self.steps}, "
            f"location_std={self.std:g}"
        )
