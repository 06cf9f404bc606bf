r"""A recurrent classifier whose only view of the image is DRAW's Gaussian read glimpse.

The glimpse is DRAW's attentive read ("DRAW: A Recurrent Neural Network For Image Generation", Gregor et
al., ICML 2015, arXiv:1502.04623, eqs. 19-27, :class:`attnkit.nn.DRAWRead`), used as in the paper's
cluttered-MNIST classification experiment (section 4.1): a recurrent network reads ``steps`` glimpses,
each placed by its previous state, and classifies from its last state. Unlike the hard glimpses of
:class:`~attnkit.models.ram.RecurrentAttentionModel` the window is differentiable, so everything trains by
backpropagation.

.. math::
    r_t = \text{read}(x, h_{t-1}) = \gamma F_Y x F_X^T, \qquad h_t = \text{GRU}(h_{t-1}, r_t), \qquad
    p(y | x) = \text{softmax}(W h_T)

Shapes: ``images (B, C, H, W)`` -> ``logits (B, classes)``; :meth:`forward` also returns the windows.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..nn.draw import DRAWRead, DRAWWindow
from .building_blocks import check_positive_int, describe
from .building_blocks import check_finite_pixels, check_input_dtype

__all__ = ["DRAWClassifier"]


class DRAWClassifier(nn.Module):
    r"""Classify an image from ``steps`` DRAW read glimpses (DRAW arXiv:1502.04623 eqs. 19-27, sec. 4.1).

    ``r_t = gamma F_Y x F_X^T`` (a ``read_n x read_n`` Gaussian glimpse placed by ``h_{t-1}``),
    ``h_t = GRU(h_{t-1}, r_t)``, ``p(y | x) = softmax(W h_T)``. Shapes: ``images (B, C, H, W)`` with
    ``(H, W) = (height, width)`` and ``C = in_channels`` -> ``logits (B, num_classes)``; :meth:`forward`
    also returns the windows of every step.
    """

    def __init__(
        self,
        height: int,
        width: int,
        num_classes: int = 10,
        in_channels: int = 1,
        read_n: int = 6,
        steps: int = 4,
        hidden_dim: int = 128,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        height, width, num_classes, in_channels, read_n, steps, hidden_dim = (
            check_positive_int(name, value)
            for name, value in (
                ("height", height),
                ("width", width),
                ("num_classes", num_classes),
                ("in_channels", in_channels),
                ("read_n", read_n),
                ("steps", steps),
                ("hidden_dim", hidden_dim),
            )
        )
        self.steps, self.hidden_dim, self.in_channels = steps, hidden_dim, in_channels
        self.read = DRAWRead(hidden_dim, read_n, width, height)
        self.core = nn.GRUCell(in_channels * read_n * read_n, hidden_dim)
        self.classify = nn.Linear(hidden_dim, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.read.reset_parameters()
        self.core.reset_parameters()
        self.classify.reset_parameters()

    def forward(self, images: Tensor) -> tuple[Tensor, list[DRAWWindow]]:
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != self.in_channels:
            raise ValueError(f"images are {describe(images)}; expected (B, C={self.in_channels}, H, W)")
        check_input_dtype(images, self.classify.weight, "DRAWClassifier")
        check_finite_pixels(images)  # a NaN gave NaN logits (steps=1) or an error about the recurrent state
        h = images.new_zeros(images.shape[0], self.hidden_dim)
        windows = []
        for _ in range(self.steps):
            glimpse, window = self.read(images, h)  # (B, C, N, N)
            h = self.core(glimpse.flatten(1), h)
            windows.append(window)
        return self.classify(h), windows

    def extra_repr(self) -> str:
        return f"steps={self.steps}, hidden_dim={self.hidden_dim}"
