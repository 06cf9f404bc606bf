"""Explaining-away statistics on hand-built weight matrices, and the forward-pass collector."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.analysis import collect_explain_away, explain_away, log_sum_histogram
from attnkit.functional import _OBSERVERS


def _weights(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)[None, None]  # (1, 1, Lq, Lk)


def test_key_sums_min_and_fraction_on_hand_built_weights():
    w = _weights([[0.9, 0.1, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.9996, 0.0, 0.0004, 0.0]])
    stats = explain_away(w, eps=1e-3)
    assert torch.allclose(stats.key_sums[0, 0], torch.tensor([2.3996, 0.6, 0.0004, 0.0], dtype=torch.float64))
    assert stats.min == 0.0 and stats.min_normalized == 0.0
    assert stats.fraction_below_eps == pytest.approx(0.5)  # keys 2 and 3
    assert stats.log_sums[0, 0, 3] == -math.inf
    assert stats.log_sums[0, 0, 1].item() == pytest.approx(math.log(0.6))


def test_masks_exclude_padded_keys_and_queries():
    w = _weights([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 0.0]])
    key_mask = torch.tensor([[True, True, False]])
    query_mask = torch.tensor([[True, True, False]])
    stats = explain_away(w, key_mask=key_mask, query_mask=query_mask)
    assert stats.valid_keys.tolist() == [[[True, True, False]]]
    assert stats.min == pytest.approx(0.7)
    assert stats.min_normalized == pytest.approx(1.4)  # n_k = 2
    assert stats.fraction_below_eps == 0.0


def test_valid_pairs_from_attn_mask_leave_unreachable_keys_out():
    w = _weights([[0.6, 0.4, 0.0], [0.3, 0.7, 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, False]])[None, None]
    stats = explain_away(w, valid=valid)
    assert stats.valid_keys.tolist() == [[[True, True, False]]]
    assert stats.min == pytest.approx(0.9) and stats.min_normalized == pytest.approx(1.8)
    with pytest.raises(ValueError, match="valid"):
        explain_away(w, valid=valid.float())


def test_lemma1_lower_bound_on_dnas_weights():
    g = torch.Generator().manual_seed(0)
    s = 20 * torch.randn(3, 2, 7, 11, generator=g, dtype=torch.float64)
    key_mask = torch.arange(11)[None, :] < torch.tensor([[11], [6], [1]])
    dnas = explain_away(ak.normalize(s, "dnas", key_mask=key_mask), key_mask=key_mask)
    soft = explain_away(ak.normalize(s, "softmax", key_mask=key_mask), key_mask=key_mask)
    assert dnas.min_normalized >= 1 - 1e-12
    assert soft.min_normalized < 1e-3


def test_log_sum_histogram_counts_valid_keys_and_floors_zero_sums():
    w = _weights([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    stats = explain_away(w, key_mask=torch.tensor([[True, True, False]]))
    counts, edges = log_sum_histogram(stats, bins=5, range=(-60.0, 1.0), floor=-50.0)
    assert counts.sum() == 2  # the padded key is not counted
    assert counts[np.searchsorted(edges, -50.0, side="right") - 1] == 1  # sum 0 drawn at the floor
    with pytest.raises(ValueError, match="bins"):
        log_sum_histogram(stats, bins=0)


def test_bad_weights_raise():
    with pytest.raises(ValueError, match=r"\(B, H, Lq, Lk\)"):
        explain_away(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="key_mask"):
        explain_away(torch.zeros(1, 1, 2, 3), key_mask=torch.ones(1, 2, dtype=torch.bool))


class _TwoLayers(torch.nn.Module):
    """Two attention calls per forward: a softmax layer then a DNAS layer."""

    def forward(self, x, key_mask=None, attn_mask=None):
        h = ak.attention(x, x, x, "softmax", key_mask=key_mask, attn_mask=attn_mask)
        return ak.attention(h, h, h, "dnas", key_mask=key_mask, attn_mask=attn_mask)


def test_collector_records_every_layer_and_forward_pass():
    model = _TwoLayers()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    with collect_explain_away(model) as log:
        model(x, key_mask=key_mask)
        model(x, key_mask=key_mask)
    assert [(r.forward_pass, r.layer, r.mechanism) for r in log.records] == [
        (0, 0, "softmax"), (0, 1, "dnas"), (1, 0, "softmax"), (1, 1, "dnas")]
    assert not _OBSERVERS.get()  # the observer is removed on exit
    _, w = ak.attention(x, x, x, "softmax", key_mask=key_mask, return_weights=True)
    expected = explain_away(w, key_mask=key_mask)
    assert torch.allclose(log.records[0].stats.key_sums, expected.key_sums)
    assert log.by_layer(1)[0].min_normalized >= 1 - 1e-12  # Lemma 1 for the DNAS layer
    assert [row["layer"] for row in log.summary()] == [0, 1]
    with pytest.raises(ValueError, match="layer 5"):
        log.by_layer(5)


def test_log_is_indexable_like_a_list_and_summary_reads_per_layer():
    model = _TwoLayers()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    with collect_explain_away(model) as log:
        model(x)
        model(x)
    assert log[0] is log.records[0] and log[-1] is log.records[3]
    assert log[1:3] == log.records[1:3] and list(log) == log.records
    with pytest.raises(IndexError):
        log[4]
    rows = log.summary()
    assert [(r["layer"], r["mechanism"], r["calls"]) for r in rows] == [(0, "softmax", 2), (1, "dnas", 2)]
    assert rows[1]["min_normalized"] >= 1 - 1e-12  # Lemma 1: every key gets at least 1/n_k
    assert rows[0]["min_sum"] == min(r.stats.min for r in log if r.layer == 0)


def test_collector_uses_attn_mask_padding():
    model = _TwoLayers()
    x = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    attn_mask = torch.tensor([True, True, True, False])[
        None, None, None, :
    ]  # (1, 1, 1, Lk): HF-style padding
    with collect_explain_away() as log:
        model(x, attn_mask=attn_mask)
    for record in log.records:
        assert record.stats.valid_keys[0, 0].tolist() == [True, True, True, False]
    assert log.records[1].stats.min_normalized >= 1 - 1e-12  # the padded key does not count as explained away


def test_signed_coda_weights_give_no_nan():
    w = _weights([[0.5, -0.7], [0.1, -0.2]])  # CoDA's M is signed: key 1 sums to -0.9
    stats = explain_away(w)
    assert not torch.isnan(stats.log_sums).any()
    assert stats.log_sums[0, 0, 1] == -math.inf and stats.min == pytest.approx(-0.9)


def test_nan_rows_of_fully_masked_queries_do_not_reach_the_sums():
    """torch's softmax of a row with no valid key is NaN; the masks must keep it out (not multiply it)."""
    s = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    valid = torch.tensor([[True, True, False, False], [True, True, True, False], [False] * 4])[None, None]
    w = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)  # row 2 is NaN
    stats = explain_away(w, query_mask=torch.tensor([[True, True, False]]), valid=valid)
    expected = explain_away(w[:, :, :2], valid=valid[:, :, :2])
    assert stats.min == pytest.approx(expected.min) and not math.isnan(stats.min)
    torch.testing.assert_close(stats.key_sums, expected.key_sums)
    with pytest.raises(ValueError, match="non-finite values"):
        explain_away(w)  # unmasked, the NaN row counts


