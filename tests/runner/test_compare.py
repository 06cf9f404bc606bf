"""End-to-end ``attnkit compare`` on a tiny fixture: outputs, the HTML report, kill-and-resume, run-dir
safety."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser

import pytest
import torch

from attnkit.runner import build_config, get_task, run_compare
from tests.runner._fixtures import tiny_overrides, write_classification_file


class _Tables(HTMLParser):
    """Collects the cells of every table by id, and counts <script> tags."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.scripts = 0
        self._table = None
        self._cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = dict(attrs).get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append(self._cell)
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _run(tmp_path, out_name="out", **extra):
    data = write_classification_file(tmp_path / "topics.json")
    config = build_config(tiny_overrides(data, tmp_path / out_name, **extra))
    return run_compare(config)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("compare"))


def test_writes_one_record_per_mechanism(finished):
    out = finished.out
    payload = json.loads((out / "results.json").read_text())
    assert [r["mechanism"] for r in payload["results"]] == ["softmax", "hnas"]
    assert len(payload["runs"]) == 2
    for record in payload["results"]:
        assert 0.0 <= record["accuracy_mean"] <= 1.0 and 0.0 <= record["macro_f1_mean"] <= 1.0
        assert record["step_time_rel"] > 0
    assert payload["results"][0]["step_time_rel"] == pytest.approx(1.0)
    hnas = payload["results"][1]
    assert len(hnas["hybrid_u"]) == 1 and len(hnas["hybrid_u"][0]) == 2  # (layers, heads)
    assert all(0.0 < u < 1.0 for u in hnas["hybrid_u"][0])
    assert payload["results"][0]["hybrid_u"] is None
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["mechanism"] for r in rows] == ["softmax", "hnas"]
    assert float(rows[1]["accuracy_mean"]) == pytest.approx(hnas["accuracy_mean"])
    for name in ("learning_curves.png", "hybrid_weights.png", "report.html"):
        assert (out / name).stat().st_size > 0


def test_history_logs_every_eval_step(finished):
    run = finished.runs[0]
    assert [h["step"] for h in run["history"]] == [4, 8, 12]
    assert run["history"][-1]["accuracy"] == run["metrics"]["accuracy"]


def test_training_learns_the_fixture(finished):
    # three topics with disjoint keywords: chance is 1/3
    assert max(r["accuracy_mean"] for r in finished.records) > 0.6


def test_explain_away_is_recorded_with_softmax_and_hnas(finished):
    for record in finished.records:
        assert record["explain_away_min_normalized"] is not None
        assert record["explain_away_min_raw"] <= record["explain_away_min_normalized"]


def test_html_report_parses_and_contains_the_table(finished):
    text = (finished.out / "report.html").read_text()
    parser = _Tables()
    parser.feed(text)
    results = parser.tables["results"]
    assert results[0][0] == "mechanism"
    assert [row[0] for row in results[1:]] == ["softmax", "hnas"]
    accuracy = f"{finished.records[1]['accuracy_mean'] * 100:.1f}"
    assert results[2][2] == accuracy
    assert "data:image/png;base64," in text
    # dataset text is escaped: the fixture's <script> sample and a label name with markup
    assert parser.scripts == 0
    assert "&lt;script&gt;" in text and "&lt;b&gt;&amp;tag" in text


