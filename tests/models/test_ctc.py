"""CTC: best-path and prefix beam decoding of hand-built posteriors, the loss, infeasible targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnkit.models import CTCModel
from attnkit.models.ctc import ctc_frames_needed, ctc_greedy_decode, ctc_prefix_beam_search

# vocabulary of the hand-built posteriors: 0 = blank, 1 = "c", 2 = "a", 3 = "t"
NAMES = {1: "c", 2: "a", 3: "t"}


def _one_hot_path(path: list[int], V: int = 4, p: float = 0.9) -> torch.Tensor:
    probs = torch.full((len(path), V), (1 - p) / (V - 1))
    probs[torch.arange(len(path)), torch.tensor(path)] = p
    return probs.log()  # (T, V)


def test_greedy_decoding_collapses_repeats_and_drops_blanks():
    log_probs = _one_hot_path([1, 1, 0, 2, 2, 0, 0, 3, 3, 0, 3])  # c c _ a a _ _ t t _ t
    labels = ctc_greedy_decode(log_probs[None])[0]
    assert "".join(NAMES[i] for i in labels) == "catt"


def test_greedy_decoding_respects_frame_lengths():
    log_probs = _one_hot_path([1, 2, 3, 3])[None].repeat(2, 1, 1)
    assert ctc_greedy_decode(log_probs, torch.tensor([4, 2])) == [[1, 2, 3], [1, 2]]


def test_prefix_beam_search_finds_the_most_probable_labelling():
    # Two frames over {blank, a}: best path is "_ _" (0.36) but p("a") = 0.4*0.6 + 0.6*0.4 + 0.4*0.4 = 0.64.
    probs = torch.tensor([[0.6, 0.4], [0.6, 0.4]])
    assert ctc_greedy_decode(probs.log()[None])[0] == []
    assert ctc_prefix_beam_search(probs.log(), beam_width=4) == [1]


def test_prefix_beam_search_matches_greedy_on_a_peaked_posterior():
    log_probs = _one_hot_path([1, 0, 2, 2, 3, 0, 3], p=0.97)
    assert ctc_prefix_beam_search(log_probs, beam_width=3) == [1, 2, 3, 3]


@pytest.mark.parametrize("blank_id", [0, 2])
@pytest.mark.parametrize("seed", range(40))
def test_prefix_beam_probabilities_sum_over_alignments(seed, blank_id):
    """Exhaustive check on random posteriors (40 of them; one passed a beam that let a repeated label follow
    its copy without a blank): with a beam wider than the labellings the answer is the arg-max over all
    labellings of the summed probabilities of their alignments; with the blank first or last (a beam
    search reading blank 0 whatever ``blank_id`` passed with the blank first only)."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    T, V = 5, 3
    log_probs = torch.log_softmax(2 * torch.randn(T, V, generator=g, dtype=torch.float64), dim=-1)
    totals: dict[tuple, float] = {}
    for path in itertools.product(range(V), repeat=T):
        labels, prev = [], None
        for t in path:
            if t != prev and t != blank_id:
                labels.append(t)
            prev = t
        totals[tuple(labels)] = totals.get(tuple(labels), 0.0) + math.exp(
            sum(float(log_probs[i, t]) for i, t in enumerate(path))
        )
    ranked = sorted(totals.values(), reverse=True)
    if ranked[0] - ranked[1] < 1e-9:  # a tie: either labelling is right
        pytest.skip("two labellings tie")
    best = max(totals, key=totals.get)
    assert tuple(ctc_prefix_beam_search(log_probs, beam_width=500, blank_id=blank_id)) == best


def test_greedy_decoding_drops_the_blank_it_is_given():
    """Best-path decoding reading blank 0 whatever ``blank_id`` passed every test: with the blank last
    (id 3), the path c t t a t decodes "ca", not "ctat"."""
    log_probs = _one_hot_path([1, 3, 3, 2, 3], p=0.97)
    assert ctc_greedy_decode(log_probs[None], blank_id=3) == [[1, 2]]
    assert ctc_greedy_decode(log_probs[None], blank_id=0) == [[1, 3, 2, 3]]
    assert ctc_prefix_beam_search(log_probs, beam_width=8, blank_id=3) == [1, 2]


