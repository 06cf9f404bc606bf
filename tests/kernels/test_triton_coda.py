"""The Triton CoDA kernel (kernels/triton_coda.py) in Triton's interpreter against the float64 reference:
outputs and gradients for the gate / activation / centering variants, every mask (padding, causal, boolean
attn_mask, fully masked rows), odd and rectangular sizes, low precision, the inference path and the CUDA
route of the efficient backend."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU

import pytest
import torch

import attnkit as ak

triton = pytest.importorskip("triton")

from attnkit.kernels import _triton_kernels, dispatch, triton_coda  # noqa: E402
from attnkit.kernels.triton_coda import triton_coda_attention  # noqa: E402
from attnkit.masks import build_mask  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton_kernels.INTERPRETED, reason="triton was imported before TRITON_INTERPRET=1 was set"
)


def _inputs(B, H, Lq, Lk, D, Dv, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv))
    return [(spread * torch.randn(s, generator=g, dtype=torch.float64)).requires_grad_() for s in shapes]


def _padding(B, Lq, Lk, seed=1):
    g = torch.Generator().manual_seed(seed)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.3
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False  # left padding on the last element
    return km, qm


def _run(config, q, k, v, *, dtype=torch.float32, key_mask=None, query_mask=None, attn_mask=None,
         causal=False, block=None, d_chunk=None):
    """``(out, ref, grads, ref_grads)`` of the Triton kernel (inputs cast to ``dtype``) and the reference."""
    B, H, Lq, D = q.shape
    masks = dict(key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask, causal=causal)
    ref = ak.attention(q, k, v, config, backend="reference", **masks)
    info = build_mask(B, H, Lq, k.shape[2], **masks, device=q.device, allow_bias=False)
    out = triton_coda_attention(q.to(dtype), k.to(dtype), v.to(dtype), info, config, scale=D**-0.5,
                                block=block, d_chunk=d_chunk)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    return out, ref, grads, ref_grads


def _close(out, ref, grads, ref_grads, atol=2e-5, rtol=1e-4):
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    for n, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, n=n: f"d{n}: {m}")


CONFIGS = {
    "default": ak.CoDA(),
    "sigmoid_gate": ak.CoDA(gate="sigmoid", alpha=1.7, beta=0.6),
    "centered": ak.CoDA(gate="centered"),
    "center_e": ak.CoDA(center_e=True, gate="centered"),
    "arctan_algebraic": ak.CoDA(e_activation="arctan", n_activation="algebraic"),
    "algebraic_arctan": ak.CoDA(e_activation="algebraic", n_activation="arctan", center_e=True),
    "sigmoid_tanh": ak.CoDA(e_activation="sigmoid", n_activation="tanh"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference_with_padding_on_both_sides(name):
    q, k, v = _inputs(2, 2, 19, 23, 8, 5)  # two 16-wide tiles each way, the last one partial
    km, qm = _padding(2, 19, 23)
    _close(*_run(CONFIGS[name], q, k, v, key_mask=km, query_mask=qm))


@pytest.mark.parametrize("name", ["default", "centered"])
def test_matches_reference_without_masks_rectangular_odd_dims(name):
    q, k, v = _inputs(1, 3, 9, 37, 6, 3, seed=3)  # Lq < Lk, D and Dv not powers of two
    _close(*_run(CONFIGS[name], q, k, v))
    _close(*_run(CONFIGS[name], q, k, v, block=32, d_chunk=4))  # the compiled float32 defaults


def test_l1_distance_in_chunks_of_d_matches_one_step():
    q, k, v = _inputs(1, 2, 17, 18, 20, 4, seed=4)  # D = 20: chunks of 8 cover it in three steps
    km, qm = _padding(1, 17, 18)
    _close(*_run(CONFIGS["center_e"], q, k, v, key_mask=km, query_mask=qm, d_chunk=8))


def test_l1_gradient_of_tied_coordinates_is_zero_as_in_the_reference():
    """Integer-valued queries and keys tie in many coordinates (q_id = k_jd), where the L1 distance's
    gradient takes sign(0) = 0; every other coordinate its sign, in both the row and the column pass."""
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randint(-2, 3, (1, 2, 19, 12), generator=g).double().requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 19, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert (q[..., :, None, :] == k[..., None, :, :]).float().mean() > 0.15  # ties are common
    km, qm = _padding(1, 19, 19)
    for d_chunk in (4, 8):
        _close(*_run(CONFIGS["sigmoid_gate"], q, k, v, key_mask=km, query_mask=qm, d_chunk=d_chunk))


@pytest.mark.parametrize("name", ["default", "arctan_algebraic"])
def test_causal_matches_reference(name):
    q, k, v = _inputs(2, 2, 21, 21, 8, 8, seed=5)
    km, _ = _padding(2, 21, 21)
    _close(*_run(CONFIGS[name], q, k, v, key_mask=km, causal=True))
    q, k, v = _inputs(1, 1, 7, 20, 4, 4, seed=6)  # rectangular causal: top-left aligned
    _close(*_run(CONFIGS[name], q, k, v, causal=True))


@pytest.mark.parametrize("shape", [(2, 2, 13, 17), (1, 1, 13, 17), (2, 1, 1, 17), (1, 2, 13, 1)])
def test_boolean_attn_mask_read_through_broadcast_strides(shape):
    q, k, v = _inputs(2, 2, 13, 17, 8, 6, seed=7)
    g = torch.Generator().manual_seed(8)
    attn = torch.rand(shape, generator=g) > 0.4
    _, qm = _padding(2, 13, 17)
    _close(*_run(CONFIGS["centered"], q, k, v, attn_mask=attn, query_mask=qm))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = _inputs(3, 2, 10, 12, 4, 4, seed=9)
    km = torch.ones(3, 12, dtype=torch.bool)
    qm = torch.ones(3, 10, dtype=torch.bool)
    km[1] = False  # no valid key: element 1 returns zeros (and its means have no pairs)
    qm[2, 3:] = False
    out, ref, grads, ref_grads = _run(CONFIGS["center_e"], q, k, v, key_mask=km, query_mask=qm)
    assert torch.all(out[1] == 0) and torch.all(out[2, :, 3:] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
    _close(out, ref, grads, ref_grads)


def test_saturated_activations_stay_finite():
    q, k, v = _inputs(1, 2, 20, 20, 8, 8, seed=10, spread=12.0)  # |E|, |N| of order 100
    out, ref, grads, ref_grads = _run(CONFIGS["arctan_algebraic"], q, k, v)
    assert torch.isfinite(out).all()
    _close(out, ref, grads, ref_grads, atol=5e-4, rtol=1e-3)
    out, ref, grads, ref_grads = _run(CONFIGS["default"], q, k, v)
    _close(out, ref, grads, ref_grads, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["default", "centered"])
def test_low_precision_error_is_a_small_multiple_of_eager(name, dtype):
    """FlexAttention's rule: error against float64 at most a few times that of the eager path in ``dtype``."""
    q, k, v = _inputs(2, 2, 19, 21, 16, 16, seed=11)
    km, qm = _padding(2, 19, 21)
    out, ref, grads, ref_grads = _run(CONFIGS[name], q, k, v, dtype=dtype, key_mask=km, query_mask=qm)
    assert out.dtype == dtype
    ql, kl, vl = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    eager = ak.attention(ql, kl, vl, CONFIGS[name], key_mask=km, query_mask=qm, backend="reference")
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    eager_grads = torch.autograd.grad(eager, (ql, kl, vl), g.to(dtype))
    for fast, slow, exact in zip((out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        err_fast = (fast.double() - exact).abs().max().item()
        err_eager = (slow.double() - exact).abs().max().item()
        assert err_fast <= 5 * err_eager + 1e-3, (err_fast, err_eager)


def test_inference_saves_nothing_and_matches_training_bitwise():
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(2, 2, 13, 11, 8, 8, seed=12))
    km, qm = _padding(2, 13, 11)
    info = build_mask(2, 2, 13, 11, key_mask=km, query_mask=qm, device=q.device, allow_bias=False)
    train = triton_coda_attention(q, k, v, info, CONFIGS["centered"], scale=0.3)
    with torch.no_grad():
        infer = triton_coda_attention(q, k, v, info, CONFIGS["centered"], scale=0.3)
    assert train.grad_fn is not None and infer.grad_fn is None
    assert torch.equal(train, infer)


def test_efficient_backend_routes_cuda_tensors_to_triton_coda(monkeypatch):
    """``dispatch._triton_coda_module`` is the CUDA switch; on the CPU the interpreter stands in for it."""
    calls = []

    def route(q):
        calls.append(q.shape)
        return triton_coda

    monkeypatch.setattr(dispatch, "_triton_coda_module", route)
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(2, 2, 9, 10, 8, 8, seed=13))
    km, qm = _padding(2, 9, 10)
    plan = ak.explain_dispatch(q, k, v, "coda", key_mask=km, backend="auto")
    assert plan.route == "coda_triton", str(plan)
    out = ak.attention(q, k, v, ak.CoDA(gate="centered"), key_mask=km, query_mask=qm, backend="auto")
    assert calls, "backend='auto' did not take the Triton CoDA route"
    ref = ak.attention(q.double(), k.double(), v.double(), ak.CoDA(gate="centered"), key_mask=km,
                       query_mask=qm, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    drop = ak.explain_dispatch(q, k, v, "coda", dropout_p=0.1, backend="auto")
    assert drop.route == "reference"  # the kernel does not apply dropout


def test_plan_says_why_cpu_tensors_do_not_take_triton_coda():
    q, k, v = (t.detach().float() for t in _inputs(1, 1, 4, 4, 4, 4))
    plan = ak.explain_dispatch(q, k, v, "coda", backend="efficient")
    assert plan.route != "coda_triton" and plan.route in ak.kernels.ROUTES
    info = build_mask(1, 1, 4, 4, device=q.device, allow_bias=False)
    why_not = dispatch.ROUTES["coda_triton"].supports(dispatch.Call(q, k, v, ak.CoDA(), info, 0.0))
    assert why_not is not None and "CUDA" in why_not and "[triton]" in why_not
    with pytest.raises(ValueError, match="float64|backend='reference'"):
        triton_coda_attention(q.double(), k.double(), v.double(), info, ak.CoDA(), scale=0.5)


_COMPILE = r"""
import sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnkit.kernels import _triton_coda_kernels as K

FLOATS, INTS = ("se", "sn", "g_lo", "g_scale"), ("pm_b", "pm_h", "pm_i", "pm_j", "H", "Lq", "Lk", "D", "Dv")
dtype, tl_dtype = sys.argv[1], getattr(tl, {"bf16": "bfloat16", "fp32": "float32"}[sys.argv[1]])
consts = dict(CENTER_E=True, CENTER_N=True, E_ACT=2, N_ACT=3, HAS_KM=True, HAS_QM=True, HAS_PM=True,
              CAUSAL=True, BLOCK_M=32, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64, BLOCK_DC=4,
              PREC="ieee" if dtype == "fp32" else "tf32", IN_T=tl_dtype, DOT_T=tl_dtype)
kernels = (("row_fwd", dict(SUMS=False)), ("row_fwd", dict(SUMS=True)), ("row_bwd", dict(SUMS=False)),
           ("col_bwd", {}))
for name, extra in kernels:
    fn, kc = K.KERNELS[name], {**consts, **extra}
    sig = {n: "constexpr" if n in kc else "fp32" if n in FLOATS else "i32" if n in INTS
           else "*" + dtype if n in ("Q", "K", "V", "DO") else "*i8" if n in ("KM", "QM", "PM") else "*fp32"
           for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=sig, constexprs=kc)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], name
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_target():
    """The interpreter runs Python semantics; Triton's compiler (sm_90 cubins, no GPU needed) must accept
    the same kernels, with the constexpr branches of the centered variants, every mask and arctan /
    algebraic (bfloat16, the dtype of ``attnkit bench --device cuda``)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _COMPILE, "bf16"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_the_wrapper_checks_what_the_kernel_reads():
    # a (1, Lk) key mask with B = 2 was read past its end, k of another batch size failed inside a reshape,
    # and block=16.0 with a TypeError
    from attnkit.config import CoDA

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    keys = torch.ones(2, 6, dtype=torch.bool)
    full = build_mask(2, 2, 5, 6, key_mask=keys, device=q.device, allow_bias=False)
    one = build_mask(1, 2, 5, 6, key_mask=keys[:1], device=q.device, allow_bias=False)
    torch.testing.assert_close(
        triton_coda_attention(q, k, v, one, CoDA(), scale=0.5),
        triton_coda_attention(q, k, v, full, CoDA(), scale=0.5),
    )
    with pytest.raises(ValueError, match="one batch and head size"):
        triton_coda_attention(q, k[:1], v[:1], full, CoDA(), scale=0.5)
    for name, value in (("block", 16.0), ("d_chunk", True)):
        with pytest.raises(ValueError, match=f"{name}={value!r}; expected a power of two"):
            triton_coda_attention(q, k, v, full, CoDA(), scale=0.5, **{name: value})


def test_a_nan_gradient_at_a_padded_query_stays_there():
    from attnkit.config import CoDA

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    qm = torch.ones(2, 6, dtype=torch.bool)
    qm[0, -2:] = False
    masks = build_mask(2, 2, 6, 6, query_mask=qm, device=q.device, allow_bias=False)
    out = triton_coda_attention(q, k, v, masks, CoDA(), scale=0.5)
    grad = torch.randn_like(out)
    grad[0, :, -1] = float("nan")
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, (q, k, v), grad))
