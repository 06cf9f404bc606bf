"""Numerical precision of every mechanism in float32 and bfloat16 against float64.

For each mechanism (every CoDA variant included) and each available backend, run ``ak.attention``
on one padded batch (B=2, H=4, L=128, D=32 by default; the second sequence is padded) in float32
and bfloat16, and report the max abs error of the output and of dq / dk / dv against the float64
reference backend on the same inputs. Gradients are those of ``sum(out * g)`` for a fixed random
``g``. Errors are measured on real tokens only (padded positions are exactly zero everywhere).

Two errors are reported: against float64 on the original inputs (what a user sees, including the
rounding of q, k, v and g to the low-precision dtype) and against float64 on the *same rounded* inputs
(q, k, v and g: the arithmetic error of the implementation alone). They differ most for CoDA's gradients
wrt q and k: ``d|q - k|_1 / dq = sign(q - k)`` flips where rounding moves q_d past k_d, and where it
makes two close coordinates equal, the subgradients at the tie differ (+1 in the fused kernels, 0 in the
reference), which shows in the right-hand column too.

    python benchmarks/precision.py                 # table + bench-results/precision.json
    python benchmarks/precision.py --out my.json --length 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import attnkit as ak
from attnkit.cli.bench import _check_writable, _remove_empty
from attnkit._files import write_results

__all__ = ["SETTINGS", "measure", "main"]

SETTINGS: dict[str, object] = {
    "softmax": "softmax",
    "dnas": "dnas",
    "hnas(u=0.5)": ak.Hybrid(u0=0.5),
    "sinkhorn(k=3)": ak.Sinkhorn(iters=3),
    "sinkhorn(k=10)": ak.Sinkhorn(iters=10),
    "coda(scaled)": ak.CoDA(gate="scaled"),
    "coda(sigmoid)": ak.CoDA(gate="sigmoid"),
    "coda(centered)": ak.CoDA(gate="centered"),
    "coda(center_e)": ak.CoDA(center_e=True),
    "coda(center_e,centered)": ak.CoDA(center_e=True, gate="centered"),
    "coda(sigmoid*tanh)": ak.CoDA(e_activation="sigmoid", n_activation="tanh"),
    "coda(arctan*arctan)": ak.CoDA(e_activation="arctan", n_activation="arctan"),
    "coda(algebraic*algebraic)": ak.CoDA(e_activation="algebraic", n_activation="algebraic"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def available_backends() -> list[str]:
    backends = ["reference"]
    if importlib.util.find_spec("attnkit.kernels") is not None:
        backends.append("efficient")
    return backends


def _inputs(B: int, H: int, L: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([L] + [max(1, L * 5 // 8)] * (B - 1))
    mask = torch.arange(L)[None, :] < lengths[:, None]  # (B, L)
    grad_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    return q, k, v, mask, grad_out


def _run(mechanism, q, k, v, mask, grad_out, dtype, backend, round_to=None):
    """``out, dq, dk, dv`` as float64; ``round_to`` first rounds the inputs, the output's gradient
    ``grad_out`` included, through that dtype (as the run in that dtype reads them)."""
    if round_to is not None:
        q, k, v, grad_out = (t.to(round_to).to(dtype) for t in (q, k, v, grad_out))
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = ak.attention(*leaves, mechanism, key_mask=mask, query_mask=mask, backend=backend)
    dq, dk, dv = torch.autograd.grad((out * grad_out.to(dtype)).sum(), leaves)
    return [t.detach().double() for t in (out, dq, dk, dv)]


def measure(B: int = 2, H: int = 4, L: int = 128, D: int = 32, seed: int = 0) -> list[dict]:
    """One row per (mechanism, backend, dtype): max abs errors against float64 and the float64 magnitudes."""
    q, k, v, mask, grad_out = _inputs(B, H, L, D, seed)
    real = mask[:, None, :, None]  # (B, 1, L, 1): rows of real tokens
    rows = []
    for name, mechanism in SETTINGS.items():
        exact = _run(mechanism, q, k, v, mask, grad_out, torch.float64, "reference")
        for dtype_name, dtype in DTYPES.items():
            exact_rounded = _run(
                mechanism, q, k, v, mask, grad_out, torch.float64, "reference", round_to=dtype
            )
            for backend in available_backends():
                start = time.perf_counter()
                got = _run(mechanism, q, k, v, mask, grad_out, dtype, backend)
                seconds = time.perf_counter() - start
                row = {"mechanism": name, "backend": backend, "dtype": dtype_name, "seconds": seconds}
                for label, a, b, c in zip(("out", "dq", "dk", "dv"), got, exact, exact_rounded):
                    row[f"{label}_err"] = ((a - b) * real).abs().max().item()
                    row[f"{label}_err_rounded_inputs"] = ((a - c) * real).abs().max().item()
                    row[f"{label}_max"] = (b * real).abs().max().item()
                    row[f"{label}_mae"] = ((a - b) * real).abs().sum().item() / (real.sum().item() * H * D)
                rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    cols = ("out", "dq", "dk", "dv")
    header = (
        f"{'mechanism':<26} {'backend':<10} {'dtype':<9} "
        + " ".join(f"{c:>8}" for c in cols)
        + " | "
        + " ".join(f"{c + '*':>8}" for c in cols)
        + f" {'|out|':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r["dtype"], list(SETTINGS).index(r["mechanism"]), r["backend"])):
        lines.append(
            f"{r['mechanism']:<26} {r['backend']:<10} {r['dtype']:<9} "
            + " ".join(f"{r[c + '_err']:8.1e}" for c in cols) + " | "
            + " ".join(f"{r[c + '_err_rounded_inputs']:8.1e}" for c in cols) + f" {r['out_max']:6.2f}"
        )
    lines.append("left: vs float64 on the original inputs; * right: vs float64 on the same rounded inputs")
    return "\n".join(lines)


def flex_rule(rows: list[dict]) -> list[dict]:
    """PyTorch's rule for FlexAttention: the efficient backend's mean abs error vs float64 is at most
    10x (float32) / 1.1x (bfloat16) the reference backend's at the same precision. One row per
    (mechanism, dtype): the ratio for out, dq, dk, dv and whether all four are within the factor."""
    factors = {"float32": 10.0, "bfloat16": 1.1}
    by_key = {(r["mechanism"], r["dtype"], r["backend"]): r for r in rows}
    checks = []
    for (name, dtype, backend), eff in by_key.items():
        ref = by_key.get((name, dtype, "reference"))
        if backend != "efficient" or ref is None:
            continue
        ratios = {c: eff[f"{c}_mae"] / max(ref[f"{c}_mae"], 1e-30) for c in ("out", "dq", "dk", "dv")}
        ok = all(eff[f"{c}_mae"] <= factors[dtype] * ref[f"{c}_mae"] + 1e-12 for c in ratios)
        checks.append({"mechanism": name, "dtype": dtype, "factor": factors[dtype], **ratios, "holds": ok})
    return checks


def _rule_table(checks: list[dict]) -> str:
    header = f"{'mechanism':<26} {'dtype':<9} {'factor':>6} " + " ".join(
        f"{c:>6}" for c in ("out", "dq", "dk", "dv")
    )
    lines = [header + "  holds", "-" * (len(header) + 7)]
    for c in checks:
        lines.append(
            f"{c['mechanism']:<26} {c['dtype']:<9} {c['factor']:>6} "
            + " ".join(f"{c[x]:6.2f}" for x in ("out", "dq", "dk", "dv"))
            + ("  yes" if c["holds"] else "  NO")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/precision.json", help="JSON file to write")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", os.sep)):
        what = "is a folder" if out.is_dir() else "names a folder"
        parser.error(f"--out {args.out} {what}; pass a file path such as {out / 'precision.json'}")
    if out.exists() and not args.overwrite:
        parser.error(f"{args.out} exists; pass --overwrite to replace it or pick another --out")
    for name in ("batch", "heads", "length", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:  # found before the run, not after it; the last check, as it makes the folders of --out
        created = _check_writable(out)
    except OSError as exc:  # unwritable, or a symbolic link to nothing
        parser.error(str(exc))
    try:
        _measure_and_write(args, out)
    except BaseException:
        _remove_empty(created)  # a failed or stopped run leaves no empty folder behind
        raise
    return 0


def _measure_and_write(args: argparse.Namespace, out: Path) -> None:
    """Measure, print the tables and write ``out``."""
    torch.manual_seed(args.seed)
    rows = measure(args.batch, args.heads, args.length, args.head_dim, args.seed)
    print(
        f"max abs error vs float64 (B={args.batch}, H={args.heads}, L={args.length}, D={args.head_dim}, "
        "padded)"
    )
    print(_table(rows))
    checks = flex_rule(rows)
    if checks:
        print("\nmean abs error, efficient / reference (FlexAttention rule: <= 10 float32, <= 1.1 bfloat16)")
        print(_rule_table(checks))
    payload = {
        "config": {"B": args.batch, "H": args.heads, "L": args.length, "D": args.head_dim, "seed": args.seed},
        "torch": torch.__version__,
        "attnkit": ak.__version__,
        "machine": platform.machine(),
        "backends": available_backends(),
        "rows": rows,
        "flex_rule": checks,
    }
    try:
        write_results(out, json.dumps(payload, indent=2) + "\n", overwrite=args.overwrite)
    except FileExistsError as err:  # it appeared during the run: kept, the results beside it
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
