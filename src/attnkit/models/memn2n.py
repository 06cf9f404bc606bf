r"""End-to-end memory network: several hops of soft attention over a memory of sentences.

"End-To-End Memory Networks" (Sukhbaatar, Szlam, Weston and Fergus, NIPS 2015, arXiv:1503.08895),
section 2 (eqs. 1-3), 2.2 (adjacent weight tying) and 4.1 (position and temporal encoding).

.. math::
    m_i = \sum_j l_j \odot A x_{ij} + T_A(i), \qquad c_i = \sum_j l_j \odot C x_{ij} + T_C(i) \\
    p_i = \text{softmax}_i(u^T m_i) \quad (1), \qquad o = \sum_i p_i c_i \quad (2), \qquad
    u^{k+1} = u^k + o^k \quad (\text{sec. } 2.2) \\
    \hat a = \text{softmax}(W (o^K + u^K)) \quad (3), \qquad
    l_{kj} = (1 - j/J) - (k/d)(1 - 2j/J) \quad (\text{position encoding, sec. } 4.1)

Adjacent tying: ``A^{k+1} = C^k``, ``B = A^1``, ``W^T = C^K`` (K + 1 embedding matrices for K hops).
Temporal encoding indexes sentences from the most recent real one (``i = 0`` is the last real sentence,
wherever the padded slots are).

Masks: ``story_mask (B, M)`` True = real sentence; padded slots get attention exactly 0 (eq. 1 over real
slots only); padded words (id 0) have a zero embedding. Shapes: ``stories (B, M, S)`` word ids, ``questions
(B, S)`` -> ``logits (B, V)``, ``attention (B, K, M)`` (one row per hop).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..validators import check_bool
from .building_blocks import check_positive_int, check_token_ids, describe

__all__ = ["MemN2N", "position_encoding_matrix"]


def position_encoding_matrix(
    sentence_len: int, dim: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> Tensor:
    """``l (S, d)`` with ``l_kj = (1 - j/J) - (k/d)(1 - 2j/J)``, 1-based ``j`` (word), ``k`` (dim); computed
    in float64 and rounded once to ``dtype``. ``J`` is ``sentence_len``, the padded length every sentence
    is stored in (as common implementations do), not the paper's number of words of each sentence: a word's
    encoding depends on the model's ``sentence_len``."""
    sentence_len, dim = check_positive_int("sentence_len", sentence_len), check_positive_int("dim", dim)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}; expected a floating dtype (an integer one rounds all to 0)")
    J, d = sentence_len, dim
    j = torch.arange(1, J + 1, dtype=torch.float64, device=device)[:, None]  # (S, 1)
    k = torch.arange(1, d + 1, dtype=torch.float64, device=device)[None, :]  # (1, d)
    return ((1 - j / J) - (k / d) * (1 - 2 * j / J)).to(dtype)  # (S, d)


