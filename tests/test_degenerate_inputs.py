"""Degenerate shapes get one clear ``ValueError`` on every backend: a ``hybrid_weight`` with more batch
elements than the input, zero heads, zero head dimension; an empty batch runs on every backend; and
``attnkit bench --out`` is checked before the benchmark runs."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.cli import main

BACKENDS = ("reference", "efficient", "auto")


def _qkv(B=2, H=2, Lq=5, Lk=6, D=4, Dv=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, Lq, D, generator=g), torch.randn(B, H, Lk, D, generator=g),
            torch.randn(B, H, Lk, Dv, generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_hybrid_weight_with_a_larger_batch_is_rejected(backend, masked):
    q, k, v = _qkv(B=2)
    masks = {"key_mask": torch.tensor([[True] * 6, [True] * 3 + [False] * 3])} if masked else {}
    u = torch.full((5, 2, 1, 1), 0.3)  # (B'=5 > B=2, H, 1, 1)
    with pytest.raises(ValueError, match=r"hybrid_weight has shape \(5, 2, 1, 1\).*B = 2"):
        ak.attention(q, k, v, "hnas", hybrid_weight=u, backend=backend, **masks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_weight_per_batch_element_still_works(backend):
    q, k, v = _qkv(B=2)
    u = torch.tensor([0.2, 0.7]).view(2, 1, 1, 1)  # (B, 1, 1, 1)
    out = ak.attention(q, k, v, "hnas", hybrid_weight=u, backend=backend)
    for b in range(2):
        one = ak.attention(
            q[b:b + 1], k[b:b + 1], v[b:b + 1], "hnas", hybrid_weight=float(u[b]), backend="reference"
        )
        torch.testing.assert_close(out[b:b + 1], one)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
@pytest.mark.parametrize("dims, message", [(dict(H=0), "H=0 heads"), (dict(D=0), "head dim D=0")])
def test_zero_heads_or_head_dim_is_one_clear_error(backend, mechanism, dims, message):
    q, k, v = _qkv(**dims)
    with pytest.raises(ValueError, match=message):
        ak.attention(q, k, v, mechanism, backend=backend, key_mask=torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mechanism", [*ak.MECHANISMS, ak.CoDA(gate="centered", center_e=True)], ids=str)
@pytest.mark.parametrize("masked", [False, True])
def test_an_empty_batch_gives_empty_outputs_and_gradients(backend, mechanism, masked):
    # B = 0 (the last, empty batch of a loader): every kernel must return at once, never divide by B
    q, k, v = (t.requires_grad_() for t in _qkv(B=0))
    masks = {"key_mask": torch.ones(0, 6, dtype=torch.bool), "query_mask": torch.ones(0, 5, dtype=torch.bool)}
    out = ak.attention(q, k, v, mechanism, backend=backend, **(masks if masked else {}))
    assert out.shape == (0, 2, 5, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("mechanism", [*ak.MECHANISMS, ak.CoDA(gate="centered", center_e=True)], ids=str)
def test_multihead_attention_takes_an_empty_batch(mechanism):
    module = ak.nn.MultiheadAttention(8, 2, batch_first=True, mechanism=mechanism)
    x = torch.randn(0, 4, 8, requires_grad=True)
    out, weights = module(x, x, x)
    assert out.shape == (0, 4, 8) and weights.shape == (0, 4, 4)
    out.sum().backward()
    assert x.grad.shape == x.shape


def _bench_error(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--mechanisms", "dnas", "--repeats", "1", "--no-memory", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_bench_out_directory_is_refused_before_running(tmp_path, capsys, monkeypatch):
    from attnkit import benchmark as bench_module

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before --out was checked")

    monkeypatch.setattr(bench_module, "run_bench", no_run)
    (tmp_path / "results").mkdir()
    err = _bench_error(capsys, ["--out", str(tmp_path / "results"), "--overwrite"])
    assert "is a directory" in err and "kernels.json" in err
    err = _bench_error(capsys, ["--out", "/proc/attnkit-bench/kernels.json"])
    assert "cannot be written" in err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_a_scale_or_bias_that_overflows_the_inputs_dtype_is_refused_not_nan(backend, mechanism):
    """Checked in float64 only: scale=1e39 with float32 inputs, or a float64 bias of 1e39, became inf and
    every output NaN."""
    q, k, v = _qkv(Lk=5)
    with pytest.raises(ValueError, match="scale=1e\\+39 overflows the scores' dtype"):
        ak.attention(q, k, v, mechanism, scale=1e39, backend=backend)
    bias = torch.zeros(5, 5, dtype=torch.float64)
    bias[0, 1] = 1e39
    with pytest.raises(ValueError, match="attn_mask holds 1e\\+39, which overflows q's dtype torch.float32"):
        ak.attention(q, k, v, mechanism, attn_mask=bias, backend=backend)
    bias[0, 1] = -1e39  # a masked pair, as -inf
    assert torch.isfinite(ak.attention(q, k, v, mechanism, attn_mask=bias, backend=backend)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "sinkhorn"])
def test_scores_that_overflow_are_refused_and_half_inputs_are_measured_in_float32(backend, mechanism):
    """scale=1e38 fits float32 but scale * q . k did not: every output was NaN. Float16 inputs are scored in
    float32, so scale=7e4 (beyond float16's largest 65504) works and was refused."""
    q, k, v = _qkv(Lk=5)
    with pytest.raises(ValueError, match=r"the scores scale \* q \. k may reach .* overflow to inf"):
        ak.attention(q, k, v, mechanism, scale=1e38, backend=backend)
    k_inf = k.clone()
    k_inf[:, :, -1] = float("inf")
    with pytest.raises(ValueError, match="may reach [0-9.]+e\\+4"):  # the padded key's inf is left out
        padded = torch.tensor([[True] * 4 + [False]] * q.shape[0])
        ak.attention(q, k_inf * 1e20, v, mechanism, key_mask=padded, scale=1e20, backend=backend)
    key_mask = torch.tensor([[True] * 4 + [False]] * q.shape[0])  # the inf key padded: it never matters
    out = ak.attention(q, k_inf, v, mechanism, key_mask=key_mask, backend=backend)
    assert torch.isfinite(out).all()
    half = [t.to(torch.float16) for t in (q, k, v)]
    assert torch.isfinite(ak.attention(*half, mechanism, scale=7e4, backend=backend)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_beyond_half_inputs_own_dtype_is_refused(backend):
    """Half inputs are scored in float32, but SDPA casts a float32 bias to float16: 1e5 became inf and every
    output NaN, where an earlier check had refused it."""
    q, k, v = (t.to(torch.float16) for t in _qkv(Lk=5))
    bias = torch.zeros(5, 5)
    bias[0, 1] = 1e5
    with pytest.raises(ValueError, match="attn_mask holds 1e\\+05, which overflows q's dtype torch.float16"):
        ak.attention(q, k, v, "softmax", attn_mask=bias, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float64])
def test_a_bias_that_pushes_finite_scores_past_the_dtype_is_refused_whatever_its_dtype(backend, bias_dtype):
    """A score of 1e38 plus a bias of 3e38 overflows float32: a float64 bias was refused, a float32 one (q's
    own dtype) entered no bound and every output was NaN."""
    q, k, v = torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 3, 1), torch.randn(1, 1, 3, 2)
    q[..., 0], k[..., 0, 0] = 1e19, 1e19  # the score of key 0: 1e38, finite in float32
    bias = torch.zeros(2, 3, dtype=bias_dtype)
    bias[:, 0] = 3e38
    with pytest.raises(ValueError, match=r"the scores scale \* q \. k may reach 4e\+38"):
        ak.attention(q, k, v, "softmax", scale=1.0, attn_mask=bias, backend=backend)
    bias[:, 0] = 1e37  # 1.1e38: fits
    assert torch.isfinite(ak.attention(q, k, v, "softmax", scale=1.0, attn_mask=bias, backend=backend)).all()


def test_coda_scores_are_bounded_through_the_l1_distance_too():
    """CoDA's ||q - k||_1 overflowed (q = 0, k = 1e37, D = 64: q . k = 0) and the outputs were NaN."""
    q, k, v = _qkv(Lk=5, D=64, Dv=4)
    with pytest.raises(ValueError, match=r"scale \* \|\|q - k\|\|_1 may reach"):
        ak.attention(torch.zeros_like(q), torch.full_like(k, 1e37), v, "coda")
