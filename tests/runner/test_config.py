"""Configuration: validation, presets, YAML/TOML files with unknown keys rejected, command-line precedence."""

from __future__ import annotations

import pytest

from attnkit.runner.config import CompareConfig, build_config, config_keys, load_config_file


def test_defaults_are_the_quick_reuters8_comparison():
    config = build_config()
    assert config.task == "reuters8" and config.preset == "quick"
    assert config.mechanisms == ("softmax", "dnas", "hnas", "sinkhorn", "coda", "none")
    assert config.seeds >= 2


def test_mlu_paper_preset_compares_transformer_and_coda():
    config = build_config({"task": "mlu", "preset": "paper"})
    assert config.mechanisms == ("softmax", "coda")
    assert config.steps > build_config({"task": "mlu"}).steps


def test_mechanism_aliases_resolve_and_unknown_is_rejected():
    assert CompareConfig(mechanisms="lnas, hybrid").mechanisms == ("softmax", "hnas")
    with pytest.raises(ValueError, match="unknown mechanism 'flash'.*softmax"):
        CompareConfig(mechanisms="softmax,flash")
    with pytest.raises(ValueError, match="twice"):
        CompareConfig(mechanisms="softmax,lnas")


@pytest.mark.parametrize("key,value", [("steps", -1), ("max_steps", 0), ("seeds", 0), ("batch_size", 2.5),
                                       ("lr", float("nan")), ("dropout", 1.0), ("preset", "huge")])
def test_bad_values_name_the_key_and_value(key, value):
    with pytest.raises(ValueError, match=key):
        CompareConfig(**{key: value})


def test_max_steps_caps_the_steps():
    assert CompareConfig(steps=100, max_steps=7).total_steps == 7
    assert CompareConfig(steps=5, max_steps=7).total_steps == 5


@pytest.mark.parametrize("name,text", [
    ("run.yaml", "task: mlu\nseeds: 3\nmax-steps: 40\nlr: 0.01\n"),
    ("run.toml", 'task = "mlu"\nseeds = 3\nmax_steps = 40\nlr = 0.01\n'),
])
def test_file_values_override_the_preset(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    config = build_config(file=path)
    assert (config.task, config.seeds, config.max_steps, config.lr) == ("mlu", 3, 40, 0.01)
    assert config.mechanisms == ("softmax", "coda")  # from the mlu preset


def test_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seeds: 3\nmechanisms: [softmax, dnas]\n")
    config = build_config({"seeds": 1, "mechanisms": None}, file=path)
    assert config.seeds == 1 and config.mechanisms == ("softmax", "dnas")


def test_unknown_file_key_lists_the_valid_ones(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seeds: 2\nlearning_rate: 0.1\n")
    match = r"unknown configuration key\(s\) \['learning_rate'\].*valid keys: .*\blr\b"
    with pytest.raises(ValueError, match=match):
        load_config_file(path)


def test_missing_config_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config_file(tmp_path / "nope.yaml")


def test_every_key_is_settable_from_a_file(tmp_path):
    assert {"task", "mechanisms", "seeds", "max_steps", "out", "resume"} <= set(config_keys())


@pytest.mark.parametrize("name,text", [("run.yaml", "seeds: [1\n"), ("run.toml", "seeds = \n"),
                                       ("run.json", '{"seeds": '), ("run.json", b"\xff\xfe{}")])
def test_a_config_file_that_does_not_parse_is_named(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"configuration file '{path}' does not parse"):
        load_config_file(path)


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"max_steps": 3}'), (".yaml", "max_steps: 3\n"), (".toml", "max_steps = 3\n"),
])
def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path, suffix, text):
    """Notepad saves UTF-8 with a byte-order mark; JSON and TOML files were refused as not parsing."""
    path = tmp_path / f"run{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config_file(path) == {"max_steps": 3}


def test_a_folder_given_as_the_config_file_is_named_as_a_folder(tmp_path):
    """``--config /tmp`` said "configuration file '/tmp' not found"."""
    with pytest.raises(ValueError, match=r"is a folder, not a file; pass the path of the \.yaml/\.yml"):
        load_config_file(tmp_path)


@pytest.mark.parametrize("seed, seeds", [(4294967295, 2), (99999999999999999999, 1)])
def test_seeds_past_numpys_range_are_refused_before_any_run(seed, seeds):
    """The first run trained (and left its folder) before the second seed failed in the seeding call."""
    with pytest.raises(ValueError, match=rf"seed={seed} with seeds={seeds} runs seeds up to .*; lower seed"):
        build_config({"seed": seed, "seeds": seeds})
    assert build_config({"seed": 4294967294, "seeds": 2}).seed_list == (4294967294, 4294967295)