def test_existing_run_dir_is_never_overwritten_silently(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--resume"):
        _run(tmp_path, max_steps=1, mechanisms="softmax")
    with pytest.raises(FileExistsError, match="not an attnkit compare run"):
        _run(tmp_path, max_steps=1, mechanisms="softmax", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    task = get_task(str(data))
    common = dict(mechanisms="softmax,hnas", seeds=2, steps=10, checkpoint_every=3, eval_every=5)
    full = run_compare(build_config(tiny_overrides(data, tmp_path / "full", **common)), task=task)

    class Killed(Exception):
        pass

    def kill(mechanism, seed, step):
        if mechanism == "hnas" and seed == 0 and step == 8:  # after the checkpoint of step 6, before the end
            raise Killed

    with pytest.raises(Killed):
        run_compare(build_config(tiny_overrides(data, tmp_path / "cut", **common)), task=task, on_step=kill)
    assert not (tmp_path / "cut" / "results.json").exists()
    assert (tmp_path / "cut" / "runs" / "hnas-seed0" / "checkpoints" / "step-0000006").is_dir()
    resumed = run_compare(
        build_config(tiny_overrides(data, tmp_path / "cut", resume=True, **common)), task=task
    )

    for a, b in zip(full.runs, resumed.runs):
        assert (a["mechanism"], a["seed"]) == (b["mechanism"], b["seed"])
        assert a["metrics"] == b["metrics"]
        assert a["hybrid_u"] == b["hybrid_u"]
        assert a["explain_away"] == b["explain_away"]
        strip = lambda history: [{k: v for k, v in h.items()} for h in history]  # noqa: E731
        assert strip(a["history"]) == strip(b["history"])


@pytest.mark.slow
def test_resume_with_a_trained_alignment_regularizer_matches_uninterrupted_run(tmp_path):
    """gan's discriminator and ct's critic and navigator train with the model: they were not in the
    checkpoint, so a resumed run started them afresh (its losses differed from step 11 on)."""
    data = write_classification_file(tmp_path / "topics.json")
    task = get_task(str(data))
    common = dict(mechanisms="softmax,dnas", align="gan,ct", seeds=1, steps=8, checkpoint_every=3,
                  eval_every=4)
    full = run_compare(build_config(tiny_overrides(data, tmp_path / "full", **common)), task=task)

    class Killed(Exception):
        pass

    def killer(victim):
        def kill(mechanism, seed, step):
            if mechanism == victim and step == 5:  # after the checkpoint of step 3
                raise Killed

        return kill

    for i, victim in enumerate(("softmax+gan", "dnas+ct")):  # two runs cut once, after their checkpoint
        with pytest.raises(Killed):
            config = build_config(tiny_overrides(data, tmp_path / "cut", resume=i > 0, **common))
            run_compare(config, task=task, on_step=killer(victim))
    resumed = run_compare(
        build_config(tiny_overrides(data, tmp_path / "cut", resume=True, **common)), task=task
    )
    for a, b in zip(full.runs, resumed.runs):
        assert a["mechanism"] == b["mechanism"] and a["history"] == b["history"], a["mechanism"]
        assert a["metrics"] == b["metrics"]


def test_a_checkpoint_from_before_the_regularizer_was_saved_still_resumes(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    common = dict(mechanisms="softmax", align="gan", seeds=1, steps=6, checkpoint_every=3, eval_every=3)

    def kill(mechanism, seed, step):
        if step == 4:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        run_compare(build_config(tiny_overrides(data, tmp_path / "run", **common)), on_step=kill)
    state_file = next((tmp_path / "run").glob("runs/*/checkpoints/step-*/state.pt"))
    state = torch.load(state_file, weights_only=True)
    del state["regularizer"], state["regularizer_rng"]  # as checkpoints were written before
    torch.save(state, state_file)
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "run", resume=True, **common)))
    assert len(result.runs) == 1  # it was "cannot be read (KeyError: 'regularizer')"


def test_resume_rejects_changed_settings(tmp_path):
    _run(tmp_path, mechanisms="softmax", max_steps=2)
    with pytest.raises(ValueError, match="lr: saved 0.01, given 0.5"):
        _run(tmp_path, mechanisms="softmax", max_steps=2, resume=True, lr=0.5)


def test_resume_refuses_a_changed_dataset_file(tmp_path):
    """An edited --task file was resumed: runs of one report scored on two test sets (and a smaller test
    set made every later --resume end in an IndexError)."""
    _run(tmp_path, mechanisms="softmax", max_steps=2)
    write_classification_file(tmp_path / "topics.json", seed=1)  # same size, other examples
    with pytest.raises(ValueError, match=r"dataset file .*topics\.json' changed since the run .* restore it"):
        config = build_config(tiny_overrides(tmp_path / "topics.json", tmp_path / "out", mechanisms="softmax",
                                             max_steps=2, resume=True))
        run_compare(config)


