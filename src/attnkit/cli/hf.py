"""``attnkit convert`` and ``attnkit finetune``: the Hugging Face integration from the command line.

Both are thin layers over ``attnkit.hf.convert`` / ``attnkit.hf.finetune.finetune``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import typer

from ._lists import parse_list

__all__ = ["register", "convert_directory", "check_mechanism", "check_dataset"]


_STAGING = ".attnkit-convert-"  # + the pid of the conversion writing into it


def _remove_dead_staging(out: Path) -> None:
    """Remove the staging folders in ``out`` of conversions that were killed (SIGKILL leaves them; their
    process is gone), so that they neither make ``out`` non-empty nor stay in it; a live one is left alone."""
    if not out.is_dir() or out.is_symlink():
        return
    for child in out.glob(_STAGING + "*"):
        pid = child.name[len(_STAGING):].split("-", 1)[0]
        if not child.is_dir() or child.is_symlink() or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except (PermissionError, OverflowError):
            continue  # a live process of another user (or no such pid): not ours to judge


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"--out {out} exists and is not empty; pass --overwrite to replace its files or pick another"
        )


# files of a model folder that transformers or the tokenizer read together with its weights; a conversion
# writes some of them (save_pretrained of the model and of its tokenizer). One in --out that the new
# conversion does not write would be read with the new weights (an earlier model's tokenizer): it is refused
_MODEL_FILES = ("config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                "adapter_config.json", "tf_model.h5", "flax_model.msgpack")
_MODEL_PATTERNS = ("model*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "adapter_model.*")


def _model_files(out: Path) -> list[Path]:
    """The files in ``out``, regular files and symbolic links alike (a Hugging Face cache snapshot links its
    files), named as the files of a saved model or tokenizer."""
    from attnkit.hf.checks import TOKENIZER_FILES

    names = set(_MODEL_FILES) | set(TOKENIZER_FILES)
    return [p for p in out.iterdir() if (p.is_symlink() or p.is_file())
            and (p.name in names or any(p.match(pattern) for pattern in _MODEL_PATTERNS))]


def _is_attnkit_output(out: Path) -> bool:
    """Whether ``out`` holds what ``convert`` or ``finetune`` wrote: a ``config.json`` that records an attnkit
    conversion, or a fine-tune's ``metrics.json`` (a softmax fine-tune of a stock model records none)."""
    from attnkit._files import json_loads
    from attnkit.hf.convert import CONFIG_KEY

    def read(name: str):
        try:
            return json_loads((out / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    config, metrics = read("config.json"), read("metrics.json")
    return (isinstance(config, dict) and isinstance(config.get(CONFIG_KEY), dict)) or (
        isinstance(metrics, dict) and {"mechanism", "train_steps"} <= metrics.keys()
    )


def _check_overwritable(out: Path, overwrite: bool) -> None:
    """Refuse an ``--overwrite`` of model files that attnkit did not write (a stock model, or links to one)
    rather than mix the new conversion's files with them."""
    if not (overwrite and out.is_dir()):
        return
    files = _model_files(out)
    if files and not _is_attnkit_output(out):
        raise FileExistsError(
            f"--overwrite: --out {out} holds model files ({', '.join(sorted(p.name for p in files))}) that "
            "attnkit did not write (its config.json records no conversion); refusing to replace them, choose "
            "another --out"
        )


def _check_stale(out: Path, new: list[str]) -> None:
    """Refuse an ``out`` holding model or tokenizer files that the new conversion (the file names ``new``)
    does not write, which transformers would read with the new weights (they may be the user's: they are not
    removed), or a folder where a new file goes."""
    stale = sorted(p.name for p in _model_files(out) if p.name not in new)
    if stale:
        raise FileExistsError(
            f"--out {out} holds model or tokenizer files that the new conversion does not write "
            f"({', '.join(stale)}), which could be read with its weights; move them out of --out or choose "
            "another --out"
        )
    folders = sorted(name for name in new if (out / name).is_dir() and not (out / name).is_symlink())
    if folders:
        raise FileExistsError(
            f"--out {out} holds folders named as files of the converted model ({', '.join(folders)}); move "
            "them out of --out or choose another --out"
        )


def _save(model, tokenizer, folder: Path, out: Path) -> None:
    """``save_pretrained`` of ``model`` (and ``tokenizer``) into ``folder``. A write the system refused (disk
    full, a file-size limit) is an ``OSError`` naming ``out``, which the caller has not changed yet."""
    import re

    from safetensors import SafetensorError

    try:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    except (OSError, SafetensorError) as exc:
        text = " ".join(str(exc).split())
        code = exc.errno if isinstance(exc, OSError) else None
        found = re.search(r"os error (\d+)", text)  # safetensors: "I/O error: File too large (os error 27)"
        if code is None and found is None:  # not a refused write (safetensors' own check): a defect
            raise
        code = code if code is not None else int(found[1])
        reason = (exc.strerror if isinstance(exc, OSError) else None) or os.strerror(code)
        message = f"{reason} while saving the converted model (--out left as it was)"
        raise OSError(code, message, str(out)) from exc


def check_mechanism(
    mechanism: Optional[str], u0: Optional[float] = None, sinkhorn_iters: Optional[int] = None
) -> None:
    """Reject an unknown ``--mechanism`` (the error lists the valid names) and a ``--u0`` or
    ``--sinkhorn-iters`` it cannot take before any model is loaded."""
    if mechanism is not None:
        from attnkit.registry import resolve_options

        resolve_options(mechanism, u0=u0, sinkhorn_iters=sinkhorn_iters, learnable_u=True)


def check_dataset(dataset: str, cache_dir: Optional[str], download: bool) -> None:
    """Reject a dataset that is neither a folder nor cached (unless ``--download``) before the model loads."""
    if Path(dataset).is_dir():
        return
    from attnkit.data import get_info, is_cached

    try:
        info = get_info(dataset)  # an unknown name lists the catalog
    except ValueError as exc:
        if any(sep in dataset for sep in ("/", os.sep)) or dataset.startswith("."):  # meant as a folder
            raise FileNotFoundError(
                f"--dataset {dataset}: no such folder (a folder holds train.tsv and test.tsv; a catalog name "
                "has no '/')"
            ) from None
        raise exc
    if info.kind != "text-classification":  # before asking for a download it could not use
        raise ValueError(f"dataset {info.name!r} is not a text-classification dataset; pick reuters8, "
                         "reuters52, 20newsgroups, ... (attnkit data list)")
    if not download and not is_cached(info.name, cache_dir):
        raise FileNotFoundError(
            f"dataset {info.name!r} is not in the cache; pass --download to fetch it now, or run "
            f"`attnkit data fetch {info.name}` first"
        )


def _quiet_load(model_dir: str):
    """``attnkit.hf.load`` without transformers' "Loading weights" progress bar (an encoder loads in about a
    second; the bar would stand on stderr above any error about the options)."""
    from transformers.utils import logging as hf_logging

    import attnkit.hf as akhf

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its loading report stood above our one-line error
    try:
        return akhf.load(model_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def convert_directory(
    model_dir: str,
    out: str,
    mechanism: str = "hnas",
    u0: Optional[float] = None,
    layers: Optional[list[int]] = None,
    sinkhorn_iters: Optional[int] = None,
    overwrite: bool = False,
):
    """Load ``model_dir``, convert it with ``attnkit.hf.convert``, save it (safetensors) and its tokenizer to
    ``out`` (the weights alone when ``model_dir`` has no tokenizer files; files that do not load are a
    ``ValueError``).

    The files are saved into a temporary folder inside ``out`` and then moved into place, ``config.json``
    last, each replacing the file (or symbolic link: never its target) of that name. A failed save leaves
    ``out`` as it was. With ``overwrite``, model or tokenizer files in ``out`` that the new conversion does
    not write are refused, not removed; other files of ``out`` are kept."""
    import tempfile

    import attnkit.hf as akhf
    from attnkit.hf.checks import check_model_dir, has_tokenizer_files, load_tokenizer

    check_mechanism(mechanism, u0, sinkhorn_iters)
    check_model_dir(model_dir, "MODEL_DIR")
    if not out.strip():  # Path("") is the working directory
        raise ValueError("--out is empty; pass a directory for the converted model")
    out_path = Path(out)
    if out_path.resolve() == Path(model_dir).resolve():
        raise ValueError(
            f"--out {out} is MODEL_DIR itself: the converted model would replace the original, which a later "
            "conversion needs; choose another --out"
        )
    _remove_dead_staging(out_path)
    _check_out(out_path, overwrite)
    _check_overwritable(out_path, overwrite)
    # no tokenizer files in model_dir: the weights alone are the output; files that do not load are an error
    # (they were dropped, and a finetune of the output then found no tokenizer)
    model = _quiet_load(model_dir)  # first: a damaged config.json is named as such, not as the tokenizer's
    tokenizer = load_tokenizer(model_dir, "MODEL_DIR") if has_tokenizer_files(model_dir) else None
    akhf.convert(model, mechanism, u0=u0, layers=layers, sinkhorn_iters=sinkhorn_iters)
    created = not out_path.exists()
    out_path.mkdir(parents=True, exist_ok=True)
    # inside --out: on its file system (os.replace moves, never copies), whatever its parent allows
    staging = Path(tempfile.mkdtemp(dir=out_path, prefix=f"{_STAGING}{os.getpid()}-"))
    try:
        _save(model, tokenizer, staging, out_path)
        from attnkit._files import match_umask

        match_umask(staging)  # model.safetensors is written 0600 by safetensors
        new = sorted(p.name for p in staging.iterdir())
        _check_stale(out_path, new)  # before any file of --out changes
        # config.json last: stopped between two moves (Ctrl-C), --out holds some new files beside the earlier
        # config.json, and reads as the earlier conversion until the end (--overwrite then runs again)
        for name in sorted(new, key=lambda name: name == "config.json"):
            os.replace(staging / name, out_path / name)  # a symbolic link is replaced, not written through
    except BaseException:
        if created:  # a failed or interrupted conversion leaves no --out it created (all in it is ours)
            shutil.rmtree(out_path, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model


def register(app: typer.Typer) -> None:
    @app.command()
    def convert(
        model_dir: str = typer.Argument(
            ..., help="A model directory written by save_pretrained (e.g. MiniLM-L6)."
        ),
        mechanism: str = typer.Option("hnas", help="softmax, dnas, hnas, sinkhorn or coda."),
        u0: Optional[float] = typer.Option(None, help="Initial hybrid weight for hnas (default 0.5)."),
        layers: Optional[str] = typer.Option(
            None, help="Comma-separated attention-layer indices (default: all)."
        ),
        sinkhorn_iters: Optional[int] = typer.Option(None, help="Iterations for sinkhorn (default 3)."),
        out: str = typer.Option(..., help="Output directory (safetensors + config + tokenizer)."),
        overwrite: bool = typer.Option(
            False, help="Replace the files of an earlier attnkit output in --out (other files are kept)."
        ),
    ) -> None:
        """Convert a transformers model's self-attention to an attnkit mechanism and save it."""
        chosen = parse_list(layers, "layers", int, example="0,1,5")
        model = convert_directory(model_dir, out, mechanism, u0, chosen, sinkhorn_iters, overwrite)
        import attnkit.hf as akhf

        n = len(akhf.converted_modules(model))
        from attnkit.hf.checks import has_tokenizer_files

        alone = "" if has_tokenizer_files(model_dir) else " (no tokenizer: MODEL_DIR has none to copy)"
        typer.echo(
            f"converted {n} attention module(s) of {type(model).__name__} to {mechanism}; "
            f"saved to {out}{alone}"
        )

    @app.command()
    def finetune(
        model: Optional[str] = typer.Option(None, help="Model directory (default: the packaged MiniLM-L6)."),
        mechanism: Optional[str] = typer.Option(
            None,
            help="softmax, dnas, hnas, sinkhorn or coda "
            "(default: the model's own, softmax for a stock model).",
        ),
        u0: Optional[float] = typer.Option(None, help="Initial hybrid weight for hnas (default 0.5)."),
        dataset: str = typer.Option(
            "reuters8", help="Catalog name, or a folder with train.tsv/test.tsv (label<TAB>text)."
        ),
        max_steps: Optional[int] = typer.Option(None, help="Stop after this many optimizer steps."),
        epochs: float = typer.Option(
            3.0, help="Passes over the training set (when --max-steps is not given)."
        ),
        batch_size: int = typer.Option(16, help="Batch size per process."),
        lr: float = typer.Option(5e-5, help="Peak learning rate (linear decay, 6% warmup)."),
        max_length: int = typer.Option(128, help="Truncate texts to this many tokens."),
        seed: int = typer.Option(0, help="Random seed (initialisation and data order), 0 to 2**32 - 1."),
        out: str = typer.Option(..., help="Output directory: model (safetensors), tokenizer, metrics.json."),
        overwrite: bool = typer.Option(False, help="Replace the files of a non-empty --out."),
        cache_dir: Optional[str] = typer.Option(
            None, help="Dataset cache (default $ATTNKIT_CACHE or ~/.cache/attnkit)."
        ),
        download: bool = typer.Option(False, help="Fetch the dataset into the cache when it is not there."),
        max_eval_samples: Optional[int] = typer.Option(
            None, help="Evaluate on the first N test documents only (default: all)."
        ),
        align: Optional[str] = typer.Option(
            None, help="Alignment attention: gan, ot, ct or mmd (docs/alignment.md)."
        ),
        align_weight: Optional[float] = typer.Option(
            None,
            help="Weight of the alignment loss (lambda), >= 0; used only with --align (default 0.01, "
            "the paper's).",
        ),
    ) -> None:
        """Fine-tune a (converted) encoder for sequence classification; prints accuracy and macro-F1."""
        from attnkit.hf.finetune import FinetuneConfig
        from attnkit.hf.finetune import finetune as run

        for name, value in (("--model", model), ("--dataset", dataset)):
            if value is not None and not value.strip():
                raise ValueError(f"{name} is empty; pass a value or drop the option for its default")
        check_mechanism(mechanism)
        check_dataset(dataset, cache_dir, download)

        config = FinetuneConfig(
            out=out, model=model, mechanism=mechanism, u0=u0, dataset=dataset, max_steps=max_steps,
            epochs=epochs, batch_size=batch_size, lr=lr, max_length=max_length, seed=seed,
            overwrite=overwrite, cache_dir=cache_dir, download=download, max_eval_samples=max_eval_samples,
            align=align, align_weight=align_weight,
        )
        metrics = run(config)
        if int(os.environ.get("RANK", "0")) != 0:
            return
        from attnkit.cli._screen import console as make_console
        from rich.table import Table

        table = Table(title=f"attnkit finetune: {dataset}")
        for column in ("mechanism", "accuracy", "macro-F1", "steps", "s/step", "train loss"):
            table.add_column(column)
        table.add_row(
            metrics["mechanism"], f"{metrics['accuracy']:.4f}", f"{metrics['macro_f1']:.4f}",
            str(metrics["train_steps"]), f"{metrics['mean_step_seconds']:.3f}",
            f"{metrics['train_loss']:.4f}",
        )
        make_console().print(table)
        typer.echo(f"saved model and metrics.json to {out}")
