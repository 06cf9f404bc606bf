"""``attnkit demo``: every mechanism side by side on one padded batch, with Lemma 1's numbers."""

from __future__ import annotations

import re

import pytest

import attnkit as ak
from attnkit.cli import main


def test_demo_prints_every_mechanism_and_dnas_keeps_lemma1(capsys):
    main(["demo", "--seed", "0"])
    out = capsys.readouterr().out
    for name in ("softmax", "dnas", "sinkhorn(k=3)", "hnas(u=0.5)", "coda(scaled)"):
        assert name in out
    dnas_row = next(line for line in out.splitlines() if re.search(r"\bdnas\b", line) and "%" in line)
    numbers = re.findall(r"[-+]?\d+\.\d+(?:e[-+]\d+)?", dnas_row)
    assert float(numbers[3]) >= 1 - 1e-6  # min n_k*sum: Lemma 1
    assert len(out.splitlines()) > 3 * len(ak.MECHANISMS)  # one weight grid per mechanism


def test_demo_rejects_a_non_numeric_seed(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--seed", "abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616", "99999999999999999999"])
def test_demo_refuses_a_seed_out_of_range_naming_it(seed, capsys):
    """A seed past 2**64 failed inside torch's seeding with "Overflow when unpacking long long"."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--seed", seed])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: seed={seed}; expected an integer in [0, 2**64 - 1]\n"


def test_demo_takes_every_seed_torch_takes(capsys):
    main(["demo", "--seed", str(2**64 - 1)])  # only a torch.Generator is seeded (NumPy stops at 2**32)
    assert "dnas" in capsys.readouterr().out


def test_demo_names_its_lemma1_column_for_what_it_computes(capsys):
    # min_j n_k(b) * sum_i pi_ij is not n_k times the "min key sum" printed beside it
    main(["demo", "--seed", "0"])
    out = capsys.readouterr().out
    assert "min n_k*sum" in out and "n_k * min" not in out
    # the footnote said "the smallest key sum times its sequence's key count", the other number (3.431 is not
    # the smallest sum 0.521 times 8 or 5)
    footnote = " ".join(out.split())
    assert "the smallest over keys of n_k times the key's weight sum" in footnote
    assert "smallest key sum times" not in footnote


def _narrow_console(monkeypatch, width):
    import io

    from rich.console import Console

    import attnkit.cli._screen as screen

    out = io.StringIO()
    monkeypatch.setattr(screen, "console", lambda *a, **k: Console(file=out, width=width, markup=False,
                                                                    force_terminal=True, no_color=True))
    return out


@pytest.mark.parametrize("width", [40, 60])
def test_demo_on_a_narrow_terminal_cuts_no_name_or_number(width, monkeypatch):
    """On a 60-column terminal the summary table printed "sinkhorn…", "hnas(u=0…" and "1.000..1…"."""
    out = _narrow_console(monkeypatch, width)
    main(["demo", "--seed", "0"])
    text = out.getvalue()
    assert "…" not in text
    rows = [line for line in text.splitlines() if "%" in line and line.startswith("│")]
    assert [line.split()[1] for line in rows] == [
        "softmax", "dnas", "hnas(u=0.5)", "sinkhorn(k=3)", "coda(scaled)"]
    for line in rows:  # row sums, min key sum, min n_k*sum, share below eps: whole in one line
        assert re.search(r"\d\.\d{3}\.\.\d\.\d{3} │ +-?\d\.\d\de[-+]\d\d │ +-?\d+\.\d{3} │ +\d+\.\d%", line)
    grid_rows = [line for line in text.splitlines() if re.match(r"│ q\d ", line)]
    assert len(grid_rows) == 5 * len(rows)  # the weight grids: every weight whole, "+0.37"
    assert all(len(re.findall(r"[-+]\d\.\d\d\b", line)) == 6 for line in grid_rows)