def test_keys_of_a_sequence_without_real_queries_and_padded_keys_do_not_count():
    """A batch row whose queries are all padding contributes no key (its sums would read 0: explained
    away); a padded key's sum reads 0 whatever weight it got; a sum of exactly eps is not below eps."""
    w = torch.tensor([[[0.999, 0.001, 0.0], [0.5, 0.25, 0.25]], [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]],
                     dtype=torch.float64)[:, None]  # (2, 1, 2, 3)
    query_mask = torch.tensor([[True, False], [False, False]])
    key_mask = torch.tensor([[True, True, False], [True, True, True]])
    stats = explain_away(w, key_mask=key_mask, query_mask=query_mask, eps=0.001)
    assert stats.valid_keys.tolist() == [[[True, True, False]], [[False, False, False]]]
    assert stats.key_sums[:, 0].tolist() == [[0.999, 0.001, 0.0], [0.0, 0.0, 0.0]]
    assert stats.min == 0.001 and stats.min_normalized == 0.002 and stats.fraction_below_eps == 0.0
    padded_key = explain_away(w[:1], key_mask=key_mask[:1])  # row 1 gives the padded key 0.25
    assert padded_key.key_sums[0, 0, 2] == 0.0 and padded_key.log_sums[0, 0, 2] == -math.inf


def test_no_query_means_no_key_counts():
    stats = explain_away(torch.zeros(2, 1, 0, 3))
    assert not stats.valid_keys.any() and math.isnan(stats.min) and stats.fraction_below_eps == 0.0


