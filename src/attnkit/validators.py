"""Small validators for user-given values: each raises a ``ValueError`` whose message names the value and the
fix.

Used at the public boundary (config dataclasses, ``ak.attention``, module constructors, CLI/run configs), so
that the inner layers receive values that are already checked. ``what`` is how the message refers to the
value (``"Sinkhorn(iters=-1)"``, ``"scale=0"``); ``expected`` says what would be accepted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "is_number",
    "check_number",
    "check_int",
    "check_bool",
    "check_seed",
    "SEED_MAX",
    "check_choice",
    "check_float_tensor",
    "values_hidden",
    "unbatched_values",
    "EAGER_UNDER_COMPILE",
]


def is_number(value: Any) -> bool:
    """A real number: Python's or NumPy's (``bool`` excluded: ``True`` is not a weight or a length)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_number(
    value: Any,
    what: str,
    expected: str,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    sep: str = ": ",
) -> float:
    """``float(value)`` if it is a number inside ``[low, high]`` (ends excluded with ``*_open``), else a
    ``ValueError`` ``"{what}{sep}{expected}"``. NaN is always rejected."""
    ok = is_number(value) and not math.isnan(value) and (not finite or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(f"{what}{sep}{expected}")
    return float(value)


def check_int(value: Any, what: str, expected: str, *, low: Optional[int] = None) -> int:
    """``int(value)`` if it is an integer (Python's or NumPy's, not ``bool``) ``>= low``, else a
    ``ValueError`` ``"{what}: {expected}"``."""
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or (low is not None and value < low):
        raise ValueError(f"{what}: {expected}")
    return int(value)


SEED_MAX = 2**32 - 1  # NumPy's seeds (and transformers' set_seed, which seeds NumPy) stop here


def check_seed(value: Any, what: str = "seed", high: int = SEED_MAX) -> int:
    """``int(value)`` if it is an integer (not ``bool``) in ``[0, high]``, else a ``ValueError`` naming it
    (a larger one failed later, deep in a seeding call, with "Overflow when unpacking long long")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= high:
        limit = {SEED_MAX: "2**32 - 1", 2**64 - 1: "2**64 - 1"}.get(high, str(high))
        raise ValueError(f"{what}={value!r}; expected an integer in [0, {limit}]")
    return int(value)


def check_bool(value: Any, what: str) -> bool:
    """``value`` if it is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected True or False")
    return value


def check_choice(value: Any, what: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in tuple(choices):
        raise ValueError(f"{what}: expected one of {tuple(choices)}")
    return value


def check_float_tensor(value: Any, name: str, *, device: Optional[torch.device] = None) -> Tensor:
    """``value`` if it is a floating tensor (on ``device`` when given)."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a floating torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {value.dtype}; expected a floating dtype")
    if device is not None and value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but the inputs are on {device}; move it with .to(device)"
        )
    return value


def values_hidden(t: Tensor) -> bool:
    """Whether ``t`` is batched by ``torch.func.vmap`` (at any level of nested transforms), so that its values
    cannot be read on the host: a check that reads them (``bool(m.all())``) raises there. Callers then take
    the path that is right for every value (e.g. treat a mask as padded) and skip checks of the values."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return functorch.is_legacy_batchedtensor(t)


def unbatched_values(t: Tensor, trailing: int = 0) -> Optional[Tensor]:
    """The plain tensor under ``vmap``'s batching of ``t`` (every example's values, the mapped dimensions
    somewhere among the leading ones), on which a check of the values can run as on a batched call; ``None``
    when a mapped dimension is among the last ``trailing`` dimensions (a check of ``(Lq, Lk)`` patterns needs
    them intact)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        batched = functorch.is_batchedtensor(t)
        bdim = functorch.maybe_get_bdim(t) if batched else None
        t = functorch.get_unwrapped(t)
        if batched and bdim >= t.dim() - trailing:
            return None
    return t


_TORCHSCRIPT = (
    "attnkit's attention reads masks and shapes on the host to choose its path (self- or cross-attention, "
    "a 0/-inf float mask read as padding, the kernel route), which TorchScript would freeze into the graph "
    "and replay for other inputs; use torch.compile, which reruns those checks"
)


_EXPORT = (
    "attnkit's attention reads masks and shapes on the host to choose its path (self- or cross-attention, "
    "a 0/-inf float mask read as padding, the kernel route) and runs kernels a graph cannot hold, so no "
    "exported program can carry it; run the model in PyTorch (torch.compile speeds it up), or export a "
    "softmax model without attnkit"
)


def check_not_traced(what: str) -> None:
    """A ``ValueError`` under ``torch.jit.trace``, whose recording keeps the host-side decisions of the
    traced call (a traced self-attention call reused for cross-attention was off by 0.96), and under
    ``torch.export`` / ``torch.onnx.export`` (which failed with torch-internal errors asking to report an
    issue to PyTorch)."""
    if torch.jit.is_tracing():
        raise ValueError(f"{what} cannot be traced with torch.jit.trace (nor exported by torch.onnx.export("
                         f"dynamo=False), which traces): {_TORCHSCRIPT}")
    if torch.compiler.is_exporting():
        raise ValueError(f"{what} cannot be exported (torch.export, torch.onnx.export): {_EXPORT}")


class NotScriptable:
    """Refuses ``torch.jit.script`` of the module (or of a model holding it) with a sentence, not
    TorchScript's error about a type annotation."""

    def __prepare_scriptable__(self):
        raise ValueError(f"{type(self).__name__} cannot be compiled with torch.jit.script: {_TORCHSCRIPT}")


# The reason torch.compile(fullgraph=True) prints when it meets attnkit's eager calls (its own hint said to
# remove the torch.compiler.disable call, or to report ContextVar.get to PyTorch)
EAGER_UNDER_COMPILE = (
    "attnkit's attention runs eagerly under torch.compile (one graph break per call: its route reads the "
    "masks' values and its kernels are opaque to the tracer); torch.compile(fullgraph=True) is not "
    "supported, compile without fullgraph=True (attnkit README, torch.compile)"
)