class MemN2N(nn.Module):
    """Memory network: ``hops`` hops, ``position_encoding`` (else bag of words), ``temporal_encoding``."""

    def __init__(
        self,
        vocab_size: int,
        dim: int = 32,
        hops: int = 3,
        memory_size: int = 20,
        sentence_len: int = 8,
        position_encoding: bool = True,
        temporal_encoding: bool = True,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        vocab_size, dim, hops, memory_size, sentence_len = (
            check_positive_int(name, value)
            for name, value in (
                ("vocab_size", vocab_size),
                ("dim", dim),
                ("hops", hops),
                ("memory_size", memory_size),
                ("sentence_len", sentence_len),
            )
        )
        check_bool(position_encoding, f"position_encoding={position_encoding!r}")
        check_bool(temporal_encoding, f"temporal_encoding={temporal_encoding!r}")
        self.vocab_size = vocab_size
        self.hops, self.memory_size, self.sentence_len = hops, memory_size, sentence_len
        self.use_position, self.use_temporal = position_encoding, temporal_encoding
        self.embed = nn.ModuleList(nn.Embedding(vocab_size, dim, padding_idx=0) for _ in range(hops + 1))
        self.temporal = nn.ParameterList(nn.Parameter(torch.empty(memory_size, dim)) for _ in range(hops + 1))
        self.reset_parameters()

    @property
    def pe(self) -> Tensor:
        """``l (S, d)`` (ones without position encoding) in the dtype and on the device of the embeddings,
        built when read: a ``.double()`` model gets the float64 values, not float32 ones cast up."""
        w = self.embed[0].weight  # (V, d)
        if not self.use_position:
            return torch.ones(self.sentence_len, w.shape[1], dtype=w.dtype, device=w.device)
        return position_encoding_matrix(self.sentence_len, w.shape[1], dtype=w.dtype, device=w.device)

    def reset_parameters(self) -> None:
        for emb, t in zip(self.embed, self.temporal):
            nn.init.normal_(emb.weight, std=0.1)
            with torch.no_grad():
                emb.weight[0].zero_()
            nn.init.normal_(t, std=0.1)

    def _encode(self, k: int, ids: Tensor) -> Tensor:
        """Sentence vectors ``sum_j l_j * E_k x_j``: ids ``(..., S)`` -> ``(..., d)``."""
        return (self.embed[k](ids) * self.pe).sum(-2)  # (..., S, d) -> (..., d)

    def forward(self, stories: Tensor, questions: Tensor, story_mask: Tensor) -> tuple[Tensor, Tensor]:
        for name, ids, shape in (("stories", stories, "(B, M, S)"), ("questions", questions, "(B, S)")):
            if not isinstance(ids, Tensor) or ids.dim() != len(shape.split(",")) or ids.dtype != torch.long:
                raise ValueError(f"{name} is {describe(ids)}; expected a LongTensor {shape} of word ids")
        B, M, S = stories.shape
        if S != self.sentence_len or M > self.memory_size:
            raise ValueError(
                f"stories have shape {tuple(stories.shape)}; "
                f"expected (B, M <= {self.memory_size}, {self.sentence_len})"
            )
        mask_ok = (
            isinstance(story_mask, Tensor) and story_mask.shape == (B, M) and story_mask.dtype == torch.bool
        )
        if questions.shape != (B, S) or not mask_ok:
            raise ValueError(
                f"questions {tuple(questions.shape)}, story_mask {describe(story_mask)}; "
                f"expected ({B}, {S}) and bool ({B}, {M})"
            )
        words = torch.cat([stories.flatten(), questions.flatten()])  # one fused range check, one host sync
        check_token_ids(words, 1, self.vocab_size, "a story or question", "")
        # temporal index: 0 for the most recent real sentence, i.e. the number of real sentences after slot i
        after = story_mask.flip(-1).long().cumsum(-1).flip(-1) - story_mask.long()  # (B, M)
        age = after.clamp(0, self.memory_size - 1)  # (B, M)
        u = self._encode(0, questions)  # (B, d)
        attention = []
        for k in range(self.hops):
            m = self._encode(k, stories) + (self.temporal[k][age] if self.use_temporal else 0)  # (B, M, d)
            c = self._encode(k + 1, stories) + (
                self.temporal[k + 1][age] if self.use_temporal else 0
            )  # (B, M, d)
            scores = torch.einsum("bmd,bd->bm", m, u).masked_fill(~story_mask, float("-inf"))  # (B, M)
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty story attends to nothing
            attention.append(p)
            u = u + torch.einsum("bm,bmd->bd", p, c)  # (B, d)
        logits = u @ self.embed[self.hops].weight.T  # W^T = C^K: (B, V)
        return logits, torch.stack(attention, dim=1)  # (B, V), (B, K, M)

    def extra_repr(self) -> str:
        return (
            f"hops={self.hops}, memory_size={self.memory_size}, position_encoding={self.use_position}, "
            f"temporal_encoding={self.use_temporal}"
        )