def test_bad_eps_and_integer_weights_raise():
    w = _weights([[1.0, 0.0]])
    for eps in (True, float("inf"), float("nan"), 0):
        with pytest.raises(ValueError, match="eps="):
            explain_away(w, eps=eps)
    assert explain_away(w, eps=np.float32(0.5)).fraction_below_eps == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dtype torch.int64; expected floating"):
        explain_away(torch.ones(1, 1, 2, 2, dtype=torch.long))


def test_log_minimum_ignores_calls_without_valid_keys_whatever_the_order():
    model = _TwoLayers()
    x = torch.randn(2, 1, 4, 3, dtype=torch.float64)
    all_padding = torch.zeros(2, 4, dtype=torch.bool)
    with collect_explain_away(model) as log:
        model(x, key_mask=all_padding)  # no valid key: NaN minima
        model(x)
    with collect_explain_away(model) as reversed_log:
        model(x)
        model(x, key_mask=all_padding)
    for each in (log, reversed_log):
        assert each.min() == min(r.stats.min for r in each if r.stats.valid_keys.any())
        assert not math.isnan(each.min_normalized())
        rows = each.summary()
        assert [r["calls"] for r in rows] == [2, 2]
        assert rows[0]["fraction_below_eps"] == pytest.approx(
            next(r.stats.fraction_below_eps for r in each if r.layer == 0 and r.stats.valid_keys.any())
        )
    assert log.summary()[0]["min_sum"] == reversed_log.summary()[0]["min_sum"]


