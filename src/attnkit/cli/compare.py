"""``attnkit compare``: does a mechanism help on my task? Train the same model with each, report side by side.

    attnkit compare                                   # quick preset, Reuters-R8, five mechanisms, 2 seeds
    attnkit compare --task mlu --preset paper         # Transformer vs CoDA Transformer on MLU
    attnkit compare --config run.yaml --max-steps 20  # file values, overridden by the command line
    accelerate launch --multi_gpu --num_processes 2 -m attnkit.cli compare ...   # many processes / GPUs
    torchrun --nproc_per_node 2 -m attnkit.cli compare ...                           # the same, on CPUs too

A thin layer over ``attnkit.runner.run_compare``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

__all__ = ["register", "parse_set"]


def parse_set(items: list[str]) -> dict:
    """``["lr=1e-3", "max_train=null"]`` -> ``{"lr": 0.001, "max_train": None}`` (values read as YAML
    scalars); a key given twice takes its last value."""
    import yaml

    from attnkit.runner.config import yaml_number

    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=1e-3")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _check_decimal(item, raw.strip(), value)
        values[key.strip().replace("-", "_")] = yaml_number(value)  # YAML 1.1 reads 1e-3 as a string
    return values


_DECIMAL_INT = re.compile(r"[+-]?(0|[1-9][0-9]*)")


def _check_decimal(item: str, raw: str, value) -> None:
    """YAML 1.1 reads ``010`` as octal 8, ``0x10`` as 16 and ``1:00`` as 60 (base 60): a number on the command
    line is decimal, so such forms are refused rather than read as another value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int):
        plain = _DECIMAL_INT.fullmatch(raw) is not None
    else:
        try:
            plain = raw.lower().lstrip("+-") in (".inf", ".nan") or float(raw.replace("_", "")) == value
            plain = plain and "_" not in raw and ":" not in raw
        except ValueError:
            plain = False
    if not plain:
        raise ValueError(
            f"--set {item!r}: YAML reads {raw!r} as {value!r}; write the number in decimal, without leading "
            "zeros, underscores or colons"
        )


def register(app: typer.Typer) -> None:
    @app.command()
    def compare(
        task: Optional[str] = typer.Option(
            None,
            "--task",
            help="reuters8 (default), mlu, another catalog dataset, g2p|numbers|copy|reverse|sort (recurrent "
            "models: --mechanisms vanilla,additive,bilinear,dot,scaled_dot,gmm,mixed,ctc; vanilla has no "
            "attention), or a .json/.jsonl dataset file.",
        ),
        mechanisms: Optional[str] = typer.Option(
            None,
            "--mechanisms",
            help="Comma-separated, e.g. softmax,dnas,hnas,sinkhorn,coda,none (none: the no-attention "
            "baseline, mean pooling).",
        ),
        seeds: Optional[int] = typer.Option(
            None, "--seeds", help="Seeds per mechanism (mean ± sample std over them)."
        ),
        preset: Optional[str] = typer.Option(
            None, "--preset", help="quick (default, minutes on a CPU) or paper."
        ),
        max_steps: Optional[int] = typer.Option(
            None, "--max-steps", help="Hard cap on optimizer steps per run."
        ),
        out: Optional[str] = typer.Option(  # a str: typer would read "" as Path("."), the working directory
            None, "--out", help="Run directory (default runs/compare-<task>-<preset>).", metavar="<path>"
        ),
        resume: bool = typer.Option(
            False, "--resume", help="Continue the run in --out (finished runs are skipped)."
        ),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an earlier run in --out (its outputs; other files stay)."
        ),
        config_file: Optional[Path] = typer.Option(
            None, "--config", help="YAML/TOML/JSON file of configuration keys."
        ),
        set_: list[str] = typer.Option(
            [], "--set", help="Any other configuration key: --set lr=1e-3 (repeatable)."
        ),
        progress: Optional[str] = typer.Option(None, "--progress", help="auto, rich, tqdm or none."),
        log_with: Optional[str] = typer.Option(
            None, "--log-with", help="Also log to an Accelerate tracker: tensorboard (into OUT/tensorboard)."
        ),
        align: Optional[str] = typer.Option(
            None, "--align",
            help="Alignment attention per mechanism: none and any of gan, ot, ct, mmd (weight: --set "
            "align_weight=0.01).",
        ),
    ) -> None:
        """Train the same model with several attention mechanisms under the same seeds and budget.

        Writes results.json, results.csv, plots and a self-contained report.html into the run directory.
        """
        from attnkit.runner.compare import run_compare, saved_config
        from attnkit.runner.config import build_config, load_config_file

        if out is not None and not out.strip():
            raise ValueError("--out is empty; pass a run directory such as runs/my-compare")
        overrides = parse_set(set_)
        given = {
            "task": task, "mechanisms": mechanisms, "seeds": seeds, "preset": preset, "max_steps": max_steps,
            "out": out, "progress": progress, "log_with": log_with,
            "resume": resume or None, "overwrite": overwrite or None, "align": align,
        }
        clash = sorted(k for k, v in given.items() if v is not None and k in overrides)
        if clash:
            raise ValueError(f"{clash} given both as an option and with --set; give each once")
        overrides.update({k: v for k, v in given.items() if v is not None})
        file_values = load_config_file(config_file) if config_file is not None else {}
        layered = {**file_values, **overrides}
        if "out" not in layered:
            layered["out"] = str(Path("runs") / f"compare-{Path(str(layered.get('task', 'reuters8'))).stem}-"
                                 f"{layered.get('preset', 'quick')}")
        if not isinstance(layered["out"], str) or not layered["out"]:  # before it is read as a path below
            raise ValueError(f"out={layered['out']!r}: expected a directory path")
        if layered.get("overwrite") and config_file is not None:
            from attnkit.runner.compare import doomed_by_overwrite

            if Path(str(layered["out"])).is_dir() and doomed_by_overwrite(config_file, str(layered["out"])):
                raise ValueError(
                    f"--overwrite would delete {str(config_file)!r}, the --config file, which lies among the "
                    f"outputs of the run directory {layered['out']!r}; move it out of the folder first"
                )
        base = saved_config(layered["out"]) if layered.get("resume") else None
        _check_saved_task_file(base, layered)
        config = build_config(layered, base=base, keep_none=True)  # --set KEY=null / KEY: null: no value
        result = run_compare(config)
        _print_summary(result)

    return None