def test_loss_matches_torch_and_refuses_infeasible_targets():
    torch.manual_seed(0)
    model = CTCModel(6, 5, embed_dim=4, hidden_dim=8, num_layers=1, upsample=1)
    src = torch.tensor([[1, 2, 3], [4, 5, 0]])
    targets = torch.tensor([[1, 2], [3, 0]])
    loss = model.loss(src, None, targets, torch.tensor([2, 1]))
    log_probs, frames = model(src)
    expected = (
        torch.nn.functional.ctc_loss(
            log_probs.transpose(0, 1), targets, frames, torch.tensor([2, 1]), reduction="sum"
        )
        / 2
    )
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="raise upsample"):
        model.loss(
            src, None, torch.tensor([[1, 1, 2], [3, 0, 0]]), torch.tensor([3, 1])
        )  # needs 4 frames, has 3


def _loss_inputs():
    torch.manual_seed(0)
    model = CTCModel(5, 4, embed_dim=4, hidden_dim=4, num_layers=1, upsample=2)
    logits = torch.randn(2, 6, 4)
    return model, logits, torch.tensor([6, 6]), torch.tensor([[1, 2, 3], [1, 1, 0]]), torch.tensor([3, 2])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda lp, fr: (lp[..., :3].log_softmax(-1), fr), r"expected a \(B, T, V\) tensor with V = "
         r"tgt_vocab_size = 4"),  # label 3 read past the class axis: a finite loss out of other memory
        (lambda lp, fr: (lp.exp(), fr), r"log_probs holds 0\.\d+ > 0, which is no log-probability"),
        (lambda lp, fr: (lp + 5, fr), r"holds \d\.\d+ > 0"),  # raw logits
        (lambda lp, fr: (lp, torch.tensor([8, 6])), r"frames holds \[8, 6\]; each is a frame count in "
         r"\[0, T=6\]"),
        (lambda lp, fr: (lp, torch.tensor([-1, 6])), r"frames holds \[-1, 6\]"),
        (lambda lp, fr: (lp, fr.float()), r"frames is .*; expected an integer tensor \(B,\) = \(2,\)"),
        (lambda lp, fr: (lp, torch.tensor([6, 6, 6])), r"frames is .*; expected an integer tensor"),
        (lambda lp, fr: (lp.long(), fr), r"expected floating log-probabilities"),
        (lambda lp, fr: (lp[0], fr), r"expected a \(B, T, V\) tensor"),
    ],
)
def test_loss_from_log_probs_refuses_outputs_that_are_not_the_models(edit, message):
    """Probabilities gave a "loss" of -5.58, log-probabilities over 3 classes for a 4-class model read past
    the class axis (3.92, then 9.26 for the same values as a strided view), and frame counts past T, float
    or of the wrong size surfaced as torch's RuntimeErrors."""
    model, logits, frames, targets, lengths = _loss_inputs()
    log_probs, frames = edit(logits.log_softmax(-1), frames)
    with pytest.raises(ValueError, match=message):
        model.loss_from_log_probs(log_probs, frames, targets, lengths)


def test_a_diverged_models_nan_log_probs_give_a_nan_loss_for_the_training_loop_to_report():
    """The new input checks refused NaN with "log_probs contains NaN; check the model's outputs", which
    came before the runner's "the training loss became nan at step 3; lower lr" and lost the step and the
    advice."""
    model, logits, frames, targets, lengths = _loss_inputs()
    log_probs = logits.log_softmax(-1)
    log_probs[0, 2] = float("nan")
    assert torch.isnan(model.loss_from_log_probs(log_probs, frames, targets, lengths))


