"""The FlexAttention peer of ``attnkit bench`` (kernels/flex_peer.py) against the float64 reference, and the
bench's CUDA options failing clearly without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.benchmark import BenchConfig
from attnkit.kernels import flex_peer
from attnkit.kernels.flex_peer import CALL_SITES, flex_potentials


@pytest.mark.parametrize("mechanism,iters,u", [("dnas", 1, None), ("hnas", 1, 0.5), ("sinkhorn", 3, None)])
def test_flex_form_matches_reference_forward(mechanism, iters, u):
    """FlexAttention has no backward on the CPU: the forward of the same formulas is checked here."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mech = ak.Sinkhorn(iters=iters) if mechanism == "sinkhorn" else mechanism
    kw = {"hybrid_weight": u} if u is not None else {}
    ref = ak.attention(q, k, v, mech, backend="reference", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is not compiled
        out = flex_potentials(q.float(), k.float(), v.float(), iters=iters, u=u)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("mechanism,iters,u", [("dnas", 1, None), ("hnas", 1, 0.5), ("sinkhorn", 3, None)])
def test_each_call_site_gets_one_kind_of_score_mod(mechanism, iters, u):
    """One compiled function per call site (``flex_call``): a site always sees the same kind of score_mod,
    so that switching between sites never recompiles (one compiled function for every site recompiled at
    each switch, and torch 2.11 crashed while logging the reason). The sites' outputs are those of one
    function."""
    from torch.nn.attention.flex_attention import flex_attention

    seen = {site: set() for site in CALL_SITES}

    def site_fn(site):
        def call(*args, score_mod=None, **kwargs):
            seen[site].add(None if score_mod is None else score_mod.__name__)
            return flex_attention(*args, score_mod=score_mod, **kwargs)
        return call

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_potentials(q, k, v, iters=iters, u=u, flex={s: site_fn(s) for s in CALL_SITES})
        one = flex_potentials(q, k, v, iters=iters, u=u)
    torch.testing.assert_close(out, one)
    assert all(len(kinds) <= 1 for kinds in seen.values()), seen
    assert seen["columns"] == {None} and seen["output"] == {"add_b"}


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_compiled_flex_call_runs_again_and_again(mechanism, monkeypatch):
    """Compiled (dynamo with the eager backend: inductor on the CPU has no ``return_lse``), every call of
    ``flex_call``'s function gives the uncompiled formulas' output. With one compiled function for every call
    site, the second call recompiled and dynamo crashed while logging why (AttributeError "'NoneType' object
    has no attribute '__closure__'"). Nothing recompiles: with the deprecated ``return_lse`` every site
    compiled twice (its first graph was guarded on flex_attention's deprecation warning not shown yet)."""
    import functools

    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())  # as in a fresh process
    torch._dynamo.reset()
    f = flex_peer.flex_call(mechanism, 3)
    iters, u = (3, None) if mechanism == "sinkhorn" else (1, 0.5 if mechanism == "hnas" else None)
    g = torch.Generator().manual_seed(2)
    first = [torch.randn(1, 2, 128, 16, generator=g) for _ in range(3)]
    inputs = (first, first, [torch.randn(1, 2, 128, 16, generator=g) for _ in range(3)])
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs = [f(q, k, v) for q, k, v in inputs]  # compiled calls first, before any eager flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for out, (q, k, v) in zip(outputs, inputs):
            torch.testing.assert_close(out, flex_potentials(q, k, v, iters=iters, u=u), atol=1e-5, rtol=1e-5)


def test_flex_backend_needs_cuda():
    with pytest.raises(ValueError, match="--device cuda"):
        BenchConfig(backends=("efficient", "flex"), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_device_cuda_without_cuda_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "cuda", "--quick", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "CUDA is not available" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
