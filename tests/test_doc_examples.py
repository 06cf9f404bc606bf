"""The Python examples of the README and docs/alignment.md run as written: each block is executed, with the
names it takes from the reader's program (a model, a batch, ids) bound to small stand-ins, so that a renamed
function or argument breaks a test instead of the documentation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import attnkit as ak

ROOT = Path(__file__).resolve().parents[1]
README, ALIGNMENT = ROOT / "README.md", ROOT / "docs" / "alignment.md"


def _python_blocks(path: Path = README) -> dict[str, str]:
    """``{first line of the block without its comment: its code}`` for every fenced ``python`` block of
    ``path``."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
    return {code.splitlines()[0].split("#")[0].strip(): code for code in blocks}


def _block(first_line: str, path: Path = README) -> str:
    blocks = _python_blocks(path)
    if first_line not in blocks:
        raise AssertionError(f"no python block of {path.name} starts with {first_line!r}: {list(blocks)}")
    return blocks[first_line]


class _TinyEncoder(torch.nn.Module):
    """Two attnkit self-attention layers, called as ``model(**batch)`` or ``model(batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            ak.nn.MultiheadAttention(16, 2, mechanism="dnas", batch_first=True) for _ in range(2)
        )

    def forward(self, x, key_padding_mask=None):
        if isinstance(x, dict):  # model(batch)
            return self(**x)
        for layer in self.layers:
            x = x + layer(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x


def _tiny_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return {"x": torch.randn(2, 6, 16, generator=g), "key_padding_mask": padding}


def test_every_readme_block_is_covered():
    covered = {"import torch", "from attnkit.align import AlignmentRegularizer",
               "from attnkit.models import RNNSeq2Seq",
               "from attnkit.analysis import explain_away, collect_explain_away",
               "from transformers import AutoModel", "from attnkit.nn import HardAttention, DRAWRead"}
    assert set(_python_blocks()) <= covered, "a new README python block: run it in tests/test_readme.py"


def test_quick_start_runs_and_gives_the_documented_shapes():
    scope: dict = {}
    exec(_block("import torch"), scope)
    assert scope["out"].shape == (10, 2, 64)  # torch's (L, B, E)
    assert scope["w"].shape == (2, 10, 10)
    assert torch.isfinite(scope["out"]).all()


def test_hugging_face_block_runs_on_a_tiny_bert(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50)
    path, out = tmp_path / "bert", tmp_path / "converted"
    transformers.BertModel(config).save_pretrained(path)
    scope = {"path": str(path), "out": str(out)}
    exec(_block("from transformers import AutoModel"), scope)
    assert scope["model"].config.attnkit["mechanism"] == "hnas"
    u = __import__("attnkit.hf", fromlist=["hybrid_weights"]).hybrid_weights(scope["model"])
    assert u.shape == (2, 2)
    assert torch.allclose(u, torch.full((2, 2), 0.5))


def test_alignment_block_runs_and_its_loss_has_a_gradient():
    model, batch = _TinyEncoder(), _tiny_batch()
    scope = {"model": model, "batch": batch, "task_loss": lambda y: y.square().mean()}
    exec(_block("from attnkit.align import AlignmentRegularizer"), scope)
    scope["loss"].backward()
    grads = [p.grad for p in scope["reg"].parameters()]
    assert scope["loss"].isfinite()
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_sequence_model_block_runs():
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randint(1, 30, (2, 7), generator=g)
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[1, 5:] = False
    tgt_in_ids = torch.randint(1, 45, (2, 5), generator=g)
    scope = {"src_ids": src_ids, "src_mask": src_mask, "tgt_in_ids": tgt_in_ids}
    exec(_block("from attnkit.models import RNNSeq2Seq"), scope)
    assert scope["logits"].shape == (2, 5, 45)
    assert scope["align"].shape[0] == 2 and scope["align"].shape[-1] == 7  # (B, steps, Ls)


def test_diagnostics_block_runs_and_records_every_layer():
    model, batch = _TinyEncoder(), _tiny_batch()
    valid = ~batch["key_padding_mask"]
    q, k, v = torch.randn(3, 2, 2, 6, 8).unbind(0)
    weights = ak.attention(q, k, v, "dnas", key_mask=valid, query_mask=valid, return_weights=True)[1]
    scope = {"weights": weights, "mask": valid, "model": model, "batch": batch}
    exec(_block("from attnkit.analysis import explain_away, collect_explain_away"), scope)
    assert len(scope["log"]) == 2 and scope["log"][-1].layer == 1  # one record per layer's call
    assert 0.0 <= scope["stats"].min <= 1.0  # the smallest key sum of DNAS weights


def test_visual_block_imports_resolve():
    pytest.importorskip("sklearn")
    exec(_block("from attnkit.nn import HardAttention, DRAWRead"), {})


def _tiny_classifier():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[1, 4:] = 0
    batch = {"input_ids": torch.randint(1, 50, (2, 6), generator=g), "attention_mask": attention_mask,
             "labels": torch.tensor([0, 1])}
    return model, batch


def test_alignment_doc_blocks_are_covered():
    covered = {"import torch", "from attnkit.align import AlignmentRegularizer"}
    assert set(_python_blocks(ALIGNMENT)) <= covered, "a new python block: run it in this file"


def test_alignment_doc_training_loop_runs_and_remove_restores_the_model():
    model, batch = _tiny_classifier()
    model.eval()  # no dropout: outputs comparable before and after
    before = model(**batch).logits
    q, k = torch.randn(2, 2, 2, 6, 8).unbind(0)
    scope = {"model": model, "loader": [batch, batch], "q": q, "k": k,
             "mask": batch["attention_mask"].bool()}
    code = _block("import torch", ALIGNMENT)
    *body, last = code.rstrip().splitlines()
    exec("\n".join(body + [f"_last = {last.split('#')[0].strip()}"]), scope)
    assert scope["_last"].shape == (2, 2)  # mmd of (B, H, L, d) pairs: (B, H)
    with pytest.raises(ValueError, match="removed"):  # the block ended with reg.remove()
        scope["reg"].mmd()
    with torch.no_grad():  # trained two steps, then the hooks were removed: the model runs as a plain one
        trained = model(**batch).logits
    assert not torch.equal(trained, before)
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_alignment_doc_trainer_recipe_runs(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, batch = _tiny_classifier()
    rows = [{key: value[i] for key, value in batch.items()} for i in range(2)]
    scope = {"model": model, "train": rows, "collator": transformers.default_data_collator,
             "args": transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                                    per_device_train_batch_size=2, report_to=[],
                                                    use_cpu=True, save_strategy="no")}
    exec(_block("from attnkit.align import AlignmentRegularizer", ALIGNMENT), scope)
    assert scope["trainer"].state.global_step == 2