def _check_saved_task_file(base: Optional[dict], layered: dict) -> None:
    """``--resume`` without ``--task`` of a run whose dataset file is gone: say how to resume from where it
    is now (the generic "not found" named built-in tasks)."""
    from attnkit.runner.dataset_file import is_dataset_file_name

    task = (base or {}).get("task")
    if layered.get("task") is not None or not isinstance(task, str) or not is_dataset_file_name(task):
        return
    if not Path(task).is_file():
        raise FileNotFoundError(
            f"--resume: the run's dataset file {task!r} is not there any more; if it moved, pass --resume "
            "--task NEW_PATH (the same contents), or put it back"
        )


def _print_summary(result) -> None:
    from accelerate.state import PartialState

    if not PartialState().is_main_process:
        return
    from attnkit.cli._screen import console as make_console
    from rich.table import Table

    from attnkit.runner.report import table_legend, table_rows

    header, rows = table_rows(result.records, result.task.metric_names, detail=False)
    table = Table(title=f"attnkit compare: {result.config.task} ({result.config.preset})",
                  caption=table_legend(result.records), caption_justify="left")
    for i, h in enumerate(header):
        # on a narrow terminal the headers fold, never a cell: a mechanism's name or a number cut to "…"
        # (at 70 columns every name was) would leave rows that say nothing; a table still wider than the
        # terminal is printed whole (crop=False below), for the terminal to wrap
        widest = max([len(str(row[i])) for row in rows] + [len(h) if h == "mechanism" else 0])
        table.add_column(h, justify="left" if h == "mechanism" else "right", min_width=widest,
                         overflow="fold")
    for row in rows:
        table.add_row(*row)
    console = make_console()
    console.print(table, crop=False)
    for line in [c["text"] for c in result.extras.get("comparisons", [])]:
        console.print(line, soft_wrap=True)
    if result.extras.get("load_note"):
        console.print(result.extras["load_note"], soft_wrap=True)
    if result.task.kind == "seq2seq":  # the presets compare fewer mechanisms there: say which and why
        by_reason: dict = {}
        for name, why in result.extras.get("skipped_mechanisms", {}).items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            console.print(f"not run: {', '.join(names)}: {why}", soft_wrap=True)
    for kind, path in result.files.items():
        console.print(f"{kind:>18}: {path}")
