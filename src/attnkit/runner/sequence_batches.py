"""What the runner's two source -> target task kinds share: padded ids, batches cut to their longest row.

``Seq2SeqTask`` (the Transformer encoder-decoder, ``runner/tasks.py``) and ``TransductionTask`` (the
recurrent models and CTC, ``runner/transduction.py``) keep ``{train,test}_{src,tgt}`` id tensors ``(N, L)``
with boolean masks ``{train,test}_{src,tgt}_mask`` (True = real token; targets start with ``<bos>``).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["trim_padding", "SourceTargetBatches"]


def trim_padding(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the padding columns that no row of the batch uses (keeps at least one column)."""
    length = max(1, int(mask.sum(dim=1).max()))
    return ids[:, :length], mask[:, :length]


class SourceTargetBatches:
    """Sizes, token counts and trimmed batches of a task whose data holds source and target id tensors."""

    def num_train(self, data) -> int:
        return len(data.train_src)

    def num_eval(self, data) -> int:
        return len(data.test_src)

    def count(self, data, idx: Tensor) -> int:
        return int(data.train_tgt_mask[idx, 1:].sum())  # predicted target tokens, <eos> included

    def _batch(self, split: str, data, idx: Tensor, device):
        """``(src, src_mask, tgt, tgt_mask)`` of rows ``idx`` of ``split``, trimmed and on ``device``."""
        src, src_mask = trim_padding(
            getattr(data, f"{split}_src")[idx], getattr(data, f"{split}_src_mask")[idx]
        )  # (b, Ls)
        tgt, tgt_mask = trim_padding(
            getattr(data, f"{split}_tgt")[idx], getattr(data, f"{split}_tgt_mask")[idx]
        )  # (b, Lt)
        return src.to(device), src_mask.to(device), tgt.to(device), tgt_mask.to(device)
