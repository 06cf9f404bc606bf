"""Checks of a model directory before transformers reads it, so that a broken one is one readable error.

Model directories are downloaded and shared, so they are read as hostile: weights load from safetensors only
(a ``pytorch_model.bin`` is a pickle, which can run code, and is refused), and a missing, empty, truncated or
garbage file, invalid JSON or a field of the wrong type raises a ``ValueError`` / ``FileNotFoundError`` that
names the file and the problem instead of a traceback from deep inside transformers.

The attnkit conversion record (``"attnkit"`` in ``config.json``, written by ``attnkit.hf.convert``) is checked
too: its fields, its mechanism and options, and that it matches the weights (the hnas ``attnkit_theta`` of
each recorded module, and no other), so that a lost or edited record never loads silently as another
mechanism.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from typing import Any

from .._files import json_loads

__all__ = ["check_model_dir", "from_pretrained", "load_tokenizer", "weights_file", "WEIGHTS", "WEIGHTS_INDEX"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_RESTORE_RECORD = "restore config.json from the directory that save_pretrained wrote after attnkit.hf.convert"
_MATCHING_PAIR = "the two files are not from one save_pretrained; restore the matching pair"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _short(value: Any) -> str:
    """``repr(value)`` cut to about 40 characters (a config field can be anything)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 40
    return short.repr(value)


def _check_file(path: str) -> None:
    if os.path.exists(path) and not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is not a regular file (a directory?); restore the file from the original model"
        )


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json_loads(f.read())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         "restore it from the original model") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ValueError(
            f"{path} cannot be read ({_first_line(exc)}); restore it from the original model"
        ) from None


def _check_safetensors(path: str) -> list[str]:
    """The tensor names of the safetensors file ``path``, after checking that it is complete."""
    from safetensors import safe_open

    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty; restore it from the original model")
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # SafetensorError: truncated, garbage, not safetensors
        raise ValueError(f"{path} is not a complete safetensors file ({_first_line(exc)}); "
                         "restore it from the original model") from None


def weights_file(path: str) -> str:
    """The file that names the weights of the model directory ``path``, for messages: ``model.safetensors``,
    or the index of a sharded save when there is no single file (as transformers reads them)."""
    single = os.path.join(path, WEIGHTS)
    index = os.path.join(path, WEIGHTS_INDEX)
    return index if not os.path.isfile(single) and os.path.isfile(index) else single