def test_null_on_the_command_line_or_in_a_file_is_a_value_not_an_omission(tmp_path):
    """``--set max_eval=null`` and ``max_train: null`` were dropped: the preset's caps stayed (600 of 2189
    evaluation examples, silently)."""
    from attnkit.cli.compare import parse_set

    overrides = parse_set(["max_eval=null", "threads=null"])
    assert overrides == {"max_eval": None, "threads": None}
    path = tmp_path / "run.yaml"
    path.write_text("max_train: null\nlr: 1e-3\n")  # PyYAML reads 1e-3 (no dot) as text
    layered = {**load_config_file(path), **overrides}
    config = build_config(layered, keep_none=True)
    assert (config.max_train, config.max_eval, config.threads) == (None, None, None)
    assert config.lr == 0.001
    assert build_config({"max_eval": None}).max_eval == 600  # the Python API: None = not given


@pytest.mark.parametrize("key, value, message", [
    ("lr", 1e300, r"lr=1e\+300: expected a finite number in \(0, 3.403e\+38\)"),
    ("max_len", 9999999999, "max_len=9999999999: expected at most 1048576"),
    ("threads", 100000, "threads=100000: expected at most 1024"),
    ("d_model", 1099511627776, "d_model=1099511627776: expected at most 65536"),
    ("dim_feedforward", 2**21, "expected at most 1048576"),
    ("weight_decay", -1, r"weight_decay=-1: expected a finite number in \[0, "),
    ("dropout", 1.5, r"dropout=1.5: expected a finite number in \[0, 1\)"),
])
def test_sizes_that_fail_deep_inside_torch_are_refused_with_a_message(key, value, message):
    """lr=1e300 overflowed in AdamW, max_len=1e10 allocated 80 GB, threads=100000 aborted OpenMP."""
    with pytest.raises(ValueError, match=message):
        build_config({key: value})


def test_a_model_too_large_in_all_is_refused_though_each_size_is_within_its_cap():
    with pytest.raises(ValueError, match=r"make a model of about 4.3e\+09 weights, more than 2.15e\+09"):
        build_config({"vocab_size": 2**24, "d_model": 256, "nhead": 4})


def test_an_unknown_task_lists_the_recurrent_tasks_too():
    """The README documents --task g2p|numbers|copy|reverse|sort; the error listed only the datasets."""
    with pytest.raises(ValueError, match="recurrent tasks g2p, numbers, copy, reverse, sort"):
        build_config({"task": "nosuch"})


def test_a_vocabulary_without_room_for_pad_and_unk_is_refused_naming_vocab_size():
    """vocab_size=1 passed the config and failed after the data loaded, as the tokenizer's max_vocab=1."""
    with pytest.raises(ValueError, match=r"vocab_size=1: expected an integer >= 2 \(it counts <pad>"):
        build_config({"vocab_size": 1})


@pytest.mark.parametrize("d_model", [1, 7])
def test_an_odd_width_for_the_recurrent_tasks_is_refused_naming_d_model(d_model):
    """The models refused it after the run folder was written, naming hidden_dim or embed_dim."""
    with pytest.raises(ValueError, match=f"d_model={d_model}: the recurrent models .* pass an even d_model"):
        build_config({"task": "reverse", "d_model": d_model})


@pytest.mark.parametrize("given, task", [("G2P", "g2p"), ("Reuters8", "reuters8"), ("Copy", "copy")])
def test_built_in_tasks_are_read_in_any_case(given, task):
    """--task Reuters8 ran; --task G2P was taken for a dataset file and refused."""
    config = build_config({"task": given})
    assert config.task == task and config.steps == build_config({"task": task}).steps


@pytest.mark.parametrize("item, read_as", [("steps=010", "8"), ("seed=017", "15"), ("eval_every=1:00", "60"),
                                           ("steps=0x10", "16"), ("steps=1_000", "1000")])
def test_set_numbers_are_decimal_not_yaml_octal_hex_or_base_60(item, read_as):
    """``--set steps=010 --set eval_every=1:00`` ran 8 steps and evaluated every 60 (YAML 1.1 forms)."""
    from attnkit.cli.compare import parse_set

    with pytest.raises(ValueError, match=f"reads .* as {read_as}; write the number in decimal"):
        parse_set([item])
    assert parse_set(["steps=10", "lr=1e-3", "lr2=0.5", "x=-3", "y=.inf", "z=null", "w=text"]) == {
        "steps": 10, "lr": 1e-3, "lr2": 0.5, "x": -3, "y": float("inf"), "z": None, "w": "text"}


