"""Building and loading the C++ CPU kernels, and the fallback where they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from attnkit.kernels import cpu_ext


def test_extension_builds_where_a_compiler_exists():
    if cpu_ext.disabled():
        pytest.skip("ATTNKIT_NO_CPP is set")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the efficient backend runs its pure-PyTorch kernels")
    assert cpu_ext.load(), cpu_ext.load_error()
    assert cpu_ext.load_error() is None


def test_build_dir_is_under_the_cache_and_names_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    path = cpu_ext.build_dir()
    assert path.parent == tmp_path / "ext"
    assert path.name.startswith("torch-2.13.0")


def test_disabled_extension_falls_back_to_the_same_results():
    """With ATTNKIT_NO_CPP=1 the efficient backend gives the reference result through its PyTorch kernels."""
    code = (
        "import torch, attnkit as ak\n"
        "from attnkit.kernels import cpu_ext\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))\n"
        "km = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)\n"
        "for m in ('dnas', 'hnas', ak.Sinkhorn(iters=3), 'coda'):\n"
        "    a = ak.attention(q, k, v, m, key_mask=km, backend='efficient')\n"
        "    b = ak.attention(q, k, v, m, key_mask=km, backend='reference')\n"
        "    torch.testing.assert_close(a, b)\n"
        "assert not cpu_ext.load()\n"
        "print(cpu_ext.load_error())\n"
    )
    env = dict(os.environ, ATTNKIT_NO_CPP="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ATTNKIT_NO_CPP" in proc.stdout


_HOLD_LOCK = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from attnkit.kernels import cpu_ext\n"
    "with cpu_ext.build_lock(Path(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)


def _spawn_lock_holder(lock: os.PathLike) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_of_a_killed_builder_is_released(monkeypatch, tmp_path):
    """A process SIGKILLed while holding the build lock leaves nothing that blocks the next build."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NO_CPP", raising=False)
    final = cpu_ext.build_dir()
    holder = _spawn_lock_holder(final.parent / (final.name + ".lock"))
    holder.kill()
    holder.wait(timeout=30)
    calls = []

    def fake_build(path, verbose):  # reached only once the lock is ours
        calls.append(path)
        raise RuntimeError("compiler not run in this test")

    monkeypatch.setattr(cpu_ext, "_build", fake_build)
    monkeypatch.setattr(cpu_ext, "_state", {"loaded": False, "ok": False, "error": None})
    monkeypatch.setenv("ATTNKIT_EXT_LOCK_TIMEOUT", "20")
    start = time.monotonic()
    assert not cpu_ext.load(warn=False)
    assert time.monotonic() - start < 10
    assert calls == [final]
    assert "compiler not run" in cpu_ext.load_error()


def test_lock_wait_times_out_naming_the_file_to_delete(tmp_path, capsys):
    """The wait says so once on stderr (it was silent for up to ATTNKIT_EXT_LOCK_TIMEOUT, 900 s)."""
    lock = tmp_path / "ext.lock"
    holder = _spawn_lock_holder(lock)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"delete {lock}"):
            with cpu_ext.build_lock(lock, timeout=0.5):
                pass
        assert time.monotonic() - start < 5
        err = capsys.readouterr().err.splitlines()
        assert err == [f"attnkit: waiting for another process building the C++ CPU kernels (lock {lock})"]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with cpu_ext.build_lock(lock, timeout=5):  # free again once the holder is gone
        pass


def test_stale_lock_files_do_not_block_loading_a_built_extension():
    """Loading a finished build takes no lock: leftover lock files (as a killed loader leaves) are ignored."""
    if cpu_ext.disabled() or not cpu_ext.load(warn=False):
        pytest.skip("the C++ kernels are not built here")
    final = cpu_ext.build_dir()
    for stale in (final / "lock", final.parent / (final.name + ".lock")):  # cpp_extension's baton, ours
        stale.touch()
    code = "from attnkit.kernels import cpu_ext\nassert cpu_ext.load(), cpu_ext.load_error()\nprint('ok')\n"
    env = dict(os.environ, ATTNKIT_EXT_LOCK_TIMEOUT="30")
    holder = _spawn_lock_holder(final.parent / (final.name + ".lock"))  # even a live builder elsewhere
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        holder.kill()
        holder.wait(timeout=30)
        (final / "lock").unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_changed_source_gets_a_new_build_dir(monkeypatch, tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_ext._CSRC, csrc)
    monkeypatch.setattr(cpu_ext, "_CSRC", csrc)
    before = cpu_ext.build_dir()
    with open(csrc / "potentials_cpu.cpp", "a") as f:
        f.write("\n// edited\n")
    after = cpu_ext.build_dir()
    assert before != after and before.parent == after.parent
    monkeypatch.setattr(cpu_ext, "_flags", lambda: ["-O2"])
    assert cpu_ext.build_dir() != after


def test_a_damaged_library_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A truncated attnkit_cpu.so in the cache killed the process with SIGBUS when opened (and one that would
    not load was never rebuilt): the build records the library's size and SHA-256, and a library that does
    not match is rebuilt."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NO_CPP", raising=False)
    final = cpu_ext.build_dir()
    final.mkdir(parents=True)
    (final / cpu_ext._LIBRARY).write_bytes(b"\x7fELF" + bytes(4092))  # what a truncated copy looks like
    calls = []

    def fake_build(path, verbose):
        calls.append(path)
        raise RuntimeError("compiler not run in this test")

    monkeypatch.setattr(cpu_ext, "_build", fake_build)
    monkeypatch.setattr(cpu_ext, "_state", {"loaded": False, "ok": False, "error": None})
    assert not cpu_ext.load(warn=False) and calls == [final]  # no record: rebuilt
    (final / cpu_ext._DIGEST).write_text(cpu_ext._digest(final / cpu_ext._LIBRARY))
    assert cpu_ext._intact(final)
    with open(final / cpu_ext._LIBRARY, "r+b") as f:  # damaged after the build
        f.truncate(100)
    assert not cpu_ext._intact(final)