def test_a_key_only_padded_queries_may_attend_is_left_out_with_valid_and_query_mask():
    """Key 2 is reachable only from query 2, a padded query: it was counted as a valid key with sum 0, so
    DNAS read as violating Lemma 1 (min_normalized 0, half the keys below eps)."""
    scores = torch.randn(1, 1, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    query_mask = torch.tensor([[True, True, False]])
    valid = torch.tensor([[True, True, False], [True, True, False], [False, False, True]])[None, None]
    weights = ak.normalize(scores, "dnas", query_mask=query_mask, attn_mask=valid)
    stats = explain_away(weights, query_mask=query_mask, valid=valid)
    assert stats.valid_keys[0, 0].tolist() == [True, True, False]
    assert stats.min_normalized >= 1 - 1e-12 and stats.fraction_below_eps == 0.0
    sums = weights[0, 0, :2, :2].sum(0)  # keys 0 and 1 over the real queries
    assert stats.min == pytest.approx(sums.min().item())
    assert stats.min_normalized == pytest.approx(2 * sums.min().item())


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_collected_key_sums_of_padded_self_attention_equal_the_sequence_alone(mechanism):
    """Softmax modules keep padded query rows (as torch's), and their weights entered the observed column
    sums: key sums 1.26-2.34 padded against 0.70-1.59 alone, min n_k * sum 5.07 against 3.50."""
    torch.manual_seed(0)
    module = ak.nn.MultiheadAttention(8, 2, mechanism=mechanism, batch_first=True, dtype=torch.float64).eval()
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    pad = torch.tensor([[False] * 5 + [True] * 3])
    with torch.no_grad(), collect_explain_away(module) as log:
        module(x, x, x, key_padding_mask=pad)
        module(x[:, :5], x[:, :5], x[:, :5])
    padded, alone = log.records[0].stats, log.records[1].stats
    torch.testing.assert_close(padded.key_sums[..., :5], alone.key_sums)
    assert padded.min_normalized == pytest.approx(alone.min_normalized)


def test_observed_weights_are_the_mechanisms_before_attention_dropout():
    """A module in training mode was observed after dropout: DNAS reported min n_k * sum 6e-10, an apparent
    violation of Lemma 1."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    with collect_explain_away() as log:
        ak.attention(x, x, x, "dnas", dropout_p=0.5)
    _, w = ak.attention(x, x, x, "dnas", return_weights=True)
    torch.testing.assert_close(log.records[0].stats.key_sums, explain_away(w).key_sums)
    assert log.records[0].stats.min_normalized >= 1 - 1e-12


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_an_observed_module_computes_what_an_unobserved_one_does(mechanism):
    """Softmax modules passed their query padding while observed: padded rows output zeros and need_weights
    returned zero rows where torch's module (and the unobserved call) gives their attention."""
    from attnkit.functional import observe_weights

    torch.manual_seed(0)
    module = ak.nn.MultiheadAttention(8, 2, mechanism=mechanism, batch_first=True, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    seen = []
    with torch.no_grad():
        out, weights = module(x, x, x, key_padding_mask=pad)
        with observe_weights(lambda w, mask, config: seen.append((w, mask))):
            observed_out, observed_weights = module(x, x, x, key_padding_mask=pad)
    torch.testing.assert_close(observed_out, out)
    torch.testing.assert_close(observed_weights, weights)
    w, mask = seen[0]  # the observer still sees the padded queries left out
    assert torch.equal(mask.query_mask, ~pad) and (w[1, :, 3:] == 0).all()


def test_an_observer_sees_its_own_threads_calls_not_another_threads():
    """The observers were one process-wide list: a diagnostics block open in one thread recorded (and moved
    to the reference route) the calls a serving thread made meanwhile (9 of 10 records)."""
    import threading

    from attnkit.functional import explain_dispatch, observe_weights

    x = torch.randn(1, 2, 4, 8)
    inside, done = threading.Event(), threading.Event()
    routes = []

    def serve():
        inside.wait(10)
        for _ in range(3):
            ak.attention(x, x, x, "dnas")
        routes.append(explain_dispatch(x, x, x, "dnas").route)
        done.set()

    seen = []
    thread = threading.Thread(target=serve)
    thread.start()
    with observe_weights(lambda w, mask, config: seen.append(config.name)):
        ak.attention(x, x, x, "softmax")
        inside.set()
        assert done.wait(10)
    thread.join()
    assert seen == ["softmax"] and routes != ["reference"] and not _OBSERVERS.get()


def test_observe_blocks_closed_out_of_order_or_from_another_thread_stay_closed():
    """Two blocks in generators closed out of order brought the first one back for good (a reset restores a
    snapshot); a generator's block closed from another thread raised a ValueError and left its thread
    observing."""
    import threading

    from attnkit.functional import observe_weights, observing

    x = torch.randn(1, 1, 4, 8)
    seen = {"a": 0, "b": 0}

    def block(name):
        with observe_weights(lambda w, mask, config: seen.__setitem__(name, seen[name] + 1)):
            yield
            yield

    a, b = block("a"), block("b")
    next(a), next(b)
    a.close()  # the first one opened closes first
    ak.attention(x, x, x)
    assert seen == {"a": 0, "b": 1} and observing()
    b.close()
    ak.attention(x, x, x)
    assert seen == {"a": 0, "b": 1} and not observing() and not _OBSERVERS.get()
    c = block("a")
    next(c)
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join()
    assert not observing()
    ak.attention(x, x, x)
    assert seen == {"a": 0, "b": 1}


@pytest.mark.parametrize("shape", [(3, 3), (1, 3), (3,), (2, 1, 3, 3), (1, 3, 1)])
def test_a_valid_mask_that_broadcasts_equals_the_full_mask(shape):
    """valid's message said "broadcastable" but a 2-D (Lq, Lk) mask was refused."""
    weights = torch.rand(2, 1, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    valid = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.7
    stats = explain_away(weights, valid=valid)
    full = explain_away(weights, valid=valid.expand(2, 1, 3, 3).clone())
    assert torch.equal(stats.key_sums, full.key_sums) and torch.equal(stats.valid_keys, full.valid_keys)


@pytest.mark.parametrize("shape", [(2, 3), (3, 3, 3, 3), (1, 1, 1, 3, 3)])
def test_a_valid_mask_that_does_not_broadcast_is_refused(shape):
    with pytest.raises(ValueError, match="broadcastable"):
        explain_away(torch.rand(2, 1, 3, 3), valid=torch.ones(shape, dtype=torch.bool))


def test_log_sum_histogram_takes_numpy_bins_and_refuses_a_nan_floor():
    stats = explain_away(_weights([[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]]))
    counts, edges = log_sum_histogram(stats, bins=np.int64(5))
    assert counts.sum() == 3 and len(edges) == 6
    for floor in (math.nan, math.inf, True):
        with pytest.raises(ValueError, match=f"floor={floor!r}"):
            log_sum_histogram(stats, floor=floor)
    with pytest.raises(ValueError, match="bins=True"):
        log_sum_histogram(stats, bins=True)


def test_log_sum_histogram_puts_only_sums_of_zero_at_floor():
    # a key with sum 1e-30 (log -69.1) was binned at floor = -50 with the sums of exactly 0
    w = _weights([[0.5, 0.5, 1e-30, 0.0], [0.5, 0.5, 0.0, 0.0]])
    stats = explain_away(w)
    counts, edges = log_sum_histogram(stats, bins=4, range=(-100.0, 0.0))
    assert edges.tolist() == [-100.0, -75.0, -50.0, -25.0, 0.0]
    assert counts.tolist() == [0, 1, 1, 2]  # log 1e-30 in [-75, -50); the sum of 0 at floor; keys 0, 1: log 1
    counts, edges = log_sum_histogram(stats, bins=2)
    assert edges[0] == pytest.approx(math.log(1e-30)) and counts.sum() == 4


def test_a_decoders_cross_attention_record_leaves_the_padded_target_queries_out():
    """The target padding of ak.nn.Transformer's decoder reached its self-attention records only: all 8 target
    rows entered each memory key's sum in the cross-attention record (min 1.21 instead of 0.55 and
    min_normalized 6.06 instead of 1.66 on this input), overstating how well keys are attended."""
    from attnkit.functional import observe_weights

    torch.manual_seed(0)
    d, H = 16, 2
    model = ak.nn.Transformer(d, H, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                              dropout=0.0, batch_first=True).double().eval()
    src, tgt = torch.randn(2, 5, d, dtype=torch.float64), torch.randn(2, 8, d, dtype=torch.float64)
    src_pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    tgt_pad = torch.tensor([[False] * 8, [False] * 2 + [True] * 6])
    masks = dict(src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    with torch.no_grad():
        plain = model(src, tgt, **masks)
        seen = []
        with observe_weights(lambda w, mask, config: seen.append(w.clone())):
            model(src, tgt, **masks)
        with collect_explain_away(model) as log:
            observed = model(src, tgt, **masks)
    torch.testing.assert_close(observed, plain, rtol=1e-12, atol=1e-12)  # observing changes no output (route)
    cross = seen[2]  # (B, H, Lt, Ls): encoder self, decoder self, decoder cross
    assert cross[1, :, 2:].abs().max() == 0  # the padded target rows are left out of what observers see
    hand = explain_away(cross, key_mask=~src_pad, query_mask=~tgt_pad)
    assert log[2].stats.min == pytest.approx(hand.min, rel=1e-12)
    assert log[2].stats.min_normalized == pytest.approx(hand.min_normalized, rel=1e-12)
    assert log[2].stats.min == pytest.approx(0.5530, abs=1e-4)


def test_summary_averages_each_layers_share_below_eps_over_its_calls():
    """summary()'s fraction_below_eps is the mean over a layer's calls; its largest (or first) passed every
    test, which only ever ran one call per layer."""
    torch.manual_seed(0)
    module = ak.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    sharp, flat = torch.randn(1, 12, 8) * 6.0, torch.randn(1, 12, 8) * 0.05
    with torch.no_grad(), collect_explain_away(module, eps=0.3) as log:
        module(sharp, sharp, sharp)
        module(flat, flat, flat)
        module(sharp, sharp, sharp)
    shares = [r.stats.fraction_below_eps for r in log.records]
    assert len(set(shares)) == 2 and shares[0] == shares[2]  # two calls alike, one not
    (row,) = log.summary()
    assert row["calls"] == 3
    assert row["fraction_below_eps"] == pytest.approx(sum(shares) / 3, rel=1e-12)
    assert row["min_sum"] == min(r.stats.min for r in log.records)


def test_min_normalized_counts_each_examples_own_keys_and_sums_bfloat16_in_float64():
    """n_k is each example's (and head's) count of valid keys: counted over the whole batch it read 5.744
    for 3.627 here; and the key sums of bfloat16 weights are taken in float64 (bfloat16 sums of 256 weights
    moved min_normalized from 224.27 to 224.0). Neither change was caught."""
    from attnkit.functional import normalize

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 8, 4, generator=g), torch.randn(2, 1, 8, 4, generator=g)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 4:] = False  # example 0: 4 real keys, example 1: 8
    w = normalize(q @ k.transpose(-1, -2) / 2, "dnas", key_mask=mask, query_mask=mask)
    stats = explain_away(w, key_mask=mask, query_mask=mask)
    hand = min(float(w[b, 0][mask[b]][:, mask[b]].sum(0).min()) * int(mask[b].sum()) for b in range(2))
    assert stats.min_normalized == pytest.approx(hand, rel=1e-6) and stats.min_normalized >= 1 - 1e-6
    q, k = torch.randn(1, 1, 256, 16, generator=g), torch.randn(1, 1, 256, 16, generator=g)
    w = normalize(q @ k.transpose(-1, -2) / 4, "dnas").to(torch.bfloat16)
    assert explain_away(w).min_normalized == explain_away(w.double()).min_normalized