@pytest.mark.parametrize("raw, value", [("+.5", 0.5), ("-.5", -0.5), (".25", 0.25), ("1e-3", 1e-3)])
def test_set_reads_signed_and_dotted_floats_that_yaml_11_leaves_as_text(raw, value):
    """``--set dropout=+.5`` was refused as "expected a finite number" (YAML 1.1 reads +.5 as a string)."""
    from attnkit.cli.compare import parse_set

    assert parse_set([f"dropout={raw}"]) == {"dropout": value}
    assert parse_set(["name='123'"]) == {"name": "123"}  # quoted text stays text


def test_config_file_numbers_are_decimal_not_yaml_11_octal_or_base_60(tmp_path):
    """``steps: 010`` in a config file ran 8 steps and ``eval_every: 1:00`` evaluated every 60 (YAML 1.1)."""
    from attnkit.runner.config import load_config_file

    path = tmp_path / "run.yaml"
    path.write_text("steps: 010\nlr: 1e-3\ndropout: +.5\n")
    assert load_config_file(path) == {"steps": 10, "lr": 1e-3, "dropout": 0.5}
    path.write_text("eval_every: 1:00\n")
    with pytest.raises(ValueError, match="eval_every"):  # text now, refused by the key's check
        from attnkit.runner.config import CompareConfig

        CompareConfig(**load_config_file(path))


def test_a_run_saved_with_a_capitalised_task_name_still_resumes(tmp_path):
    """Runs saved "Reuters8" as given; the name read in lower case made --resume see other settings."""
    import json

    from attnkit.runner.compare import prepare_run_dir

    config = build_config({"task": "reuters8", "out": str(tmp_path / "run")})
    prepare_run_dir(config)
    path = tmp_path / "run" / "config.json"
    payload = json.loads(path.read_text())
    payload["config"]["task"] = "Reuters8"  # as runs were saved before
    path.write_text(json.dumps(payload))
    assert prepare_run_dir(build_config({"task": "Reuters8", "out": str(tmp_path / "run"), "resume": True}))


@pytest.mark.parametrize("task", ["mlu", "pairs.jsonl"])
def test_vocab_size_is_refused_for_a_seq2seq_task_that_never_reads_it(task, tmp_path):
    """``compare --task mlu --set vocab_size=3`` was accepted and recorded in config.json, while the character
    tokenizer of a seq2seq task keeps every character of the data whatever vocab_size says."""
    if task.endswith(".jsonl"):
        from tests.runner._fixtures import write_seq2seq_jsonl

        task = str(write_seq2seq_jsonl(tmp_path / task))
    with pytest.raises(ValueError, match=r"^vocab_size does not apply to task '.*(mlu|pairs\.jsonl)': its "
                                         r"character vocabulary is every character of the data.*; drop it$"):
        build_config({"task": task, "vocab_size": 3})
    with pytest.raises(ValueError, match="vocab_size does not apply"):
        build_config({"task": task, "preset": "paper", "vocab_size": 6000})  # the classification default


@pytest.mark.parametrize("preset", ["quick", "paper"])
def test_a_seq2seq_presets_own_vocab_size_and_a_saved_runs_pass(preset):
    """The seq2seq presets hold vocab_size=64 (so every saved run's config.json does): that is not the
    user's setting, and resuming a run saved with another value is not refused."""
    assert build_config({"task": "mlu", "preset": preset}).vocab_size == 64
    assert build_config({"task": "mlu", "preset": preset, "vocab_size": 64}).vocab_size == 64
    saved = build_config({"task": "mlu", "preset": preset}).to_dict() | {"vocab_size": 3}
    assert build_config({"progress": "none"}, base=saved).vocab_size == 3
    assert build_config({"task": "reuters8", "vocab_size": 3}).vocab_size == 3  # classification reads it


def test_max_target_len_is_refused_for_a_classification_task():
    """``compare --task reuters8 --set max_target_len=5`` was accepted and recorded, and nothing read it."""
    with pytest.raises(ValueError, match=r"^max_target_len does not apply to task 'reuters8': a classifier"):
        build_config({"task": "reuters8", "max_target_len": 5})
    default = build_config({"task": "reuters8"}).max_target_len
    assert build_config({"task": "reuters8", "max_target_len": default}).task == "reuters8"  # a saved run's