@pytest.mark.parametrize("raw, off", [("", False), ("0", False), ("off", False), ("No", False), ("1", True),
                                      ("on", True), ("TRUE", True)])
def test_no_cpp_reads_true_and_false_words(monkeypatch, raw, off):
    """``ATTNKIT_NO_CPP=off`` turned the kernels off: anything not in a short list of false words did."""
    monkeypatch.setenv("ATTNKIT_NO_CPP", raw)
    assert cpu_ext.disabled() is off


def test_an_unknown_no_cpp_value_is_named(monkeypatch):
    monkeypatch.setenv("ATTNKIT_NO_CPP", "2")
    with pytest.raises(ValueError, match="ATTNKIT_NO_CPP='2'; expected 1/true/yes/on"):
        cpu_ext.disabled()


@pytest.mark.parametrize("raw", ["nan", "-5", "abc"])
def test_a_lock_timeout_that_is_no_wait_is_named(monkeypatch, raw):
    """``nan`` waited forever on a held lock; a negative value gave up at once ("waited -5 s")."""
    monkeypatch.setenv("ATTNKIT_EXT_LOCK_TIMEOUT", raw)
    expected = f"ATTNKIT_EXT_LOCK_TIMEOUT='{raw}'; expected a number of seconds >= 0"
    with pytest.raises(ValueError, match=expected):
        cpu_ext._lock_timeout()


def test_a_library_built_before_the_record_is_loaded_where_it_cannot_be_rebuilt(tmp_path):
    """No compiler or a read-only cache: the old build is not known to be damaged, so it is used as before.
    (In a fresh process: one process cannot load two copies of the library.)"""
    if cpu_ext.disabled() or not cpu_ext.load(warn=False):
        pytest.skip("the C++ kernels are not built here")
    good = cpu_ext.build_dir()
    code = textwrap.dedent(f"""
        import os, shutil
        os.environ["ATTNKIT_CACHE"] = {str(tmp_path)!r}
        from attnkit.kernels import cpu_ext
        final = cpu_ext.build_dir()
        final.mkdir(parents=True)
        shutil.copy({str(good / cpu_ext._LIBRARY)!r}, final / cpu_ext._LIBRARY)  # no record beside it
        def no_compiler(path, verbose):
            raise RuntimeError("no compiler")
        cpu_ext._build = no_compiler
        print(cpu_ext.load(warn=False), cpu_ext.load_error())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True None"


def test_a_cut_library_without_record_is_not_loaded_where_it_cannot_be_rebuilt(tmp_path):
    """A truncated library from before the record, with no compiler to rebuild it, was loaded and the
    process died of SIGBUS; it is now checked whole first and the kernels fall back with a message."""
    if cpu_ext.disabled() or not cpu_ext.load(warn=False):
        pytest.skip("the C++ kernels are not built here")
    good = cpu_ext.build_dir() / cpu_ext._LIBRARY
    assert cpu_ext._elf_whole(good)
    code = textwrap.dedent(f"""
        import os
        os.environ["ATTNKIT_CACHE"] = {str(tmp_path)!r}
        from pathlib import Path
        from attnkit.kernels import cpu_ext
        final = cpu_ext.build_dir()
        final.mkdir(parents=True)
        data = Path({str(good)!r}).read_bytes()
        (final / cpu_ext._LIBRARY).write_bytes(data[: len(data) // 2])  # cut, no record beside it
        def no_compiler(path, verbose):
            raise RuntimeError("c++: not found")
        cpu_ext._build = no_compiler
        print(cpu_ext.load(warn=False), cpu_ext.load_error())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # -7: SIGBUS
    assert proc.stdout.strip() == "False RuntimeError: c++: not found"


def test_a_record_that_is_not_text_is_a_damaged_build_to_rebuild(monkeypatch, tmp_path):
    """A record that is not UTF-8 turned the kernels off for good ("install a C++ compiler")."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    final = cpu_ext.build_dir()
    final.mkdir(parents=True)
    (final / cpu_ext._LIBRARY).write_bytes(b"\x7fELF" + bytes(100))
    (final / cpu_ext._DIGEST).write_bytes(b"\xff\xfe not text")
    assert not cpu_ext._intact(final)


def test_an_unbounded_lock_wait_is_accepted(monkeypatch):
    monkeypatch.setenv("ATTNKIT_EXT_LOCK_TIMEOUT", "inf")
    assert cpu_ext._lock_timeout() == float("inf")


def test_a_first_build_says_so_on_stderr_before_it_starts(monkeypatch, tmp_path, capsys):
    """The build takes a minute or more (3.5 min on a busy 2-core machine); before, it ran without a word."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NO_CPP", raising=False)
    seen = []

    def fake_build(path, verbose):
        seen.append(capsys.readouterr().err)  # what was said before the compiler would start
        raise RuntimeError("compiler not run in this test")

    monkeypatch.setattr(cpu_ext, "_build", fake_build)
    monkeypatch.setattr(cpu_ext, "_state", {"loaded": False, "ok": False, "error": None})
    assert not cpu_ext.load(warn=False)
    assert len(seen) == 1
    assert "building the C++ CPU kernels" in seen[0] and str(cpu_ext.build_dir()) in seen[0]
    assert seen[0].count("\n") == 1
