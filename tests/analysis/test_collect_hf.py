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


@pytest.mark.hf
def test_softmax_key_sums_of_a_padded_sequence_equal_the_sequence_alone():
    """The padded query rows of a softmax-converted model entered the observed column sums (about 1.6 per
    key padded against 1.0 alone)."""
    model = convert(tiny_model("bert"), "softmax").eval()
    ids, mask = padded_batch(lengths=(7, 4))
    with torch.no_grad(), collect_explain_away(model) as log:
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[1:, :4], attention_mask=mask[1:, :4])
    padded, alone = log.by_layer(0)
    torch.testing.assert_close(padded.key_sums[1:, :, :4], alone.key_sums, rtol=1e-5, atol=1e-6)