def test_loss_from_log_probs_takes_half_precision_as_float32():
    """float16 log-probabilities raised torch's NotImplementedError (no CPU kernel)."""
    model, logits, frames, targets, lengths = _loss_inputs()
    log_probs = logits.log_softmax(-1)
    for dtype in (torch.float16, torch.bfloat16):
        half = model.loss_from_log_probs(log_probs.to(dtype), frames, targets, lengths)
        full = model.loss_from_log_probs(log_probs.to(dtype).float(), frames, targets, lengths)
        assert half.dtype == torch.float32 and torch.equal(half, full)


def test_frames_needed_counts_blanks_between_repeats():
    assert ctc_frames_needed([1, 1, 2, 2, 2, 3]) == 9
    assert ctc_frames_needed([]) == 0


def _ctc_model() -> CTCModel:
    torch.manual_seed(0)
    return CTCModel(12, 6, embed_dim=8, hidden_dim=8, num_layers=1).eval()


def test_empty_batch_runs():
    log_probs, frames = _ctc_model()(torch.zeros(0, 4, dtype=torch.long))
    assert log_probs.shape == (0, 8, 6) and frames.shape == (0,)
    assert _ctc_model().decode(torch.zeros(0, 4, dtype=torch.long)) == []


def test_float64_model_gives_float64_log_probs():
    log_probs, _ = _ctc_model().double()(torch.tensor([[3, 4]]))
    assert log_probs.dtype == torch.float64


@pytest.mark.parametrize(
    "targets, lengths, message",
    [
        (
            [[0, 2], [3, 0]],
            [2, 1],
            "target 0 holds label 0; labels are ids in \\[0, 6\\) other than blank_id=0",
        ),
        ([[6, 2], [3, 0]], [2, 1], "target 0 holds label 6"),
        ([[-1, 2], [3, 0]], [2, 1], "target 0 holds label -1"),
        ([[1, 2], [3, 0]], [3, 1], r"target_lengths\[0\]=3; expected a length in \[0, S=2\]"),
        ([[1, 2], [3, 0]], [2], r"do not match the batch of 2 sources"),
    ],
)
def test_loss_refuses_labels_and_lengths_it_cannot_score(targets, lengths, message):
    src = torch.tensor([[3, 4, 5], [6, 7, 0]])
    with pytest.raises(ValueError, match=message):
        _ctc_model().loss(src, None, torch.tensor(targets), torch.tensor(lengths))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.tensor([[3, 0, 5]])), "src_mask row 0 has padding before a real token"),
        (
            lambda m: m.loss(
                torch.zeros(0, 2, dtype=torch.long),
                None,
                torch.zeros(0, 1, dtype=torch.long),
                torch.zeros(0, dtype=torch.long),
            ),
            r"empty batch \(B=0\)",
        ),
        (lambda m: m.decode(torch.tensor([[3]]), beam_width=True), "beam_width=True"),
        (lambda m: CTCModel(5, 5, pad_id=7), r"pad_id=7; expected an id in \[0, src_vocab_size\)"),
        (lambda m: ctc_greedy_decode(torch.zeros(1, 3, 4), torch.tensor([5])), r"frame count in \[0, T=3\]"),
        (
            lambda m: ctc_prefix_beam_search(torch.zeros(3, 4), blank_id=9),
            r"blank_id=9; expected an id in \[0, V\)",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_ctc_model())


@pytest.mark.parametrize("blank_id", [3, -1, 10, 1.0, True])
def test_greedy_decode_refuses_a_blank_id_outside_the_labels(blank_id):
    """blank_id=3 or -1 with V = 3 decoded [1, 0, 1] (the real blank emitted as a label) without a word."""
    log_probs = torch.log(torch.tensor([[[0.1, 0.9, 1e-4], [0.9, 0.05, 0.05], [0.1, 0.9, 1e-9]]]))
    assert ctc_greedy_decode(log_probs, blank_id=0) == [[1, 1]]
    with pytest.raises(ValueError, match=rf"blank_id={blank_id!r}; expected an id in \[0, V\) = \[0, 3\)"):
        ctc_greedy_decode(log_probs, blank_id=blank_id)