@pytest.mark.parametrize("name, text, key", [
    ("twice.yaml", "steps: 1\nsteps: 2\n", "'steps' is given twice (line 2)"),
    ("nested.yaml", "steps: 1\nextra:\n  a: 1\n  a: 2\n", "'a' is given twice (line 4)"),
    ("twice.json", '{"steps": 1, "steps": 2}', "'steps' is given twice"),
    ("dashes.yaml", "max-steps: 1\nmax_steps: 2\n", "'max-steps' and 'max_steps' are the same key"),
    ("dashes.toml", "max-steps = 1\nmax_steps = 2\n", "'max-steps' and 'max_steps' are the same key"),
])
def test_a_key_given_twice_in_a_config_file_is_refused_with_the_key_and_file(tmp_path, name, text, key):
    """The last value silently won, where the command line refuses a key given twice."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="give each key once") as exc:
        load_config_file(path)
    assert key in str(exc.value) and name in str(exc.value) and "\n" not in str(exc.value)


def test_yaml_merge_keys_may_be_overridden_once():
    from attnkit.runner.config import yaml_load

    data = yaml_load("base: &b {steps: 1, seeds: 2}\nother:\n  <<: *b\n  steps: 3\n")
    assert data["other"] == {"steps": 3, "seeds": 2}


def test_an_alignment_weight_without_alignment_is_refused():
    """--set align_weight=5 with align none was recorded in results.json and ignored (finetune refused
    --align-weight without --align)."""
    with pytest.raises(ValueError, match=r"^align_weight=5 weighs alignment attention, and align is none"):
        build_config({"align_weight": 5})
    assert build_config({"align_weight": 5, "align": "ct"}).align_weight == 5
    assert build_config({"align_weight": 0.01}).align == ("none",)  # the default itself: nothing ignored


def test_alignment_of_the_no_attention_baseline_alone_is_refused():
    """--mechanisms none --align ct ran one unaligned run while results.json recorded align ['ct']."""
    with pytest.raises(ValueError, match=r"align=\['ct'\]: mechanism 'none' .* has no attention to align"):
        build_config({"mechanisms": "none", "align": "ct"})
    variants = build_config({"mechanisms": "none,dnas", "align": "none,ct"}).variants
    assert variants == ("none", "dnas", "dnas+ct")


def test_the_readme_preset_table_lists_what_each_preset_sets():
    """The README's table of presets (every key, per task family and preset) equals the resolved configs:
    a preset changed in code without its table is caught."""
    from pathlib import Path

    from attnkit.runner.config import _UNUSED_KEYS, PRESETS, TASK_KINDS

    columns = [("reuters8", "quick"), ("reuters8", "paper"), ("mlu", "quick"), ("mlu", "paper"),
               ("g2p", "quick"), ("g2p", "paper")]
    configs = [build_config({"task": t, "preset": p}) for t, p in columns]
    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| `")
             and line.count(" | ") == len(columns)]

    def cell(task, key, value):
        if key in _UNUSED_KEYS[TASK_KINDS[task]][0]:
            return "-"
        if value is None:
            return "torch default" if key == "threads" else "all"
        if isinstance(value, tuple):
            return ",".join(value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    keys = [line.split("`")[1] for line in table]
    assert len(keys) == len(set(keys)) == 22, keys
    preset_keys = {k for family in PRESETS.values() for preset in family.values() for k in preset}
    assert preset_keys <= set(keys), sorted(preset_keys - set(keys))
    for line, key in zip(table, keys):
        expected = [cell(t, key, getattr(c, key)) for (t, _), c in zip(columns, configs)]
        assert line == f"| `{key}` | " + " | ".join(expected) + " |"


def test_numpy_scalars_are_taken_as_python_numbers():
    """seeds=np.int64(2) was refused with "expected an integer >= 1", and np.float32 lr and dropout alike."""
    import json

    import numpy as np

    config = build_config({"seeds": np.int64(2), "lr": np.float32(0.001), "dropout": np.float32(0.25)})
    assert (config.seeds, config.dropout) == (2, 0.25) and type(config.seeds) is int
    assert type(config.lr) is float and config.lr == pytest.approx(0.001)
    json.dumps(config.result_dict())  # saved as JSON numbers
    with pytest.raises(ValueError, match="seeds=0"):
        build_config({"seeds": np.int64(0)})
    assert build_config({"plots": np.bool_(False)}).plots is False