def _check_weights(path: str) -> tuple[str, list[str]]:
    """``(weights file, tensor names)`` of the model directory ``path`` (the index file when sharded).

    The single file comes first, as transformers loads it: a folder saved over a sharded save keeps the old
    index beside the new ``model.safetensors`` (the old shards are deleted), and the index was checked."""
    index = os.path.join(path, WEIGHTS_INDEX)
    single = os.path.join(path, WEIGHTS)
    _check_file(single)
    if os.path.isfile(single):
        return single, _check_safetensors(single)
    _check_file(index)
    if os.path.isfile(index):
        payload = _read_json(index)
        shards = payload.get("weight_map") if isinstance(payload, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
            raise ValueError(f"{index} has no 'weight_map' of tensor names to file names; restore it")
        for shard in sorted(set(shards.values())):
            file = os.path.join(path, shard)
            if os.path.basename(shard) != shard or not os.path.isfile(file):
                raise FileNotFoundError(
                    f"{index} names the weight file {shard!r}, which is not in {path}; restore the shard (or "
                    "the index) from the original model"
                )
            _check_safetensors(file)
        return index, list(shards)
    pickled = [n for n in _PICKLE_WEIGHTS if os.path.isfile(os.path.join(path, n))]
    if pickled:
        raise FileNotFoundError(
            f"{path} holds its weights only as {pickled[0]}, a pickle file that attnkit does not load "
            f"(it can run code); convert it to {WEIGHTS} where you trust it "
            "(model.save_pretrained(dir) writes safetensors)"
        )
    raise FileNotFoundError(
        f"{path} has no {WEIGHTS}; restore it from the original model or pass a directory written by "
        "save_pretrained"
    )


def _check_record(config: dict, config_path: str, weights: str, tensors: list[str]) -> None:
    """The attnkit conversion record of ``config`` (parsed ``config_path``) against the tensor names of
    ``weights``: valid fields, a known mechanism with valid options, and ``attnkit_theta`` exactly for the
    modules of an hnas record."""
    from ..config import Hybrid
    from ..registry import resolve_mechanism
    from .attention_interface import _THETA_ATTR, IMPLEMENTATION
    from .convert import CONFIG_KEY

    suffix = "." + _THETA_ATTR
    thetas = sorted(name[: -len(suffix)] for name in tensors if name.endswith(suffix))  # module paths
    record = config.get(CONFIG_KEY)
    if record is None or record == {}:  # read as "not converted" by attnkit.hf.conversion
        if thetas:
            raise ValueError(
                f"{config_path} has no attnkit conversion record ({CONFIG_KEY!r}) but {weights} holds the "
                f"{_THETA_ATTR} of {len(thetas)} converted module(s) ({thetas[0]}); {_RESTORE_RECORD}"
            )
        if config.get("attn_implementation") == IMPLEMENTATION:
            raise ValueError(
                f"{config_path} asks for attn_implementation={IMPLEMENTATION!r} but has no attnkit "
                f"conversion record ({CONFIG_KEY!r}); {_RESTORE_RECORD}, or delete \"attn_implementation\" "
                "from it to load the model with softmax attention"
            )
        return
    where = f"{config_path}: the attnkit conversion record {CONFIG_KEY!r}"
    if not isinstance(record, dict):
        raise ValueError(
            f"{where} is {_short(record)}, expected an object "
            f"{{\"mechanism\": ..., \"options\": {{...}}, \"modules\": [...]}}; {_RESTORE_RECORD}"
        )
    for field in ("mechanism", "modules"):
        if field not in record:
            raise ValueError(f"{where} has no {field!r} field; {_RESTORE_RECORD}")
    mechanism, options, modules = record["mechanism"], record.get("options", {}), record["modules"]
    if not isinstance(mechanism, str):
        raise ValueError(
            f"{where} has mechanism={_short(mechanism)}, expected a mechanism name such as 'hnas'; "
            f"{_RESTORE_RECORD}"
        )
    if not isinstance(options, dict):
        raise ValueError(
            f"{where} has options={_short(options)}, expected an object of the mechanism's options such as "
            f"{{\"u0\": 0.5}}; {_RESTORE_RECORD}"
        )
    try:
        resolved = resolve_mechanism(mechanism, **options)
    except (ValueError, TypeError) as exc:
        from ..config import MAX_SINKHORN_ITERS

        iters = options.get("iters")
        if mechanism == "sinkhorn" and isinstance(iters, int) and iters > MAX_SINKHORN_ITERS:  # saved before
            raise ValueError(  # the limit: the file is as written, and only its value needs lowering
                f"{where} has iters={iters}; attnkit takes at most {MAX_SINKHORN_ITERS} Sinkhorn rounds (far "
                f"past convergence): set \"iters\" in {config_path} to {MAX_SINKHORN_ITERS} or less"
            ) from None
        raise ValueError(f"{where} is invalid ({_first_line(exc)}); {_RESTORE_RECORD}") from None
    if (
        not isinstance(modules, list)
        or not modules
        or not all(isinstance(m, str) and m for m in modules)
        or len(set(modules)) != len(modules)
    ):
        raise ValueError(
            f"{where} has modules={_short(modules)}, expected a non-empty list of distinct attention module "
            f"names such as 'encoder.layer.0.attention.self'; {_RESTORE_RECORD}"
        )

    def owner(path: str):  # weights of a head model prefix the base model's module names
        return next((m for m in modules if path == m or path.endswith("." + m)), None)

    if thetas and all(owner(t) is None for t in thetas):
        # a checkpoint layout that transformers renames on load (ViT's file holds encoder.layer.N.attention
        # for the layers.N.attention that the record names): the owners by their layer indices, where those
        # tell the recorded modules apart
        def indices(path: str) -> tuple[int, ...]:
            return tuple(int(part) for part in path.split(".") if part.isdigit())

        by_indices: dict = {}
        for m in modules:
            by_indices.setdefault(indices(m), []).append(m)
        if all(len(names) == 1 for names in by_indices.values()):
            def owner(path: str):  # noqa: F811 (the renamed layout's reading)
                found = by_indices.get(indices(path), [None])[0]
                # the same module under its saved name: the same indices and the same last part
                # (encoder.layer.0.attention for layers.0.attention, not encoder.layer.0.output)
                return found if found is not None and path.split(".")[-1] == found.split(".")[-1] else None

    if isinstance(resolved, Hybrid):
        owners = {owner(t) for t in thetas}
        missing = [m for m in modules if m not in owners]
        if missing:
            raise ValueError(
                f"{config_path} records an hnas conversion of {missing[0]} but {weights} has no "
                f"{_THETA_ATTR} for it; {_MATCHING_PAIR}"
            )
    stray = [t for t in thetas if not isinstance(resolved, Hybrid) or owner(t) is None]
    if stray:
        raise ValueError(
            f"{weights} holds {stray[0]}{suffix}, which the {mechanism!r} conversion recorded in "
            f"{config_path} does not have; {_MATCHING_PAIR}"
        )


def _check_restored(model, config_path: str) -> None:
    """After the build: every module of the record is a convertible attention module of ``model`` and was
    converted, and the mechanism may run on it (no query-normalized mechanism on causal attention)."""
    from ..registry import causal_problem, config_label
    from .attention_interface import _MECHANISM_ATTR
    from .convert import CONFIG_KEY, attention_modules, conversion

    mechanism = conversion(model)
    if mechanism is None:
        return
    names = getattr(model.config, CONFIG_KEY)["modules"]
    convertible = dict(attention_modules(model))
    for name in names:
        if name not in convertible or not hasattr(convertible[name], _MECHANISM_ATTR):
            known = ", ".join(list(convertible)[:2]) + (", ..." if len(convertible) > 2 else "")
            raise ValueError(
                f"{config_path}: the attnkit conversion record names {name!r}, which is not a convertible "
                f"attention module of {type(model).__name__} ({len(convertible)} such: {known or 'none'}); "
                f"{_RESTORE_RECORD}"
            )
    problem = causal_problem(mechanism)
    causal = [n for n in names if getattr(convertible[n], "is_causal", False)]
    if problem is not None and causal:
        raise ValueError(
            f"{config_path}: the attnkit conversion record puts causal self-attention ({causal[0]}) under "
            f"{config_label(mechanism)!r}: {problem.rstrip('.')}; {_RESTORE_RECORD}"
        )


def check_model_dir(path: str | os.PathLike, option: str = "model directory") -> dict:
    """Validate ``path`` (``config.json``, safetensors weights, the attnkit conversion record) and return
    the parsed ``config.json``.

    ``option`` names the argument in the messages (``"MODEL_DIR"``, ``"--model"``).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        parent = os.path.dirname(os.path.abspath(path))
        hint = f" {parent}" if os.path.basename(path) in ("config.json", WEIGHTS, WEIGHTS_INDEX) else ""
        raise FileNotFoundError(
            f"{option} {path} is a file, not a directory; pass the directory{hint} that save_pretrained "
            f"wrote (config.json and {WEIGHTS})"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{option} {path} does not exist; pass a directory written by save_pretrained "
            f"(config.json and {WEIGHTS})"
        )
    config_path = os.path.join(path, "config.json")
    _check_file(config_path)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{option} {path} has no config.json; restore it from the original model or pass a directory "
            "written by save_pretrained"
        )
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(
            f"{config_path} holds a {type(config).__name__}, expected a JSON object of settings; restore it "
            "from the original model"
        )
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(
            f"{config_path}: model_type={model_type!r}, expected a string such as 'bert'; restore it from "
            "the original model"
        )
    weights, tensors = _check_weights(path)
    _check_record(config, config_path, weights, tensors)
    return config


def auto_config(path: str | os.PathLike, **kwargs):
    """``transformers.AutoConfig.from_pretrained`` with its errors turned into one line naming config.json."""
    import transformers

    config_path = os.path.join(os.fspath(path), "config.json")
    try:
        return transformers.AutoConfig.from_pretrained(os.fspath(path), **kwargs)
    except Exception as exc:  # transformers raises many types for one bad file (strict-dataclass errors too)
        raise ValueError(
            f"{config_path} is not a valid model configuration ({_first_line(exc)}); restore it from the "
            "original model"
        ) from None


def from_pretrained(
    model_class, path: str | os.PathLike, option: str = "model directory", *, caller_options: bool = False,
    **kwargs,
):
    """``model_class.from_pretrained(path, use_safetensors=True, **kwargs)`` after ``check_model_dir``.

    A failure while building the model or loading its weights is one ``ValueError`` naming the file, and so
    is an attnkit conversion record that names modules the built model does not have. With
    ``caller_options`` the ``kwargs`` are the caller's own choices, and a failure names them first.
    """
    path = os.fspath(path)
    check_model_dir(path, option)
    auto_config(path)
    config_path = os.path.join(path, "config.json")
    weights = weights_file(path)
    try:
        result = model_class.from_pretrained(path, use_safetensors=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a hostile directory can fail anywhere in transformers
        from .convert import _ImplementationConflict

        if isinstance(exc, _ImplementationConflict):
            raise ValueError(str(exc)) from None
        named = {k: v for k, v in kwargs.items() if k != "output_loading_info"}  # a report, never the cause
        raise _load_error(exc, config_path, weights, named if caller_options else {}) from None
    _check_restored(result[0] if isinstance(result, tuple) else result, config_path)  # output_loading_info
    return result


def _layer_pattern(key: str) -> str:
    """``encoder.layer.3.attention.self.query.weight`` -> ``encoder.layer.#.attention.self.query.weight``."""
    return re.sub(r"\.\d+(?=\.)", ".#", key)


def damaged_keys(model, info: dict, heads: bool = True) -> list[str]:
    """The tensors of ``from_pretrained(..., output_loading_info=True)``'s report that say the weights and
    config.json disagree, not that a part was never saved: a missing tensor of a module whose other tensors
    loaded (a deleted query weight), a missing tensor of a repeated layer the weights hold elsewhere (a layer
    more in config.json), an unexpected tensor of such a layer (a layer fewer), a missing parameter of the
    base model (its embeddings, a final norm), a missing tensor of the task head(s) when some of their own
    tensors loaded (an LM head's bias, a prediction head's transform, a classifier beside its
    pre_classifier; also one of two pre-training heads). The heads or the pooler missing whole (an encoder
    saved without its task head) are not: transformers starts them afresh, as meant. ``heads=False`` leaves
    the task heads out of the check (a classifier to be trained anew: its head is the caller's)."""
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    state = model.state_dict()
    built = set(state)
    loaded = built - missing
    owners: dict = {}
    for key, tensor in state.items():
        owners.setdefault((tensor.data_ptr(), tensor.shape), []).append(key)
    # tied tensors, e.g. an LM head's decoder weight and the word embeddings
    aliases = {k: keys for keys in owners.values() if len(keys) > 1 for k in keys}
    loaded_modules = {k.rpartition(".")[0] for k in loaded - set(aliases)}
    loaded_layers = {_layer_pattern(k) for k in loaded}
    built_layers = {_layer_pattern(k) for k in built}
    params = {name for name, _ in model.named_parameters()}
    prefix = getattr(model, "base_model_prefix", "")
    headed = getattr(model, "base_model", model) is not model and bool(prefix)

    def inner(key: str):  # the name inside the base model, None for a task head's tensor
        return key[len(prefix) + 1:] if headed and key.startswith(prefix + ".") else None if headed else key

    def in_base(key: str) -> bool:  # a parameter of the encoder itself, not of a task head or the pooler
        name = inner(key)
        return name is not None and key in params and not name.startswith("pooler.")

    def head(key: str):  # "head" for a tensor of the task head(s) outside the base model, else None: one
        # group, since a head spans several top-level names (DistilBERT's vocab_transform .. vocab_projector,
        # pre_classifier and classifier)
        return "head" if inner(key) is None else None

    def own(key: str) -> bool:  # loaded from the head's own tensors: not an alias of another part's
        group = aliases.get(key, (key,))
        return all(head(k) == head(key) and k not in missing for k in group)

    saved_heads = {head(k) for k in loaded if head(k) is not None and own(k)} if heads else set()
    bad = [k for k in missing if k.rpartition(".")[0] in loaded_modules or _layer_pattern(k) in loaded_layers
           or in_base(k) or head(k) in saved_heads]
    bad += [k for k in unexpected if _layer_pattern(k) in built_layers]
    return sorted(bad)


# from_pretrained options that load the same shapes (dtypes, placement, loading): a size mismatch under them
# is the files' own
_LOADER_OPTIONS = frozenset({
    "dtype", "torch_dtype", "device_map", "low_cpu_mem_usage", "attn_implementation", "output_loading_info",
    "ignore_mismatched_sizes", "use_safetensors", "local_files_only", "revision", "trust_remote_code",
    "cache_dir", "force_download", "subfolder", "offload_folder", "offload_state_dict", "max_memory",
    "key_mapping", "weights_only", "tp_plan", "quantization_config",
})


def _load_error(exc: Exception, config_path: str, weights: str, kwargs: dict) -> ValueError:
    """The one-line error of a failed ``from_pretrained``: the caller's options are named first when there
    are any (``num_labels=5`` against a saved 3-label head is the caller's choice, not damaged files)."""
    options = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    mismatch = "mismatched_sizes" in str(exc) or "size mismatch" in str(exc)
    sizing = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in _LOADER_OPTIONS)
    if mismatch and sizing:  # an option that sets sizes (num_labels, vocab_size, ...) may be the cause
        return ValueError(
            f"{weights} does not fit the model that {config_path} builds with {sizing}: some tensors have "
            "other shapes; pass ignore_mismatched_sizes=True to start those layers afresh (e.g. a new "
            "classification head for another num_labels), or leave the options out"
        )
    if mismatch:
        return ValueError(
            f"{weights} holds tensors whose shapes differ from the sizes in {config_path}; restore the "
            "matching pair of files"
        )
    if options:
        return ValueError(
            f"cannot build the model of {config_path} with {options} ({_first_line(exc)}); check those "
            "options"
        )
    if isinstance(exc, (TypeError, AttributeError)):  # a setting of a wrong type reaches a layer constructor
        return ValueError(
            f"{config_path}: a setting has the wrong type or value ({_first_line(exc)}); restore it from the "
            "original model"
        )
    return ValueError(
        f"cannot build the model of {config_path} and load {weights} ({_first_line(exc)}); restore the "
        "matching pair of files from the original model"
    )