def test_greedy_decode_takes_a_numpy_integer_blank_id():
    log_probs = torch.log(torch.tensor([[[0.1, 0.9, 1e-4], [0.9, 0.05, 0.05], [0.1, 0.9, 1e-9]]]))
    assert ctc_greedy_decode(log_probs, blank_id=np.int64(0)) == [[1, 1]]


def test_decoding_needs_at_least_one_label():
    with pytest.raises(ValueError, match=r"V = 0 labels; expected V >= 1"):
        ctc_greedy_decode(torch.zeros(1, 3, 0))
    with pytest.raises(ValueError, match=r"V = 0 labels; expected V >= 1"):
        ctc_prefix_beam_search(torch.zeros(3, 0))


def test_boolean_lengths_are_refused():
    """A bool tensor passed the integer check (True counts as one frame, or one label)."""
    with pytest.raises(ValueError, match=r"lengths is \(1,\) torch.bool; expected an integer tensor"):
        ctc_greedy_decode(torch.zeros(1, 3, 4), torch.tensor([True]))
    src, targets = torch.tensor([[3, 4, 5], [6, 7, 0]]), torch.tensor([[1, 2], [3, 0]])
    with pytest.raises(ValueError, match=r"target_lengths is \(2,\) torch.bool; expected an integer tensor"):
        _ctc_model().loss(src, None, targets, torch.tensor([True, True]))


def test_prefix_beam_search_refuses_probabilities():
    """Probabilities ranked as log-probabilities decoded another labelling in 127 of 200 random frames,
    without an error (ctc_greedy_decode takes either: the arg-max is the same)."""
    torch.manual_seed(3)
    log_probs = (torch.randn(6, 4) * 2).log_softmax(-1)
    message = r"log_probs holds 0\.\d+ > 0, which is no log-probability; pass log-probabilities \(probs\.log"
    with pytest.raises(ValueError, match=message):
        ctc_prefix_beam_search(log_probs.exp(), beam_width=8)
    with pytest.raises(ValueError, match="pass log-probabilities"):  # one frame of probabilities is enough
        ctc_prefix_beam_search(torch.cat([log_probs[:5], log_probs[5:].exp()]), beam_width=8)
    assert ctc_greedy_decode(log_probs.exp()[None]) == ctc_greedy_decode(log_probs[None])


def test_prefix_beam_search_takes_log_probabilities_up_to_rounding():
    """log(1) = 0 and a log-probability a rounding above 0 (within 1e-4) decode as the exact ones."""
    log_probs = torch.log(torch.tensor([[0.1, 0.9, 0.0], [1.0, 0.0, 0.0], [0.1, 0.9, 0.0]]))  # -inf, 0
    assert ctc_prefix_beam_search(log_probs) == [1, 1]
    nudged = log_probs.clone()
    nudged[1, 0] = 5e-5
    assert ctc_prefix_beam_search(nudged) == [1, 1]


def test_a_frame_where_every_label_is_impossible_is_refused_by_both_decoders():
    """A frame of -inf alone: the arg-max read it as label 0 and the beam search ranked -inf ties, returning
    an arbitrary prefix; no labelling has a probability above 0."""
    lp = torch.randn(4, 3).log_softmax(-1)
    lp[2] = -math.inf
    with pytest.raises(ValueError, match=r"-inf for every label at frame\(s\) 2"):
        ctc_prefix_beam_search(lp)
    with pytest.raises(ValueError, match=r"frame\(s\) \(0, 2\)"):
        ctc_greedy_decode(lp[None])
    # a dead frame beyond a sequence's length is padding: decoded as before
    assert ctc_greedy_decode(lp[None], torch.tensor([2])) == ctc_greedy_decode(lp[None, :2])


def test_prefix_beam_search_takes_a_live_model_output_without_warnings():
    """A model's log-probabilities that require grad: torch warned "Converting a tensor with
    requires_grad=True to a scalar" from inside the search."""
    import warnings

    log_probs = torch.log_softmax(torch.randn(5, 4), dim=-1).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = ctc_prefix_beam_search(log_probs, beam_width=4)
    assert found == ctc_prefix_beam_search(log_probs.detach(), 4)
