"""Tile sweep of the Triton potential kernels (``attnkit/kernels/triton_potentials.py``) on a CUDA GPU.

For each of the four kernels (column / row pass, forward / backward) and each candidate tile (BLOCK_M,
BLOCK_N, warps, pipeline stages), the other kernels keep the tiles of ``_TILES``: the sweep times the pass
the kernel belongs to (forward under ``no_grad`` for the forward kernels, forward+backward for the backward
ones) with ``triton.testing.do_bench`` (median, CUDA events) and checks the output and gradients against
those of ``_TILES``' tiles. DNAS times the plain variants; ``<kernel>_hybrid`` sweeps the variant of HNAS's
last round (its own tile in ``_TILES``) with HNAS. Then every mechanism is timed against SDPA with
``_TILES``' tiles and with the fastest tile of each kernel.

    python benchmarks/triton_tiles.py --phase compile --kernel col_fwd   # warm Triton's cache (parallel)
    python benchmarks/triton_tiles.py --phase time --out tiles.json      # time, one process on the GPU

The compile phase also runs the correctness check, so it can run as one process per kernel beside each
other before the timed phase, which must run alone. ``--candidates FILE`` (JSON: kernel name -> list of
tiles, or padded head size -> that) replaces the built-in candidates; ``--phase candidates`` writes such a
file from the tiles whose sm_90 build keeps each kernel's largest variant in registers (no GPU needed):

    python benchmarks/triton_tiles.py --phase candidates --shape 4,16,4096,64 --out candidates64.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

KERNELS = ("col_fwd", "row_fwd", "col_bwd", "row_bwd")
HYBRID = ("row_fwd_hybrid", "col_bwd_hybrid", "row_bwd_hybrid")  # HNAS's last round (forward's: row pass)
CANDIDATES = (
    (32, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3),
    (128, 128, 8, 3), (64, 64, 4, 2), (128, 32, 4, 3), (32, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
)
# the tiles `--phase candidates` tries (the sm_90 builds that keep them in registers become the candidates)
WIDE = CANDIDATES + (
    (32, 32, 4, 3), (32, 32, 8, 3), (64, 32, 8, 3), (128, 32, 8, 3), (32, 128, 8, 3), (16, 64, 4, 3),
    (64, 16, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (128, 128, 8, 2), (32, 128, 4, 5), (128, 32, 4, 5),
)
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def launcher_variants() -> list[tuple[str, dict]]:
    """``(kernel, flags)`` of every variant ``triton_potentials._forward`` / ``_backward`` compile (the
    rounds' flags; the masks and ``MASK_PAIRS`` come on top)."""
    import itertools

    both = (False, True)
    variants = [("col_fwd", dict(HAS_A=a, QBAR=b)) for a, b in itertools.product(both, both)]
    variants += [("row_fwd", dict(OUT=o, HYBRID=h)) for o, h in ((False, False), (True, False), (True, True))]
    variants += [("col_bwd", dict(OUTPUT=o, HYBRID=h, ACCUM=not o))
                 for o, h in ((True, False), (True, True), (False, False))]
    for output, prev, hybrid in itertools.product((True, False), both, both):
        if not (hybrid and not output):
            variants.append(("row_bwd", dict(OUTPUT=output, HAS_PREV=prev, HYBRID=hybrid, ACCUM=not output,
                                             WANT_GA=prev)))
    return variants


def sm90_build(name: str, flags: dict, tile, dtype: str, width: int, masks: bool) -> tuple[int, int]:
    """``(registers, stack bytes)`` per thread of one kernel variant's sm_90 build (no GPU needed), built
    as a launch with lengths and head sizes divisible by 16 builds it: Triton specializes such integer
    arguments (and 16-byte aligned pointers) as divisible by 16, which the build states with the same
    attribute. ``dtype``: bf16, fp16 or fp32. Call where Triton compiles (TRITON_INTERPRET unset)."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnkit.kernels import _triton_kernels as K
    from attnkit.kernels import triton_potentials as P

    tl_dtype = P._TL_DTYPES[{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]]
    fn = K.KERNELS[name]
    bm, bn, warps, stages = tile
    kc = dict(flags, HAS_KM=masks, HAS_QM=masks, MASK_PAIRS=masks, EVEN_S=not masks, EVEN_D=not masks,
              BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=width,
              BLOCK_DV=width, PREC="ieee" if dtype == "fp32" else "tf32", IN_T=tl_dtype, DOT_T=tl_dtype)
    kc = {n: c for n, c in kc.items() if n in fn.arg_names}  # the column pass of the forward has no V
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in kc]
    if missing:  # a constexpr left out would be built as a pointer argument
        raise ValueError(f"{name}: no value for the constexpr(s) {missing}")
    ints = ("H", "Lq", "Lk", "D", "Dv")
    sig = {n: "constexpr" if n in kc else "fp32" if n == "scale" else "i32" if n in ints
           else "*" + dtype if n in ("Q", "K", "V", "DO", "QBout", "QB") else "*i8" if n in ("KM", "QM")
           else "*fp32" for n in fn.arg_names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or sig[n] == "i32"}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=kc, attrs=divisible),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(usage.split("REG:")[1].split()[0]), int(usage.split("STACK:")[1].split()[0])


def candidates(dtype: str, width: int, limit: int = 10, log=print) -> dict:
    """Up to ``limit`` tiles per kernel name (``<kernel>_hybrid``: HNAS's last-round variant) whose sm_90
    build keeps the kernel's largest variant (masked) in registers: the launcher's tile first, then those of
    ``WIDE`` in its order (a timed sweep of every non-spilling tile would take minutes per head size)."""
    from attnkit.kernels import triton_potentials as P

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    table = P._tiles(None, width, torch_dtype)
    largest = {"col_fwd": dict(HAS_A=True, QBAR=True), "row_fwd": dict(OUT=True, HYBRID=False),
               "col_bwd": dict(OUTPUT=True, HYBRID=False, ACCUM=False),
               "row_bwd": dict(OUTPUT=False, HAS_PREV=True, HYBRID=False, ACCUM=True, WANT_GA=True),
               "row_fwd_hybrid": dict(OUT=True, HYBRID=True),
               "col_bwd_hybrid": dict(OUTPUT=True, HYBRID=True, ACCUM=False),
               "row_bwd_hybrid": dict(OUTPUT=True, HAS_PREV=True, HYBRID=True, ACCUM=False, WANT_GA=True)}
    found = {}
    for name, flags in largest.items():
        kernel = name.removesuffix("_hybrid")
        found[name] = []
        current = tuple(table.get(name) or table[kernel])
        for tile in (current,) + tuple(t for t in WIDE if t != current):
            if len(found[name]) == limit:
                break
            regs, stack = sm90_build(kernel, flags, tile, dtype, width, masks=True)
            log(f"{name} {tile}: {regs} registers, {stack} bytes of stack")
            if stack == 0:
                found[name].append(list(tile))
    return found


def _inputs(B, H, L, D, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3)]


@contextlib.contextmanager
def _using(tiles):
    """The launcher takes ``tiles`` for every kernel while the block runs: the backward builds its launch
    when ``.backward()`` runs, so a pass must hold this around its forward and its backward."""
    from attnkit.kernels import triton_potentials as P

    if tiles is None:
        yield
        return
    saved = P._tiles
    P._tiles = lambda block, width, dtype: tiles
    try:
        yield
    finally:
        P._tiles = saved


def _call(mechanism, tiles):
    import attnkit as ak

    def run(q, k, v):
        kw = {"sinkhorn_iters": 3} if mechanism == "sinkhorn" else {}
        return ak.attention(q, k, v, mechanism, backend="efficient", **kw)

    run.tiles = tiles
    return run


def _fwd(f, q, k, v):
    def go():
        with torch.no_grad(), _using(getattr(f, "tiles", None)):
            f(q, k, v)
    return go


def _fwd_bwd(f, q, k, v, g):
    def go():
        q.grad = k.grad = v.grad = None
        with _using(getattr(f, "tiles", None)):
            f(q, k, v).backward(g)
    return go


def _outputs(f, q, k, v, g):
    q.grad = k.grad = v.grad = None
    with _using(getattr(f, "tiles", None)):
        out = f(q, k, v)
        out.backward(g)
    return [t.detach().float().clone() for t in (out, q.grad, k.grad, v.grad)]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("candidates", "compile", "time"), required=True,
                        help="candidates: the non-spilling tiles from sm_90 builds (no GPU; --out FILE); "
                        "compile: warm Triton's cache; time: the sweep")
    parser.add_argument("--kernel", choices=KERNELS + HYBRID, action="append",
                        help="kernels to sweep (default: all, the hybrid variants included)")
    # at B=1, H=8 a forward of L=4096 takes a quarter of a millisecond on an H100, about what launching its
    # kernels from Python takes, and the sweep's times moved by 20-40% between identical tiles: fill the GPU
    parser.add_argument("--shape", default="4,16,4096,64", help="B,H,L,D (default 4,16,4096,64)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--candidates", type=Path, help="JSON: kernel name -> list of [BLOCK_M, BLOCK_N, "
                        "warps, stages], or padded head size -> that (benchmarks/tile_candidates.json, "
                        "written by --phase candidates); default: one built-in list for every kernel")
    parser.add_argument("--limit", type=int, default=10, help="tiles per kernel (candidates; default 10)")
    parser.add_argument("--out", type=Path, help="JSON results (time phase) or candidates")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--head-dims", help="candidates: comma-separated head sizes, e.g. 64,128; writes one "
                        "set per padded head size, as benchmarks/tile_candidates.json holds them (default: "
                        "the --shape's D, one set)")
    args = parser.parse_args(argv)

    try:
        B, H, L, D = (int(x) for x in args.shape.split(","))
        if min(B, H, L, D) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--shape {args.shape!r}: expected four positive integers B,H,L,D such as 4,16,4096,64")
    if args.out is not None:  # before the work: a run of minutes is not lost to a bad --out at its end
        if args.out.is_dir():
            parser.error(f"--out {args.out} is a folder; pass a file path")
        if args.out.exists() and not args.overwrite:
            parser.error(f"--out {args.out} exists; pass --overwrite to replace it or choose another --out")
        if not args.out.parent.is_dir() or not os.access(args.out.parent, os.W_OK):
            parser.error(f"--out {args.out}: its folder does not exist or cannot be written")
    if args.phase == "candidates":
        if args.limit < 1:
            parser.error(f"--limit {args.limit}: expected at least 1 tile per kernel")
        width = lambda d: max(16, 1 << (d - 1).bit_length())  # noqa: E731
        if args.head_dims:
            try:
                dims = [int(x) for x in args.head_dims.split(",")]
            except ValueError:
                parser.error(f"--head-dims {args.head_dims!r}: expected integers such as 64,128")
            found = {str(width(d)): candidates(_DTYPES[args.dtype], width(d), args.limit) for d in dims}
        else:
            found = candidates(_DTYPES[args.dtype], width(D), args.limit)
        text = json.dumps(found, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return 0
    candidates_ = {}
    if args.candidates is not None:
        try:
            raw = json.loads(args.candidates.read_text())
            width = max(16, 1 << (D - 1).bit_length())
            if raw and all(key.isdigit() for key in raw):  # one set per padded head size
                raw = raw[str(width)]
            candidates_ = {name: [tuple(int(x) for x in t) for t in tiles] for name, tiles in raw.items()}
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            parser.error(f"--candidates {args.candidates}: {exc}; expected a JSON object of kernel name -> "
                         "list of [BLOCK_M, BLOCK_N, warps, stages]")
    from triton.testing import do_bench

    from attnkit.kernels import triton_potentials as P

    if not torch.cuda.is_available():
        print("error: no CUDA device; the sweep times compiled Triton kernels on a GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    q, k, v = _inputs(B, H, L, D, dtype)
    g = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    base = dict(P._tiles(None, max(16, D), dtype))
    base_out = {m: _outputs(_call(m, base), q, k, v, g) for m in ("dnas", "hnas")}
    results = {"shape": [B, H, L, D], "dtype": args.dtype, "device": torch.cuda.get_device_name(),
               "base": base, "sweep": {}}
    for name in args.kernel or KERNELS + HYBRID:
        mechanism = "hnas" if name.endswith("_hybrid") else "dnas"
        rows = []
        for cand in candidates_.get(name, CANDIDATES):
            tiles = dict(base, **{name: cand})
            f = _call(mechanism, tiles)
            try:
                err = max(_rel(a, b) for a, b in zip(_outputs(f, q, k, v, g), base_out[mechanism]))
                _fwd(f, q, k, v)()  # the inference variants too (compiled here in the compile phase)
            except Exception as exc:  # e.g. out of shared memory for this tile
                rows.append({"tile": cand, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            row = {"tile": cand, "rel_err_vs_base": err}
            if args.phase == "time" and err < 2e-2:
                fn = _fwd(f, q, k, v) if "fwd" in name else _fwd_bwd(f, q, k, v, g)
                row["ms"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
            rows.append(row)
            print(name, cand, {k_: v_ for k_, v_ in row.items() if k_ != "tile"}, flush=True)
        results["sweep"][name] = rows
    if args.phase == "compile":
        return 0

    best = dict(base)
    for name, rows in results["sweep"].items():
        timed = [r for r in rows if "ms" in r]
        if timed:
            best[name] = tuple(min(timed, key=lambda r: r["ms"])["tile"])
    results["best"] = best
    sdpa = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_)  # noqa: E731
    table = []
    for mechanism in ("dnas", "hnas", "sinkhorn"):
        for label, tiles in (("base", base), ("best", best)):
            f = _call(mechanism, tiles)
            t = {}
            passes = (("fwd", lambda f_: _fwd(f_, q, k, v)), ("fwd_bwd", lambda f_: _fwd_bwd(f_, q, k, v, g)))
            for what, make in passes:
                s1 = do_bench(make(sdpa), warmup=10, rep=60, return_mode="median")
                m = do_bench(make(f), warmup=10, rep=60, return_mode="median")
                s2 = do_bench(make(sdpa), warmup=10, rep=60, return_mode="median")
                t[what] = {"ms": m, "sdpa_ms": (s1 + s2) / 2, "ratio": m / ((s1 + s2) / 2)}
            table.append({"mechanism": mechanism, "tiles": label, **t})
            print(f"{mechanism:9s} {label}: fwd x{t['fwd']['ratio']:.2f} ({t['fwd']['ms']:.3f} ms) "
                  f"fwd+bwd x{t['fwd_bwd']['ratio']:.2f} ({t['fwd_bwd']['ms']:.3f} ms)", flush=True)
    results["mechanisms"] = table
    print("best tiles:", json.dumps(best))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