def test_overwrite_keeps_a_task_file_inside_the_run_directory_and_follows_a_link(tmp_path):
    """--overwrite deleted the --task file it had just read when it lay in --out; on a symbolic link to the
    run directory it failed with an OSError traceback. It now deletes the earlier run's outputs only: a task
    file beside them stays, one inside them (runs/) is refused before anything is deleted."""
    _run(tmp_path, mechanisms="softmax", max_steps=2)
    doomed = write_classification_file(tmp_path / "out" / "runs" / "mine.json")
    with pytest.raises(ValueError, match="would delete .*mine.json.*the --task file"):
        run_compare(build_config(tiny_overrides(doomed, tmp_path / "out", mechanisms="softmax", max_steps=2,
                                                overwrite=True)))
    assert doomed.is_file() and (tmp_path / "out" / "results.json").is_file()
    elsewhere = write_classification_file(tmp_path / "elsewhere.json")
    (tmp_path / "out" / "runs" / "linked.json").symlink_to(elsewhere)  # a link in runs/: deleted with it
    with pytest.raises(ValueError, match="would delete .*linked.json.*the --task file"):
        run_compare(build_config(tiny_overrides(tmp_path / "out" / "runs" / "linked.json", tmp_path / "out",
                                                mechanisms="softmax", max_steps=2, overwrite=True)))
    beside = write_classification_file(tmp_path / "out" / "mine.json")
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    run_compare(build_config(tiny_overrides(beside, tmp_path / "out", mechanisms="softmax", max_steps=2,
                                            overwrite=True)))
    assert beside.is_file() and (tmp_path / "out" / "notes.txt").read_text() == "the user's"
    assert not (tmp_path / "out" / "runs" / "mine.json").exists()  # runs/ is the earlier run's
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "out")
    data = tmp_path / "topics.json"
    run_compare(build_config(tiny_overrides(data, link, mechanisms="softmax", max_steps=2, overwrite=True)))
    assert link.is_symlink() and (link / "results.json").is_file() and (link / "notes.txt").is_file()


def test_seq2seq_file_task_reports_sequence_accuracy(tmp_path):
    from tests.runner._fixtures import write_seq2seq_jsonl

    data = write_seq2seq_jsonl(tmp_path / "reverse.jsonl")
    config = build_config(
        tiny_overrides(
            data, tmp_path / "out", mechanisms="softmax,dnas", steps=4, eval_every=2, max_target_len=6
        )
    )
    assert config.mechanisms == ("softmax", "dnas")
    result = run_compare(config)
    assert result.task.kind == "seq2seq"
    assert result.task.mechanisms_for("dnas") == {"encoder_mechanism": "dnas", "decoder_mechanism": "softmax",
                                                  "cross_mechanism": "softmax"}
    for record in result.records:
        assert 0.0 <= record["sequence_accuracy_mean"] <= 1.0
    sample = result.runs[0]["samples"][0]
    assert sample["target"] == sample["source"][::-1]


def test_cpu_kernels_are_built_before_the_first_timed_step(tmp_path, monkeypatch):
    """A first build of the C++ kernels (tens of seconds) must not count as a training step's time."""
    from attnkit.kernels import cpu_ext
    from attnkit.runner import train

    events = []
    real_load = cpu_ext.load
    monkeypatch.setattr(cpu_ext, "load", lambda *a, **k: events.append("load") or real_load(*a, **k))
    real_clock = train.time.perf_counter

    class Clock:  # records when a step's timer starts
        @staticmethod
        def perf_counter():
            events.append("clock")
            return real_clock()

    monkeypatch.setattr(train, "time", Clock)
    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "out", mechanisms="dnas", steps=2, eval_every=2,
                                            checkpoint_every=2)))
    assert "load" in events and "clock" in events
    assert events.index("load") < events.index("clock")


def test_results_json_is_strict_json_when_no_attention_call_had_a_valid_key(tmp_path):
    """Empty sources (every key padded): the explain-away minimum stayed +inf and results.json held
    Infinity, which JSON parsers other than Python's refuse."""
    path = tmp_path / "empty.json"
    rows = [{"source": "", "target": ""}] * 16
    path.write_text(json.dumps({"kind": "seq2seq", "train": rows, "test": rows[:4]}))
    config = build_config(tiny_overrides(path, tmp_path / "out", mechanisms="softmax", steps=2, eval_every=2,
                                         max_target_len=6))
    run_compare(config)

    def refuse(constant):
        raise ValueError(f"{constant} in results.json")

    payload = json.loads((tmp_path / "out" / "results.json").read_text(), parse_constant=refuse)
    assert payload["runs"][0]["explain_away"]["min"] is None


def test_grad_clip_bounds_the_regularizers_own_gradient_norm(tmp_path, monkeypatch):
    """compare clipped the model's gradients only: gan's discriminator stepped on its unclipped gradients
    (the alignment Trainer's max_grad_norm clips them, as their own group)."""
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        regularizer_group = self.param_groups[-1]["params"]  # added after the model's (weight decay 0)
        seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in regularizer_group
                                                         if p.grad is not None])))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "out", mechanisms="softmax", align="gan",
                                            seeds=1, steps=3, grad_clip=1e-4, align_weight=10.0)))
    assert len(seen) == 3 and max(seen) <= 1e-4 * (1 + 1e-5), seen
    assert min(seen) > 0, seen  # the discriminator has gradients to clip