# files of which any one means a folder holds a tokenizer (of one kind or another)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "added_tokens.json",
    "spm.model",  # DeBERTa-v2's sentencepiece model
)


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds any tokenizer file (whether it loads is :func:`load_tokenizer`'s
    question)."""
    return any(os.path.isfile(os.path.join(os.fspath(path), name)) for name in TOKENIZER_FILES)


_NO_TOKENIZER = (
    "for a text model, save its tokenizer there with tokenizer.save_pretrained(...) (show, which draws "
    "attention over a text, and finetune read text through it; a model without one, a vision model, cannot "
    "be used by them)"
)


def separated_pairs(tokenizer, texts: list[str], pairs: list[str]) -> tuple[list[str], list[str]]:
    """Sentence pairs as ``tokenizer(texts, pairs)`` should read them: as given where the tokenizer's pair
    template puts something between the two (BERT's ``[SEP]``, RoBERTa's ``</s></s>``), else with the
    tokenizer's separator (its ``sep_token``, else its ``eos_token``) between them: a GPT-2 tokenizer joins a
    pair with nothing between ("the deer" + "a goat" read "the deera goat"). The separator goes where
    truncation does not cut (``longest_first`` cuts each text's end, or with ``truncation_side="left"`` its
    start): at the start of the second text, or at the end of the first. ``attnkit finetune`` and ``attnkit
    show`` encode pairs through this, so a fine-tune is drawn as it was trained."""
    texts, pairs = list(texts), list(pairs)
    if tokenizer.num_special_tokens_to_add(pair=True) > tokenizer.num_special_tokens_to_add(pair=False):
        return texts, pairs
    sep = tokenizer.sep_token or tokenizer.eos_token or " "
    if getattr(tokenizer, "truncation_side", "right") == "left":
        return [f"{a}{sep}" for a in texts], pairs
    return texts, [f"{sep}{b}" for b in pairs]


def load_tokenizer(path: str | os.PathLike, option: str = "model directory"):
    """``AutoTokenizer.from_pretrained(path)``, refusing a directory without tokenizer files.

    For such a directory transformers builds a tokenizer of the model's type with an empty vocabulary (a BERT
    one holds its 5 special tokens, and every word becomes ``[UNK]``), which would train or draw on nothing
    without a word; a vision model (DeiT) has no tokenizer files at all. Files that cannot be loaded are one
    ``ValueError`` too.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - broken tokenizer files fail in many ways
        found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
        if not found:  # a vision model (DeiT, BEiT, ...) has none: there is nothing broken to restore
            raise ValueError(f"{option} {path} has no tokenizer files; {_NO_TOKENIZER}") from None
        raise ValueError(
            f"{option} {path}: its tokenizer files ({', '.join(found)}) cannot be loaded "
            f"({_first_line(exc)}); restore them from the original model (tokenizer.save_pretrained(...))"
        ) from None
    names = sorted(set(getattr(tokenizer, "vocab_files_names", {}).values()))
    # a fast tokenizer's tokenizer.json holds its whole vocabulary; GPT-2's class names only vocab.json and
    # merges.txt, which its save_pretrained no longer writes
    whole = getattr(tokenizer, "is_fast", False) and os.path.isfile(os.path.join(path, "tokenizer.json"))
    if names and not whole and not any(os.path.isfile(os.path.join(path, name)) for name in names):
        raise ValueError(f"{option} {path} has no tokenizer files ({' or '.join(names)}); {_NO_TOKENIZER}")
    return tokenizer
