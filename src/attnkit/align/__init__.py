"""Alignment attention as a plug-in regularizer (extra ``[align]``).

"Alignment Attention by Matching Key and Query Distributions" (Zhang et al., NeurIPS 2021, arXiv:2110.12567):
match the distributions of the queries and keys of every self-attention head, per sample, with an adversarial
discriminator (``gan``), entropic optimal transport (``ot``), bidirectional conditional transport (``ct``) or
the kernel MMD (``mmd``). See ``docs/alignment.md``.

    from attnkit.align import AlignmentRegularizer, mmd
    reg = AlignmentRegularizer(model, method="ct", weight=0.01)
    out = model(**batch)
    loss = task_loss + reg.loss()
"""

from ._common import Highway, grad_reverse
from .capture import Captured, find_sites
from .ct import Critic, Navigator, ct_loss
from .gan import Discriminator, gan_loss
from .mmd import mmd
from .ot import ot_loss
from .regularizer import METHODS, AlignConfig, AlignmentRegularizer

__all__ = [
    "AlignmentRegularizer",
    "AlignConfig",
    "METHODS",
    "mmd",
    "gan_loss",
    "ot_loss",
    "ct_loss",
    "Discriminator",
    "Critic",
    "Navigator",
    "Highway",
    "grad_reverse",
    "Captured",
    "find_sites",
]
