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


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        from attnkit.hf.publish import staging_left

        left = staging_left(out)
        raise FileExistsError(
            f"--out {out} exists and is not empty{left}; {'or ' if left else ''}pass --overwrite to replace "
            "its files or pick another"
        )
    from attnkit._files import check_out_writable

    check_out_writable(out)  # before the model loads: a read-only --out failed after the conversion


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
    from attnkit.data import is_cached
    from attnkit.hf.finetune import dataset_info

    info = dataset_info(dataset)  # a file, a missing folder or an unknown name: an error that says which
    if info is None:  # a folder
        return
    if info.kind != "text-classification":  # before asking for a download it could not use
        raise ValueError(f"dataset {info.name!r} is not a text-classification dataset; pick reuters8, "
                         "reuters52, 20newsgroups, ... (attnkit data list)")
    if not download and not is_cached(info.name, cache_dir):
        raise FileNotFoundError(
            f"dataset {info.name!r} is not in the cache; pass --download to fetch it now, or run "
            f"`attnkit data fetch {info.name}` first"
        )


def _quiet_load(model_dir: str):
    from attnkit.hf.progress import quiet_load

    return quiet_load(model_dir)


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
    ``ValueError``), with a copy of its image or feature processor files (``preprocessor_config.json``,
    ``processor_config.json``) when it has them.

    The files are saved into a staging folder inside ``out`` and then moved into place
    (``attnkit.hf.publish``), ``config.json`` last, each replacing the file (or symbolic link: never its
    target) of that name. A failed save leaves ``out`` as it was. With ``overwrite``, model or tokenizer
    files in ``out`` that the new conversion does not write are refused, not removed; other files of ``out``
    are kept. ``out`` is locked from its checks to the last move (``attnkit.hf.publish.claim_out``): a
    second conversion or fine-tune into it meanwhile is refused."""
    import attnkit.hf as akhf
    from attnkit.analysis.attention_view import (
        MAX_LENGTH_CONFIG_KEY,
        PAIRS_CONFIG_KEY,
        _finetune_max_length,
        _pair_dataset,
    )
    from attnkit.hf.checks import check_model_dir, has_tokenizer_files, load_tokenizer
    from attnkit.hf.progress import quiet_transformers
    from attnkit.hf.publish import (
        MAX_SHARD_SIZE,
        PROCESSOR_FILES,
        check_certainly_stale,
        check_out_link,
        check_overwritable,
        check_shards,
        claim_out,
        holds_finetune_record,
        is_empty,
        publish,
        remove_dead_staging,
    )

    check_mechanism(mechanism, u0, sinkhorn_iters)
    check_model_dir(model_dir, "MODEL_DIR")
    if not out.strip():  # Path("") is the working directory
        raise ValueError("--out is empty; pass a directory for the converted model")
    out_path = Path(out)
    check_out_link(out_path)
    if out_path.resolve() == Path(model_dir).resolve():
        raise ValueError(
            f"--out {out} is MODEL_DIR itself: the converted model would replace the original, which a later "
            "conversion needs; choose another --out"
        )
    with claim_out(out_path):  # a second run into --out is refused until this one ends
        remove_dead_staging(out_path)
        _check_out(out_path, overwrite)
        found_empty = is_empty(out_path)
        check_overwritable(out_path, overwrite)
        processor = [name for name in PROCESSOR_FILES if (Path(model_dir) / name).is_file()]
        check_certainly_stale(out_path, has_tokenizer_files(model_dir), bool(processor))
        # no tokenizer files in model_dir: the weights alone are the output; files that do not load are an
        # error (they were dropped, and a finetune of the output then found no tokenizer)
        model = _quiet_load(model_dir)  # first: a damaged config.json is named as such, not as the tokenizer
        tokenizer = load_tokenizer(model_dir, "MODEL_DIR") if has_tokenizer_files(model_dir) else None
        akhf.convert(model, mechanism, u0=u0, layers=layers, sinkhorn_iters=sinkhorn_iters)
        # a fine-tune on sentence pairs stays one: show encodes its "a | b" as the pair and cuts a text at the
        # fine-tune's --max-length (metrics.json, where finetune records both, is its own and is not copied)
        # (set or removed: a converted fine-tune fine-tuned again carries the first fine-tune's keys)
        for key, value in ((PAIRS_CONFIG_KEY, _pair_dataset(model_dir)),
                           (MAX_LENGTH_CONFIG_KEY, _finetune_max_length(model_dir))):  # the tokens it read
            if value is not None:
                setattr(model.config, key, value)
            elif hasattr(model.config, key):
                delattr(model.config, key)
        check_shards(out_path, model)  # a sharded earlier output, refused before the save

        def write(folder: Path) -> None:
            with quiet_transformers():  # its "Writing model shards" bar: publish says what was written
                model.save_pretrained(folder, max_shard_size=MAX_SHARD_SIZE)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            for name in processor:  # an image or feature processor (AutoImageProcessor): its files as is
                shutil.copyfile(Path(model_dir) / name, folder / name)

        replaced_finetune = holds_finetune_record(out_path)  # only with --overwrite: --out was not empty
        publish(out_path, write, "converted model", "convert", found_empty=found_empty)
        if replaced_finetune:  # the replaced fine-tune's numbers (and sentence_pairs, which show reads)
            (out_path / "metrics.json").unlink(missing_ok=True)
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
            False,
            help="Replace the files of an earlier attnkit output in --out (other files are kept; model or "
            "tokenizer files the new output does not write are refused, not deleted; a fine-tune's "
            "metrics.json is removed with the model it described).",
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
        overwrite: bool = typer.Option(
            False,
            help="Replace the files of an earlier attnkit output in --out (other files are kept; model or "
            "tokenizer files the new output does not write are refused, not deleted; a fine-tune's "
            "metrics.json is removed with the model it described).",
        ),
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
        from attnkit.cli._screen import add_fitted_columns
        from attnkit.cli._screen import console as make_console
        from rich.table import Table

        table = Table(title=f"attnkit finetune: {dataset}")
        aligned = metrics.get("align") not in (None, "none")
        # with alignment the training loss is the task loss plus the weighted alignment loss (for gan the
        # discriminator's cross-entropy, which the model raises), and the column says so
        loss_column = "train loss"
        if aligned:
            loss_column += f" (+ {metrics['align']} x {metrics['align_weight']:g})"
        label = f"{metrics['mechanism']}+{metrics['align']}" if aligned else metrics["mechanism"]
        row = [label, f"{metrics['accuracy']:.4f}", f"{metrics['macro_f1']:.4f}", str(metrics["train_steps"]),
               f"{metrics['mean_step_seconds']:.3f}", f"{metrics['train_loss']:.4f}"]
        header = ["mechanism", "accuracy", "macro-F1", "steps", "s/step", loss_column]
        add_fitted_columns(table, header, [row])
        table.add_row(*row)
        make_console().print(table, crop=False)
        typer.echo(f"saved model and metrics.json to {out}")
