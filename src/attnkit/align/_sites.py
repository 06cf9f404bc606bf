"""The parts every capture shares: what one attention call yields (``Captured``), a layer that can be
hooked (``Site``), and the state of the model's forward pass the hooks read (``ForwardState``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor, nn


@dataclass
class Captured:
    """Queries and keys of one attention call: ``q (B, H, Lq, d)``, ``k (B, H, Lk, d)``, masks True = real."""

    q: Tensor
    k: Tensor
    q_mask: Tensor
    k_mask: Tensor


Record = Callable[[Captured], None]


class Site:
    """One self-attention layer of a model: its name, heads and head dim, and how to hook it."""

    kind = "site"

    def __init__(self, name: str, module: nn.Module, num_heads: int, head_dim: int) -> None:
        self.name, self.module, self.num_heads, self.head_dim = name, module, num_heads, head_dim
        # chosen by name (layers=): a call it cannot capture raises, instead of being left out with a warning
        self.strict = True

    def attach(self, record: Record, context: ForwardState) -> list:  # returns hook handles
        raise NotImplementedError

    def leave_out(self, context: ForwardState, why: str, error: type = ValueError) -> None:
        """A call this layer cannot capture: an ``error(why)`` when chosen by name (``layers=``), else left
        out of this forward with a warning (once)."""
        if self.strict:
            raise error(why)
        context.skip(self.name, why)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, heads={self.num_heads}, head_dim={self.head_dim})"


class _PositionsMismatch(ValueError):
    """A layer's positions are not those of the model's ``attention_mask``."""


class ForwardState:
    """Whether the model the regularizer is attached to is running its forward pass, and how.

    Captures count only inside that forward: a submodule called on its own would pile its calls onto the last
    forward's (and, for Hugging Face models, miss the ``attention_mask`` given to the model), and gradient
    checkpointing recomputes the layers during ``backward()``, which would capture every layer a second time.
    ``grad_enabled`` is the autograd mode at the start of the forward: a layer that runs with gradients off
    inside a forward that started with them on (reentrant gradient checkpointing) gives queries and keys that
    no loss can train.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.grad_enabled = False
        self.attention_mask: Optional[Tensor] = None
        # Hugging Face: sequence index per position (B or 1, L) of a packed batch (position_ids restarting in
        # a row, no attention_mask), else None
        self.segments: Optional[Tensor] = None
        self.graph_batch: Optional[Tensor] = None  # PyG's batch vector (N,) given to the model, if any
        self.cached = False  # a step of cached decoding: the earlier positions' keys are in the cache
        self.last_cached = False  # whether the last forward that started was such a step (kept after it)
        self.skipped: dict[str, str] = {}  # layers left out of this forward's capture, and why
        # Hugging Face: the modules on the way to a site that received attention_mask itself (id -> name),
        # and the captures of sites outside them made before any had (decided at the end of the forward)
        self.mask_receivers: dict[int, str] = {}
        # Hugging Face: the cross-attention inside the model that ran in this forward (Perceiver's, from the
        # inputs to its latents); the layers after it run on its queries' positions, not the mask's: all real
        self.resampled: Optional[str] = None
        self.attended = False  # whether a self-attention module (chosen or not) ran yet in this forward
        self.forwards = 0  # forward passes started (the captures' absence then means the layers were not run)
        # whether the last forward was a training one (gradients on): only its subsample of tokens
        # (max_tokens) draws from the stream that training and resuming follow
        self.training_forward = True
        self.tentative: list[tuple[Site, Captured]] = []
        self._warned: set[str] = set()

    def skip(self, site: str, why: str) -> None:
        """Leave ``site`` out of this forward's capture; warn the first time."""
        self.skipped.setdefault(site, why)
        if site not in self._warned:
            self._warned.add(site)
            warnings.warn(f"{why}. This layer is left out of the alignment loss.", stacklevel=2)

    @property
    def active(self) -> bool:
        return self.depth > 0