def test_hnas_hybrid_weights_take_no_weight_decay(tmp_path, monkeypatch):
    """compare's AdamW decayed theta towards 0 (u towards 1/2) with every other weight; finetune's Trainer
    did not. Seen through the optimizer the run builds: theta alone in a group without decay."""
    import attnkit.runner.train as train

    built = []

    class Spy(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(train.torch.optim, "AdamW", Spy)
    _run(tmp_path, mechanisms="hnas", num_layers=2, max_steps=1, weight_decay=0.5)
    (optimizer,) = built
    groups = [(g["weight_decay"], [p.shape for p in g["params"]]) for g in optimizer.param_groups]
    assert groups[0][0] == 0.5  # a parameter is in one group only: the thetas are not among these
    assert groups[1] == (0.0, [torch.Size([2]), torch.Size([2])])  # one theta (nhead,) per layer, no decay
    assert len(groups) == 2


def test_a_checkpoint_with_the_hybrid_weights_among_the_decayed_ones_resumes_exactly(tmp_path):
    """Checkpoints written before the hybrid weights had a group of their own hold one model group: their
    Adam moments move with theta into the new group (the resumed run equals an uninterrupted one; torch's
    'different number of parameter groups' error before)."""
    data = write_classification_file(tmp_path / "topics.json")
    task = get_task(str(data))
    common = dict(mechanisms="hnas", seeds=1, steps=8, checkpoint_every=3, eval_every=4, num_layers=2)
    full = run_compare(build_config(tiny_overrides(data, tmp_path / "full", **common)), task=task)

    def kill(mechanism, seed, step):
        if step == 5:  # after the checkpoint of step 3
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        run_compare(build_config(tiny_overrides(data, tmp_path / "cut", **common)), task=task, on_step=kill)
    state_file = next((tmp_path / "cut").glob("runs/*/checkpoints/step-*/state.pt"))
    state = torch.load(state_file, weights_only=True)
    # the old layout: every model parameter in one group, numbered in model.parameters() order
    config = build_config(tiny_overrides(data, tmp_path / "x", **common))
    model = task.build_model(config, "hnas", task.prepare(config))
    names = [n for n, _ in model.named_parameters()]
    decayed, hybrid = state["optimizer"]["param_groups"]
    assert len(hybrid["params"]) == 2 and len(decayed["params"]) + 2 == len(names)
    new_ids = iter(decayed["params"]), iter(hybrid["params"])
    old_of_new = {next(new_ids[n.endswith(".theta")]): k for k, n in enumerate(names)}
    state["optimizer"] = {
        "state": {old_of_new[i]: v for i, v in state["optimizer"]["state"].items()},
        "param_groups": [{**decayed, "params": list(range(len(names)))}],
    }
    schedule = state["scheduler"]  # one entry per group there too (torch's get_lr zips them strictly)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(schedule.get(key), list):
            schedule[key] = schedule[key][:1]
    torch.save(state, state_file)
    resumed = run_compare(build_config(tiny_overrides(data, tmp_path / "cut", resume=True, **common)),
                          task=task)
    (a,), (b,) = full.runs, resumed.runs
    assert a["history"] == b["history"] and a["metrics"] == b["metrics"] and a["hybrid_u"] == b["hybrid_u"]


@pytest.mark.parametrize("setting, message", [
    ({"mixed_precision": "bf16", "gradient_accumulation_steps": 1}, "mixed precision is 'bf16'"),
    ({"mixed_precision": "no", "gradient_accumulation_steps": 4}, "gradient_accumulation_steps is 4"),
])
def test_accelerate_settings_compare_would_follow_unrecorded_are_refused(tmp_path, setting, message):
    """``accelerate launch --mixed_precision bf16`` trained under bf16 autocast and a resume mixed float32 and
    bf16 steps (losses 1.7e-3 apart), and an accumulation setting divided every loss by 4 (accuracy 78.2% for
    71.3%), none of it recorded; both are refused before anything is written."""
    from types import SimpleNamespace

    data = write_classification_file(tmp_path / "data.json")
    config = build_config(tiny_overrides(data, tmp_path / "run"))
    accelerator = SimpleNamespace(num_processes=1, **setting)
    with pytest.raises(ValueError, match=message):
        run_compare(config, accelerator=accelerator)
    assert not (tmp_path / "run").exists()


def test_accelerate_launch_with_bf16_is_one_line_and_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    data = write_classification_file(tmp_path / "data.json")
    env = dict(os.environ, ACCELERATE_MIXED_PRECISION="bf16", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "attnkit", "compare", "--task", str(data), "--mechanisms", "softmax",
         "--out", str(tmp_path / "run"), "--progress", "none"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "mixed precision is 'bf16'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
