"""The lecture pictures label generated special tokens with the marks the scored outputs show."""

from __future__ import annotations

import torch

from attnkit.data.digits_canvas import CaptionVocab
from attnkit.data.tokenizers import GENERATED_BOS, GENERATED_EOS, GENERATED_PAD


def test_ctc_alignment_rows_show_a_generated_eos_as_its_mark():
    # the rows said "<eos>" while the sample tables showed the same output as ◁
    from attnkit.analysis.repro_lecture_seq import _alignment
    from attnkit.runner import build_config, get_task

    config = build_config({"task": "copy", "mechanisms": "ctc", "max_train": 16, "max_eval": 4,
                           "d_model": 16})
    task = get_task("copy")
    data = task.prepare(config)
    net = task.build_model(config, "ctc", data).eval()
    vocab = data.tgt_vocab
    picked = [vocab.eos_id, vocab.bos_id, vocab.unk_id + 1]

    class Fixed(type(net)):  # every frame's argmax cycles through <eos>, <bos> and a real token
        def forward(self, src, mask=None):
            log_probs, lengths = super().forward(src, mask)  # (1, T, V)
            T = log_probs.shape[1]
            logits = torch.zeros_like(log_probs)
            logits[0, torch.arange(T), torch.tensor(picked).repeat(T)[:T]] = 10.0
            return logits.log_softmax(-1), lengths

    net.__class__ = Fixed
    _, names, _, _ = _alignment(task, data, net, 0)
    assert names == [GENERATED_BOS, GENERATED_EOS, vocab.vocab[vocab.unk_id + 1]]  # sorted by id


def test_caption_panels_show_a_generated_pad_and_bos_as_the_scored_caption_does():
    # a generated <bos> was titled "<bos>" and a generated <pad> panel left blank; the caption showed ▷ / ∅
    from attnkit.analysis.plots_visual import _panel_words

    vocab = CaptionVocab()
    one = vocab.index["one"]
    ids = [one, vocab.PAD, vocab.BOS, one, vocab.EOS, vocab.PAD, vocab.PAD]
    words = _panel_words(vocab, torch.tensor(ids))
    assert words == ["one", GENERATED_PAD, GENERATED_BOS, "one", "<eos>"]
    assert " ".join(words[:-1]) == vocab.decode(ids, generated=True)


def test_an_alignment_cut_at_the_decoding_cap_has_no_eos_row():
    # the rows were labelled tokens + "<eos>" unconditionally: an output cut at the cap (never ending) got a
    # 37th label for 36 rows, a blank "<eos>" row the model never generated
    import types

    from attnkit.analysis.repro_lecture_seq import _alignment
    from attnkit.runner.transduction import TransductionTask

    task = TransductionTask("reverse")
    data = task.prepare(types.SimpleNamespace(max_train=50, max_eval=5))
    torch.manual_seed(0)
    model = task.build_model(types.SimpleNamespace(d_model=16), "additive", data).eval()
    with torch.no_grad():
        model.output.bias[data.tgt_vocab.eos_id] = -100.0  # never the argmax: the output runs to the cap
    matrix, rows, _, _ = _alignment(task, data, model, 0)
    assert matrix.shape[0] == len(rows) and "<eos>" not in rows
    with torch.no_grad():
        model.output.bias[data.tgt_vocab.eos_id] = 100.0  # the first step ends the output
    matrix, rows, _, _ = _alignment(task, data, model, 0)
    assert rows == ["<eos>"] and matrix.shape[0] == 1
