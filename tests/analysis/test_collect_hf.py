"""The explain-away collector on a Hugging Face model converted by attnkit (tiny, offline)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnkit.analysis import collect_explain_away  # noqa: E402
from attnkit.hf import convert  # noqa: E402
from tests.hf._models import padded_batch, tiny_model  # noqa: E402


@pytest.mark.hf
def test_collector_sees_every_layer_of_a_converted_bert_and_ignores_padding():
    model = convert(tiny_model("bert"), "dnas")
    ids, mask = padded_batch(lengths=(7, 4, 5))
    with torch.no_grad(), collect_explain_away(model) as log:
        model(input_ids=ids, attention_mask=mask)
    assert [r.layer for r in log.records] == [0, 1] and {r.mechanism for r in log.records} == {"dnas"}
    for record in log.records:
        keys = record.stats.valid_keys  # (B, H, Lk)
        assert torch.equal(keys[:, 0], mask.bool())  # padded tokens are not counted as keys
        assert record.stats.min_normalized >= 1 - 1e-5  # Lemma 1 inside the converted model
