"""Checks of a model directory before transformers reads it, so that a broken one is one readable error.

Model directories are downloaded and shared, so they are read as hostile: weights load from safetensors only
(a ``pytorch_model.bin`` is a pickle, which can run code, and is refused), and a missing, empty, truncated or
garbage file, invalid JSON or a field of the wrong type raises a ``ValueError`` / ``FileNotFoundError`` that
names the file and the problem instead of a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["check_model_dir", "from_pretrained", "WEIGHTS", "WEIGHTS_INDEX"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         "restore it from the original model") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ValueError(
            f"{path} cannot be read ({_first_line(exc)}); restore it from the original model"
        ) from None


def _check_safetensors(path: str) -> None:
    from safetensors import safe_open

    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty; restore it from the original model")
    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError: truncated, garbage, not safetensors
        raise ValueError(f"{path} is not a complete safetensors file ({_first_line(exc)}); "
                         "restore it from the original model") from None


def _check_weights(path: str) -> None:
    index = os.path.join(path, WEIGHTS_INDEX)
    single = os.path.join(path, WEIGHTS)
    if os.path.isfile(index):
        payload = _read_json(index)
        shards = payload.get("weight_map") if isinstance(payload, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
            raise ValueError(f"{index} has no 'weight_map' of tensor names to file names; restore it")
        for shard in sorted(set(shards.values())):
            file = os.path.join(path, shard)
            if os.path.basename(shard) != shard or not os.path.isfile(file):
                raise FileNotFoundError(f"{index} names the weight file {shard!r}, which is not in {path}")
            _check_safetensors(file)
        return
    if os.path.isfile(single):
        _check_safetensors(single)
        return
    pickled = [n for n in _PICKLE_WEIGHTS if os.path.isfile(os.path.join(path, n))]
    if pickled:
        raise FileNotFoundError(
            f"{path} holds its weights only as {pickled[0]}, a pickle file that attnkit does not load "
            f"(it can run code); convert it to {WEIGHTS} where you trust it "
            "(model.save_pretrained(dir) writes safetensors)"
        )
    raise FileNotFoundError(f"{path} has no {WEIGHTS}; pass a directory written by save_pretrained")


def check_model_dir(path: str | os.PathLike, option: str = "model directory") -> dict:
    """Validate ``path`` (``config.json`` and safetensors weights) and return the parsed ``config.json``.

    ``option`` names the argument in the messages (``"MODEL_DIR"``, ``"--model"``).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{option} {path} does not exist; pass a directory written by save_pretrained "
            f"(config.json and {WEIGHTS})"
        )
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{option} {path} has no config.json; pass a directory written by save_pretrained"
        )
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a {type(config).__name__}, expected a JSON object of settings")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"{config_path}: model_type={model_type!r}, expected a string such as 'bert'")
    _check_weights(path)
    return config


def auto_config(path: str | os.PathLike, **kwargs):
    """``transformers.AutoConfig.from_pretrained`` with its errors turned into one line naming config.json."""
    import transformers

    config_path = os.path.join(os.fspath(path), "config.json")
    try:
        return transformers.AutoConfig.from_pretrained(os.fspath(path), **kwargs)
    except Exception as exc:  # transformers raises many types for one bad file (strict-dataclass errors too)
        raise ValueError(f"{config_path} is not a valid model configuration ({_first_line(exc)})") from None


def from_pretrained(model_class, path: str | os.PathLike, option: str = "model directory", **kwargs):
    """``model_class.from_pretrained(path, use_safetensors=True, **kwargs)`` after ``check_model_dir``.

    A failure while building the model or loading its weights is one ``ValueError`` naming the file.
    """
    path = os.fspath(path)
    check_model_dir(path, option)
    auto_config(path)
    config_path = os.path.join(path, "config.json")
    weights = os.path.join(path, WEIGHTS)
    try:
        return model_class.from_pretrained(path, use_safetensors=True, **kwargs)
    except (TypeError, AttributeError) as exc:  # a setting of the wrong type reaches a layer constructor
        raise ValueError(
            f"{config_path}: a setting has the wrong type or value ({_first_line(exc)})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a hostile directory can fail anywhere in transformers
        if "mismatched_sizes" in str(exc) or "size mismatch" in str(exc):
            raise ValueError(
                f"{weights} holds tensors whose shapes differ from the sizes in {config_path}; "
                "restore the matching pair of files"
            ) from None
        raise ValueError(
            f"cannot build the model of {config_path} and load {weights} ({_first_line(exc)})"
        ) from None
