"""Configuration of ``attnkit compare``: one frozen, validated dataclass, presets, YAML/TOML files.

Precedence, lowest first: the preset of the task (``quick`` or ``paper``) < the configuration saved in a
run directory being resumed < a configuration file (``--config run.yaml``) < command-line values.
Unknown keys are rejected with the list of valid ones.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from .._files import json_loads
from ..registry import MECHANISMS, resolve_mechanism
from ..validators import SEED_MAX
from .transduction import DEFAULT_MODELS, TRANSDUCTION_TASKS, check_model_names
from .baseline import NO_ATTENTION

__all__ = [
    "CompareConfig",
    "PRESETS",
    "DEFAULT_TASK",
    "DEFAULT_MECHANISMS",
    "PROGRESS",
    "build_config",
    "load_config_file",
    "preset_values",
    "config_keys",
]

DEFAULT_TASK = "reuters8"
DEFAULT_MECHANISMS: tuple[str, ...] = MECHANISMS
PROGRESS: tuple[str, ...] = ("auto", "rich", "tqdm", "none")
PRESET_NAMES: tuple[str, ...] = ("quick", "paper")
TRACKERS: tuple[str, ...] = ("tensorboard",)  # Accelerate trackers that ``log_with`` accepts

# Hyperparameters per task kind and preset (the README's table lists them; tests/runner/test_config.py keeps
# it true). ``quick`` fits the default comparison (five mechanisms and the baseline x two seeds on Reuters-R8)
# in about one and a half minutes of training on two CPU cores; ``paper`` is larger (on Reuters-R8 2 to 5
# hours on two cores, as the README measured; the papers trained for 100K steps on GPUs).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "classification": {
        "quick": dict(
            mechanisms=(*DEFAULT_MECHANISMS, NO_ATTENTION),
            seeds=2,
            steps=150,
            batch_size=32,
            lr=2e-3,
            warmup_steps=15,
            eval_every=15,
            checkpoint_every=50,
            max_train=2400,
            max_eval=600,
            max_len=64,
            vocab_size=6000,
            d_model=64,
            nhead=4,
            num_layers=2,
            dim_feedforward=128,
            dropout=0.1,
            explain_away_samples=64,
            threads=1,
        ),
        "paper": dict(
            mechanisms=(*DEFAULT_MECHANISMS, NO_ATTENTION),
            seeds=3,
            steps=1500,
            batch_size=32,
            lr=1e-3,
            warmup_steps=100,
            eval_every=250,
            checkpoint_every=250,
            max_train=None,
            max_eval=None,
            max_len=256,
            vocab_size=20000,
            d_model=128,
            nhead=4,
            num_layers=2,
            dim_feedforward=256,
            dropout=0.1,
            explain_away_samples=128,
        ),
    },
    "seq2seq": {
        "quick": dict(
            mechanisms=("softmax", "coda"),
            seeds=2,
            steps=300,
            batch_size=64,
            lr=2e-3,
            warmup_steps=30,
            eval_every=100,
            checkpoint_every=100,
            max_train=20000,
            max_eval=300,
            max_len=24,
            max_target_len=12,
            vocab_size=64,
            d_model=64,
            nhead=4,
            num_layers=2,
            dim_feedforward=128,
            dropout=0.0,
            explain_away_samples=64,
            threads=1,
        ),
        "paper": dict(
            mechanisms=("softmax", "coda"),
            seeds=1,
            steps=3000,
            batch_size=64,
            lr=1e-3,
            warmup_steps=200,
            eval_every=500,
            checkpoint_every=500,
            max_train=None,
            max_eval=1000,
            max_len=32,
            max_target_len=12,
            vocab_size=64,
            d_model=128,
            nhead=4,
            num_layers=2,
            dim_feedforward=256,
            dropout=0.0,
            explain_away_samples=128,
        ),
    },
    # the recurrent models of the lecture (``mechanisms`` names models here: runner/transduction.py)
    "transduction": {
        "quick": dict(
            mechanisms=DEFAULT_MODELS, seeds=1, steps=300, batch_size=64, lr=3e-3, warmup_steps=20,
            eval_every=100, checkpoint_every=100, max_train=20000, max_eval=500, d_model=128, dropout=0.0,
            weight_decay=0.0, threads=1,
        ),
        "paper": dict(
            mechanisms=DEFAULT_MODELS, seeds=2, steps=3000, batch_size=64, lr=2e-3, warmup_steps=100,
            eval_every=500, checkpoint_every=500, max_train=None, max_eval=2000, d_model=256, dropout=0.0,
            weight_decay=0.0,
        ),
    },
}

# Which preset family a built-in task uses; a dataset file (``--task data.json``) says its own kind.
TASK_KINDS: dict[str, str] = {"reuters8": "classification", "mlu": "seq2seq",
                              **{name: "transduction" for name in TRANSDUCTION_TASKS}}


def _positive_int(
    name: str, value: Any, *, allow_none: bool = False, minimum: int = 1, maximum: Optional[int] = None
) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = " (or null for no cap)" if allow_none else ""
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}{hint}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r}: expected at most {maximum} ({_MAXIMA_WHY[name]})")


# Sizes past which a run fails deep inside torch (an allocation of tens of GB for the position tables,
# OpenMP aborting the process while it starts its threads), not with a message.
_MAXIMA = {"max_len": 2**20, "max_target_len": 2**20, "threads": 1024, "d_model": 2**16,
           "dim_feedforward": 2**20, "vocab_size": 2**24, "num_layers": 1024}
_MAXIMA_WHY = {
    "max_len": "tokens per text; the position tables grow with it",
    "max_target_len": "characters per target; the position tables grow with it",
    "threads": "torch CPU threads per process; null uses torch's default",
    "d_model": "the model width",
    "dim_feedforward": "the feed-forward width",
    "vocab_size": "words kept by the tokenizer",
    "num_layers": "layers",
}
_MAX_PARAMETERS = 2**31  # 8 GiB of float32 weights, before the optimizer's two copies
_FLOAT32_MAX = 3.4028234663852886e38  # torch's optimizers hold lr and weight decay as float32 scalars


@dataclass(frozen=True)
class CompareConfig:
    """Everything that decides the result of ``attnkit compare``.

    ``task``: a built-in task (``reuters8``, ``mlu``) or a dataset file (``.json``/``.jsonl``, see
    ``attnkit.runner.tasks``); ``mechanisms``: names in ``attnkit.MECHANISMS``; ``seeds``: how many seeds
    (``seed``, ``seed + 1``, ...) per mechanism; ``steps``: optimizer steps per run, capped by ``max_steps``;
    ``batch_size``: the global batch (split evenly across processes); ``max_train`` / ``max_eval``: caps on
    the
    number of examples (null = all; a generated transduction task, which has no "all", takes 20000 training
    examples); ``max_len`` / ``max_target_len``: token caps; ``vocab_size``: the largest
    vocabulary kept by the word tokenizer. ``threads``: torch CPU threads per process (null = torch's
    default; the quick presets use 1, which keeps a small or shared CPU from thrashing). ``out``: the run
    directory; ``resume`` continues it,
    ``overwrite`` replaces it.
    """

    task: str = DEFAULT_TASK
    preset: str = "quick"
    mechanisms: tuple[str, ...] = DEFAULT_MECHANISMS
    seeds: int = 2
    seed: int = 0
    steps: int = 150
    max_steps: Optional[int] = None
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 15
    grad_clip: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 50
    max_train: Optional[int] = None
    max_eval: Optional[int] = None
    max_len: int = 64
    max_target_len: int = 12
    vocab_size: int = 6000
    d_model: int = 64
    nhead: int = 4
    num_layers: int = 2
    dim_feedforward: int = 128
    dropout: float = 0.1
    explain_away_samples: int = 64
    out: str = "runs/compare"
    resume: bool = False
    overwrite: bool = False
    threads: Optional[int] = None
    progress: str = "auto"
    plots: bool = True
    log_with: Optional[str] = None
    align: tuple[str, ...] = ("none",)  # alignment attention per mechanism: none, gan, ot, ct, mmd
    align_weight: float = 0.01

    def __post_init__(self) -> None:
        for f in fields(self):  # NumPy scalars (np.int64 seeds, np.float32 lr, np.bool_) as Python values
            value = getattr(self, f.name)
            if type(value).__name__ == "bool" and type(value).__module__ == "numpy":  # np.bool_
                object.__setattr__(self, f.name, bool(value))
                continue
            if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
                continue
            python = int(value) if isinstance(value, numbers.Integral) else float(value)
            object.__setattr__(self, f.name, python)
        _check_align(self)
        if not isinstance(self.task, str) or not self.task:
            from .tasks import expected_tasks

            raise ValueError(f"task={self.task!r}: {expected_tasks()}")
        object.__setattr__(self, "task", canonical_task(self.task))
        if self.task.startswith("~"):  # "task: ~/data/topics.json" in a config file
            object.__setattr__(self, "task", os.path.expanduser(self.task))
        if _is_file_task(self.task):  # saved absolute: show and --resume work from any working directory
            object.__setattr__(self, "task", os.path.abspath(self.task))
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"preset={self.preset!r}: expected one of {PRESET_NAMES}")
        mechanisms = self.mechanisms
        if isinstance(mechanisms, str):
            mechanisms = tuple(m.strip() for m in mechanisms.split(",") if m.strip())
        if not isinstance(mechanisms, (tuple, list)) or not mechanisms:
            raise ValueError(f"mechanisms={self.mechanisms!r}: expected a non-empty list of {MECHANISMS}")
        names = list(check_model_names(mechanisms)) if self.task in TRANSDUCTION_TASKS else []
        for m in mechanisms if self.task not in TRANSDUCTION_TASKS else ():
            if not isinstance(m, str):
                raise ValueError(f"mechanisms contains {m!r}; expected names from {MECHANISMS}")
            if m == NO_ATTENTION:  # the no-attention baseline row (runner/baseline.py)
                names.append(m)
                continue
            try:
                names.append(resolve_mechanism(m).name)
            except ValueError:
                raise ValueError(
                    f"unknown mechanism {m!r} in mechanisms; expected names from "
                    f"{MECHANISMS} or {NO_ATTENTION!r} (the no-attention baseline)"
                ) from None
        if len(set(names)) != len(names):
            raise ValueError(f"mechanisms={list(mechanisms)} names a mechanism twice; list each once")
        aligned = [a for a in self.align if a != "none"]
        kind = task_kind(self.task) if NO_ATTENTION in names or aligned else None  # may read a dataset file
        if NO_ATTENTION in names and kind == "seq2seq":
            raise ValueError(
                f"mechanism {NO_ATTENTION!r} (the no-attention baseline) is for classification tasks; "
                f"drop it from mechanisms for task {self.task!r}"
            )
        if aligned and kind == "transduction":
            raise ValueError(
                f"align={list(self.align)}: the models of task {self.task!r} are recurrent encoder-decoders "
                "without self-attention, which alignment attention regularizes; drop align (or use a "
                "classification or seq2seq task)"
            )
        if aligned and names and all(n == NO_ATTENTION for n in names):  # ran unaligned, recorded aligned
            raise ValueError(
                f"align={list(self.align)}: mechanism {NO_ATTENTION!r} (the no-attention baseline) has no "
                "attention to align; add a mechanism to align, or drop align"
            )
        object.__setattr__(self, "mechanisms", tuple(names))
        _positive_int("seeds", self.seeds)
        _positive_int("seed", self.seed, minimum=0)
        if self.seed + self.seeds - 1 > SEED_MAX:  # checked here: run 1 trained before run 2's seed failed
            raise ValueError(
                f"seed={self.seed} with seeds={self.seeds} runs seeds up to {self.seed + self.seeds - 1}; "
                f"the last must be at most 2**32 - 1 = {SEED_MAX} (NumPy's limit); lower seed"
            )
        for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "max_len", "max_target_len",
                     "vocab_size", "d_model", "nhead", "num_layers", "dim_feedforward",
                     "explain_away_samples"):
            _positive_int(name, getattr(self, name), maximum=_MAXIMA.get(name))
        if self.vocab_size < 2:  # checked here: the tokenizer refused it after loading the data, as max_vocab
            raise ValueError(f"vocab_size={self.vocab_size}: expected an integer >= 2 (it counts <pad> and "
                             "<unk>)")
        for name in ("max_steps", "max_train", "max_eval", "threads"):
            _positive_int(name, getattr(self, name), allow_none=True, maximum=_MAXIMA.get(name))
        _positive_int("warmup_steps", self.warmup_steps, minimum=0)
        d, ff = self.d_model, self.dim_feedforward
        weights = self.vocab_size * d + self.num_layers * (4 * d * d + 2 * d * ff) + self.max_len * d
        if weights > _MAX_PARAMETERS:  # a failed allocation deep in torch, with a traceback, otherwise
            raise ValueError(
                f"vocab_size={self.vocab_size}, d_model={d}, num_layers={self.num_layers}, "
                f"dim_feedforward={ff} and max_len={self.max_len} make a model of about {weights:.3g} "
                "weights, more than "
                f"{_MAX_PARAMETERS:.3g} (8 GiB in float32); make it smaller"
            )
        if TASK_KINDS.get(self.task) == "transduction" and (self.d_model < 2 or self.d_model % 2):
            raise ValueError(  # before the run folder is written: the models' own check came after it
                f"d_model={self.d_model}: the recurrent models of task {self.task!r} take a two-way encoder "
                "of d_model / 2 per direction and embeddings of d_model / 2; pass an even d_model >= 2"
            )
        if self.d_model % self.nhead and TASK_KINDS.get(self.task) != "transduction":  # recurrent: no heads
            raise ValueError(
                f"d_model={self.d_model} is not divisible by nhead={self.nhead}; pick a "
                "multiple"
            )
        for name, low, high in (("lr", 0.0, _FLOAT32_MAX), ("weight_decay", -1e-12, _FLOAT32_MAX),
                                ("grad_clip", 0.0, _FLOAT32_MAX), ("dropout", -1e-12, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low < value < high:
                span = f"{'[' if low < 0 else '('}{max(low, 0):g}, {high:.4g})"  # [0, ...): 0 is allowed
                raise ValueError(f"{name}={value!r}: expected a finite number in {span}")
        for name in ("resume", "overwrite", "plots"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        if self.resume and self.overwrite:
            raise ValueError(
                "resume and overwrite exclude each other: --resume continues a run, "
                "--overwrite replaces it"
            )
        if self.progress not in PROGRESS:
            raise ValueError(f"progress={self.progress!r}: expected one of {PROGRESS}")
        if self.log_with is not None and self.log_with not in TRACKERS:
            raise ValueError(f"log_with={self.log_with!r}: expected one of {TRACKERS} (or leave it unset)")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"out={self.out!r}: expected a directory path")
        object.__setattr__(self, "out", os.path.expanduser(self.out))  # "out: ~/runs" in a config file

    @property
    def total_steps(self) -> int:
        """Optimizer steps of each run: ``steps``, capped by ``max_steps``."""
        return min(self.steps, self.max_steps) if self.max_steps is not None else self.steps

    @property
    def variants(self) -> tuple[str, ...]:
        """The run labels: each mechanism with each alignment method (``dnas+ct``; ``none`` keeps
        ``dnas``). The no-attention baseline ``none`` has no attention to align: it runs once, as
        ``none``."""
        labels: list[str] = []
        for m in self.mechanisms:
            if m == "none":
                labels.append(m)
            else:
                labels.extend(m if a == "none" else f"{m}+{a}" for a in self.align)
        return tuple(labels)

    @property
    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.seeds))

    def to_dict(self) -> dict:
        data = asdict(self)
        data["mechanisms"] = list(self.mechanisms)
        data["align"] = list(self.align)
        return data

    def result_dict(self) -> dict:
        """The keys that decide the results (not where they go or how progress is shown)."""
        data = self.to_dict()
        for key in ("out", "resume", "overwrite", "progress", "plots", "log_with"):
            data.pop(key)
        return data


def _check_align(config) -> None:
    """``align``: a comma-separated string or list of ``none`` and alignment methods, each once."""
    from ..align.regularizer import METHODS as ALIGN_METHODS

    align = config.align
    if isinstance(align, str):
        align = tuple(a.strip() for a in align.split(",") if a.strip())
    if not isinstance(align, (tuple, list)) or not align:
        raise ValueError(
            f"align={config.align!r}: expected a non-empty list of none, {', '.join(ALIGN_METHODS)}"
        )
    for a in align:
        if a != "none" and a not in ALIGN_METHODS:
            raise ValueError(f"align contains {a!r}; expected none or one of {ALIGN_METHODS}")
    if len(set(align)) != len(align):
        raise ValueError(f"align={list(align)} names a method twice; list each once")
    object.__setattr__(config, "align", tuple(align))
    w = config.align_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
        raise ValueError(f"align_weight={w!r}: expected a finite number >= 0 (0.01 in the paper)")


def config_keys() -> list[str]:
    return [f.name for f in fields(CompareConfig)]


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    valid = config_keys()
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown configuration key(s) {unknown} in {source}; valid keys: "
            f"{', '.join(valid)}"
        )


def load_config_file(path: str | Path) -> dict:
    """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON file of configuration keys.

    Dashes in keys are accepted for underscores (``max-steps``), as on the command line.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"configuration file {str(path)!r} is a folder, not a file; pass the path of the "
            ".yaml/.yml/.toml/.json file"
        )
    if not path.is_file():
        raise FileNotFoundError(f"configuration file {str(path)!r} not found")
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ValueError(f"configuration file {str(path)!r}: expected a .yaml, .yml, .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Notepad's UTF-8) is allowed
        if suffix in (".yaml", ".yml"):
            data = yaml_load(text)
        elif suffix == ".toml":  # tomllib refuses a key given twice itself
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json_loads(text, object_pairs_hook=_unique_pairs)
    except ImportError:
        raise
    except _DuplicateKeyError as exc:  # the last value would silently win
        raise ValueError(f"configuration file {str(path)!r}: {exc}; give each key once") from None
    except Exception as exc:  # yaml.YAMLError, TOMLDecodeError, JSONDecodeError, not UTF-8: name the file
        raise ValueError(
            f"configuration file {str(path)!r} does not parse: "
            f"{' '.join(str(exc).split())}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(
            f"configuration file {str(path)!r} must hold a mapping of keys to values, got "
            f"{type(data).__name__}"
        )
    spelled: dict = {}
    for key in data:  # max-steps and max_steps are one key
        spelled.setdefault(str(key).replace("-", "_"), []).append(str(key))
    for name, keys in spelled.items():
        if len(keys) > 1:
            raise ValueError(
                f"configuration file {str(path)!r}: {' and '.join(repr(k) for k in keys)} are the same key "
                f"{name!r} (a dash reads as an underscore); give each key once"
            )
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if suffix in (".yaml", ".yml"):
        data = {k: yaml_number(v) for k, v in data.items()}
    _check_keys(data, repr(str(path)))
    return data


class _DuplicateKeyError(ValueError):
    """A mapping of a configuration file gives one key twice."""


def _unique_pairs(pairs: list) -> dict:
    """``json`` ``object_pairs_hook``: the object as a dict, refusing a key given twice."""
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKeyError(f"key {key!r} is given twice")
        data[key] = value
    return data


def yaml_load(text: str):
    """``yaml.safe_load`` with YAML 1.2's numbers: PyYAML reads YAML 1.1, where ``010`` is octal 8, ``0x10``
    is 16 and ``1:00`` is 60 (base 60); here an integer is decimal (``010`` is 10) and those forms are text,
    which the keys' checks then refuse by name. A key given twice in a mapping is a ``ValueError``."""
    import yaml

    return yaml.load(text, Loader=_decimal_loader())  # noqa: S506 (a SafeLoader subclass)


@functools.lru_cache(maxsize=None)
def _decimal_loader():
    import yaml

    int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"

    class DecimalLoader(yaml.SafeLoader):
        yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in resolvers if tag not in (int_tag, float_tag)]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }

    DecimalLoader.add_implicit_resolver(int_tag, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    DecimalLoader.add_implicit_resolver(
        float_tag,
        re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$"
                   r"|^\.(nan|NaN|NAN)$"),
        list("-+0123456789."),
    )
    DecimalLoader.add_constructor(int_tag, lambda loader, node: int(loader.construct_scalar(node)))

    def construct_mapping(loader, node, deep=False):  # PyYAML keeps the last value of a repeated key
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: keys given again override it
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if repeated:
                raise _DuplicateKeyError(f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    DecimalLoader.construct_mapping = construct_mapping
    return DecimalLoader


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+|[-+]?\.\d+")  # 1e-3, +.5: text in YAML 1.1


def yaml_number(value: Any) -> Any:
    """A number YAML 1.1 (PyYAML) reads as text, such as ``1e-3`` (no dot), as a float; anything else as
    given."""
    if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


def canonical_task(task: str) -> str:
    """A built-in task or catalog dataset by its lower-case name (``G2P`` is ``g2p``, as ``Reuters8`` is
    ``reuters8``); a dataset file as given."""
    from ..data import DATASETS

    key = task.lower()
    return key if key in TASK_KINDS or key in DATASETS else task


def _is_file_task(task: str) -> bool:
    """``task`` names a dataset file (not a built-in task or a catalog dataset)."""
    from ..data import DATASETS

    return task not in TASK_KINDS and task.lower() not in DATASETS


def task_kind(task: str) -> str:
    """``"classification"`` or ``"seq2seq"`` for a built-in task or a dataset file."""
    if task in TASK_KINDS:
        return TASK_KINDS[task]
    from ..data import DATASETS

    if task.lower() in DATASETS:
        return "seq2seq" if DATASETS[task.lower()].kind == "seq2seq" else "classification"
    from .dataset_file import (
        file_task_kind,
    )  # a dataset file declares its kind; anything else is an unknown task

    return file_task_kind(task)


def preset_values(task: str, preset: str) -> dict:
    return _kind_and_preset(task, preset)[1]


def _kind_and_preset(task: str, preset: str) -> tuple[str, dict]:
    """The task's kind and its preset's values (a dataset file is read once for both)."""
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset={preset!r}: expected one of {PRESET_NAMES}")
    kind = task_kind(task)
    return kind, dict(PRESETS[kind][preset])


def build_config(
    overrides: Optional[Mapping[str, Any]] = None,
    *,
    file: Optional[str | Path] = None,
    base: Optional[Mapping[str, Any]] = None,
    keep_none: bool = False,
) -> CompareConfig:
    """Merge preset < ``base`` < ``file`` < ``overrides``.

    ``None`` in ``overrides`` means "not given" (the key keeps its earlier value) unless ``keep_none``,
    where it is the value itself (``null``: e.g. ``max_train=None``, no cap), as the command line passes
    ``--set KEY=null`` and a file's ``KEY: null``.
    """
    values: dict[str, Any] = {}
    user: dict[str, Any] = {}  # what the user gave now (not a saved run's configuration)
    if base:
        _check_keys(base, "the saved run configuration")
        values.update(base)
    if file is not None:
        user.update(load_config_file(file))
    if overrides:
        given = {k.replace("-", "_"): v for k, v in overrides.items() if keep_none or v is not None}
        _check_keys(given, "the command line")
        user.update(given)
    values.update(user)
    task = values.get("task", DEFAULT_TASK)
    preset = values.get("preset", "quick")
    if not isinstance(task, str) or not task:
        from .tasks import expected_tasks

        raise ValueError(f"task={task!r}: {expected_tasks()}")
    task = values["task"] = canonical_task(task)
    kind, preset_dict = _kind_and_preset(task, preset)  # an unknown task or a bad dataset file: refused
    _check_unused_keys(task, kind, user, preset_dict)
    merged = {**preset_dict, **values}
    config = CompareConfig(**merged)
    weight = user.get("align_weight", CompareConfig.align_weight)
    if config.align == ("none",) and weight != CompareConfig.align_weight:
        raise ValueError(  # recorded in results.json and ignored
            f"align_weight={weight!r} weighs alignment attention, and align is none; pass --align (ct, gan, "
            "ot or mmd), or drop align_weight"
        )
    return config


# Per task kind, the settings its task never reads, and why: the recurrent models of the transduction tasks
# take d_model (runner/transduction.py); a seq2seq task's CharTokenizer keeps every character of the data
# but the display marks (runner/tasks.py Seq2SeqTask.prepare), so no vocab_size caps it; a classifier has no
# target length
_UNUSED_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "transduction": (
        ("nhead", "num_layers", "dim_feedforward", "dropout", "max_len", "max_target_len", "vocab_size",
         "explain_away_samples"),
        "its recurrent models take d_model (and the training settings) only",
    ),
    "seq2seq": (
        ("vocab_size",),
        "its character vocabulary is every character of the data, with no cap",
    ),
    "classification": (("max_target_len",), "a classifier predicts a label, no target sequence"),
}


def _check_unused_keys(task: str, kind: str, given: Mapping[str, Any], preset: Mapping[str, Any]) -> None:
    """A setting the user gave that a task of ``kind`` never reads is refused, not recorded and ignored
    (the value the task's preset or the config's default holds anyway, as a saved run's file does,
    passes)."""
    keys, why = _UNUSED_KEYS.get(kind, ((), ""))
    defaults = {**{f.name: f.default for f in fields(CompareConfig)}, **preset}
    ignored = [k for k in keys if k in given and given[k] != defaults.get(k)]
    if ignored:
        verb, them = ("do not apply", "them") if len(ignored) > 1 else ("does not apply", "it")
        raise ValueError(f"{', '.join(ignored)} {verb} to task {task!r}: {why}; drop {them}")
