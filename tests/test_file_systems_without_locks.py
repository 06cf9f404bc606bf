"""Output folders and the C++ build on file systems without file locks (NFS without its lock daemon, FUSE,
SMB): ``flock`` fails there with ENOLCK, EOPNOTSUPP, EINVAL or (NFS's emulation, on a folder opened for
reading) EBADF. The commands crashed with a 51-54-line traceback; a compare left a config.json that refused
the rerun; the C++ kernels were never built, with a warning to install a compiler that was there."""

from __future__ import annotations

import errno
import fcntl

import pytest

import attnkit._files as files
from attnkit.kernels import cpu_ext


def _no_locks(monkeypatch, code=errno.ENOLCK):
    real = fcntl.flock

    def flock(fd, operation):
        if operation & fcntl.LOCK_UN:
            return real(fd, operation)
        raise OSError(code, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(files, "_SAID_WITHOUT_LOCK", set())


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF])
def test_a_folder_that_cannot_be_locked_is_used_unlocked_with_one_line(tmp_path, monkeypatch, capsys, code):
    _no_locks(monkeypatch, code)
    assert files.lock_folder(tmp_path, "attnkit compare process") is None
    assert files.lock_folder(tmp_path, "attnkit compare process") is None  # said once per folder
    err = capsys.readouterr().err.splitlines()
    expected = (f"attnkit: cannot lock {str(tmp_path)!r} (its file system has no file locks: "
                f"{errno.errorcode[code]}); going on without it")
    assert len(err) == 1 and err[0].startswith(expected)


def test_another_lock_error_is_not_taken_for_a_file_system_without_locks(tmp_path, monkeypatch):
    _no_locks(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="No locks available"):
        files.lock_folder(tmp_path, "attnkit compare process")


def test_a_compare_into_a_folder_without_locks_runs_and_leaves_its_results(tmp_path, monkeypatch, capsys):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    _no_locks(monkeypatch)
    result = run_compare(build_config(tiny_overrides(data, out, seeds=1, mechanisms="softmax", steps=2,
                                                     plots=False)))
    assert (out / "results.json").is_file() and result.runs
    assert "cannot lock" in capsys.readouterr().err


def test_the_cpp_build_lock_on_a_cache_without_locks_lets_the_build_go_on(tmp_path, monkeypatch, capsys):
    _no_locks(monkeypatch)
    ran = []
    with cpu_ext.build_lock(tmp_path / "ext.lock", timeout=5):
        ran.append(True)
    assert ran == [True]
    err = capsys.readouterr().err
    assert "cannot lock" in err and "building without it" in err
