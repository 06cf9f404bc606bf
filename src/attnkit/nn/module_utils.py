"""Helpers shared by the attention modules: mechanism + ``u0`` resolution and torch-style masks.

Hybrid attention (HNAS), "Attention that does not Explain Away" (arXiv:2009.14308) section 5 and
docs/design.md section 2: each module holds one learnable ``theta`` per head and mixes
``u = sigmoid(theta)``, ``pi^H = u * pi^D + (1 - u) * pi^L``; ``theta`` starts at ``logit(u0)``
(``attnkit.registry.initial_theta``, the one ``u0 -> theta`` policy).

The ``torch.nn`` modules mark padding with **True = ignore** (``key_padding_mask``) and disallowed
pairs with **True = not allowed** (boolean ``attn_mask``), or use additive float masks. The
functional core uses the opposite boolean convention (True = may attend); the helpers here convert.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..config import Hybrid, MechanismConfig, MechanismLike
from ..masks import MASKED_BIAS
from ..mechanisms import sigmoid_weight, whole_theta
from ..registry import config_label, initial_theta, resolve_options
from ..validators import unbatched_values, values_hidden

__all__ = [
    "HybridWeightMixin",
    "resolve_module_mechanism",
    "mechanism_label",
    "canonical_mask",
    "to_additive",
    "append_columns",
    "positive_int",
    "flag",
    "check_like_parameters",
    "check_same_device_dtype",
    "zero_where",
    "readable",
    "all_finite",
]


def resolve_module_mechanism(mechanism: MechanismLike, u0: Optional[float]) -> MechanismConfig:
    """The config of ``mechanism`` with ``u0`` merged in (hnas only), validated for a learnable ``theta``.

    ``u0`` may come from ``ak.Hybrid(u0=...)`` or the ``u0`` argument (default 0.5); it must lie strictly
    inside (0, 1) because ``theta = logit(u0)`` has to be finite.
    """
    return resolve_options(mechanism, u0=u0, learnable_u=True)


mechanism_label = config_label


def canonical_mask(mask: Optional[Tensor], name: str, dtype: torch.dtype) -> Optional[Tensor]:
    """Validate a torch-style mask and simplify it.

    Returns ``None``, a boolean mask (True = ignore / not allowed), or a float additive mask in ``dtype``.
    A float mask holding only 0 and "not allowed" entries (``-inf``, or anything at or below
    ``attnkit.masks.MASKED_BIAS`` = -1e4, such as ``finfo.min`` or ``-1e9``) is turned into the equivalent
    boolean mask, so that it also works where additive biases do not (CoDA) and can mark padded queries;
    an ``attn_mask`` or ``key_padding_mask`` that requires grad (a learned bias) stays a float mask, so
    that its gradient flows.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor (bool, True = ignore, or float additive), got "
            f"{type(mask).__name__}"
        )
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise ValueError(
            f"{name} has dtype {mask.dtype}; expected torch.bool (True = ignore / not allowed) or a float "
            f"additive mask (-inf = not allowed); convert a 0/1 mask with {name}.bool()"
        )
    if values_hidden(mask):  # under vmap the values cannot be read
        if name.endswith("padding_mask"):
            raise ValueError(
                f"{name} is a float mask inside torch.func.vmap, where its values cannot be read to tell "
                f"padding (0 and -inf) from additive biases; pass a boolean {name} (True = ignore)"
            )
        return mask.to(dtype)  # an attn_mask: its -inf entries are masked pairs, the rest biases, as outside
    if bool(mask.isnan().any()) or bool(mask.isposinf().any()):
        raise ValueError(f"{name} contains NaN or +inf; use finite biases and -inf for what is not allowed")
    if name in ("attn_mask", "key_padding_mask") and mask.requires_grad and torch.is_grad_enabled():
        return mask.to(dtype)  # a learned bias (zeros at its start): a boolean copy would cut its gradient
    blocked = mask <= MASKED_BIAS
    if bool(((mask == 0) | blocked).all()):
        return blocked
    return mask.to(dtype)


def to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean (True = not allowed) or float mask as a float additive mask in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def append_columns(mask: Optional[Tensor], n: int) -> Optional[Tensor]:
    """Append ``n`` allowed key columns (False / 0.0) to a torch-style mask's last dimension."""
    if mask is None:
        return None
    extra = torch.zeros(*mask.shape[:-1], n, dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, extra], dim=-1)


class HybridWeightAccess:
    """Reading the hybrid weight of a module that holds ``theta`` (``None`` unless hnas): ``u =
    sigmoid(theta)`` (detached), the weight with its gradient, and loading a state_dict without ``theta``
    (saved by a softmax module or before ``theta`` existed), which keeps ``theta``'s value.
    ``_hybrid_config()`` is the mechanism's config."""

    theta: Optional[nn.Parameter]

    def _hybrid_config(self) -> MechanismConfig:
        return self.config

    @property
    def u(self) -> Tensor:
        """The hybrid weights ``sigmoid(theta)``, shape ``(H,)``, detached (for plots and logs). Other
        mechanisms have none: ``AttributeError`` (so ``hasattr(module, "u")`` is False)."""
        if self.theta is None:
            raise AttributeError(self._no_u())
        return torch.sigmoid(whole_theta(self.theta))  # all heads, also under FSDP2

    def __getattr__(self, name: str) -> Any:
        # Reached when a property raises AttributeError: nn.Module's lookup would replace the message by
        # "object has no attribute 'u'".
        if name == "u":
            raise AttributeError(self._no_u())
        return super().__getattr__(name)

    def _no_u(self) -> str:
        return (
            f"u exists only for mechanism 'hnas'; this {type(self).__name__} uses "
            f"{self._hybrid_config().name!r}"
        )

    def _hybrid_weight(self) -> Optional[Tensor]:
        """``sigmoid(theta)`` with its gradient, or ``None`` when the mechanism is not hnas."""
        return sigmoid_weight(self.theta) if self.theta is not None else None

    def _apply(self, fn, recurse: bool = True):
        """torch's ``_apply``; after ``to_empty()`` (which leaves whatever memory held, NaN too) an hnas
        ``theta`` gets ``logit(u0)``, as a newly built module has it: it is not in every state_dict
        (torch's modules have none), so a load after ``to_empty()`` may leave it as it is."""
        module = super()._apply(fn, recurse)
        if self.theta is not None and _from_to_empty(fn) and not self.theta.is_meta:
            with torch.no_grad():
                self.theta.fill_(initial_theta(self._hybrid_config()))
            self._theta_unset = False
        return module

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """torch's loading, except that a state_dict without ``theta`` loads into an hnas module, whose
        ``theta`` then keeps its value (``logit(u0)`` when new or after ``to_empty()``, and when built on
        the meta device and loaded with ``assign=True``), and that a strict load of an hnas layer's ``theta``
        into a module of another mechanism says so (torch says only "Unexpected key(s)")."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "theta"
        if self.theta is not None and key in state_dict:
            self._theta_unset = False
        if self.theta is not None and key not in state_dict and key in missing_keys:
            missing_keys.remove(key)
            self._init_unset_theta(state_dict, prefix)
        if self.theta is None and key in unexpected_keys and _loading_strictly():
            error_msgs.append(
                f"{key!r} is the hybrid weight of an hnas layer (the state_dict is an hnas layer's) but this "
                f"{type(self).__name__} uses mechanism {self._hybrid_config().name!r}: build it with "
                f"mechanism=\"hnas\", or drop the {key!r} key (load_state_dict(..., strict=False) ignores it)"
            )

    def _init_unset_theta(self, state_dict, prefix: str) -> None:
        """``theta = logit(u0)`` where it never had a value: a module built on the meta device, then given
        its other weights by ``assign=True`` (theta left on meta), as a newly built module has it."""
        if not getattr(self, "_theta_unset", False) or not self.theta.is_meta:
            return
        value = initial_theta(self._hybrid_config())
        # load_state_dict(..., assign=True): the weights' device and dtype
        like = next((v for k, v in state_dict.items()  # (children load after their parent)
                     if k.startswith(prefix) and isinstance(v, Tensor) and not v.is_meta), None)
        if like is None:
            return
        dtype = like.dtype if like.is_floating_point() else self.theta.dtype
        full = torch.full(self.theta.shape, value, device=like.device, dtype=dtype)
        self.theta = nn.Parameter(full, requires_grad=self.theta.requires_grad)
        self._theta_unset = False


def reset_submodules(module: nn.Module) -> None:
    """Call every submodule's own ``reset_parameters``, each before that of the modules holding it (so a
    module's choice for its children's tensors, such as zero output biases, is applied last).

    torch's ``nn.Transformer`` re-initializes only its matrices, so after ``to_empty()`` its biases and
    LayerNorm weights would keep whatever memory held; a model's ``reset_parameters`` calls this first."""
    for sub in reversed(list(module.modules())):
        if sub is not module and callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()


def _from_to_empty(fn) -> bool:
    """Whether ``fn`` (given to ``nn.Module._apply``) is ``to_empty()``'s: new memory, no values."""
    return getattr(fn, "__qualname__", "").startswith("Module.to_empty.")


def _loading_strictly() -> bool:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call that is loading (False outside one):
    torch passes ``strict=True`` to every ``_load_from_state_dict`` and applies the caller's at the end."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is nn.Module.load_state_dict.__code__:
            return bool(frame.f_locals.get("strict", False))
        frame = frame.f_back
    return False


class HybridWeightMixin(HybridWeightAccess):
    """The per-head hybrid weight of an attention module: ``theta (H,)`` for hnas (else ``None``), ``u =
    sigmoid(theta)``.

    The module sets ``self.config`` and calls ``_init_hybrid_weight`` in ``__init__`` and
    ``_reset_hybrid_weight`` in ``reset_parameters``.
    """

    config: MechanismConfig

    def _init_hybrid_weight(self, num_heads: int, **factory) -> None:
        if isinstance(self.config, Hybrid):
            self.theta = nn.Parameter(torch.empty(num_heads, **factory))
        else:
            self.register_parameter("theta", None)

    def _reset_hybrid_weight(self) -> None:
        if self.theta is not None:
            with torch.no_grad():
                self.theta.fill_(initial_theta(self.config))
            self._theta_unset = self.theta.is_meta  # built on the meta device: no value yet

    @property
    def mechanism(self) -> str:
        """The mechanism's name (``"softmax"``, ``"dnas"``, ``"hnas"``, ``"sinkhorn"``, ``"coda"``)."""
        return self.config.name


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor: the same object, or two views of the same elements (same
    storage address, shape, strides but those of size-1 dimensions, dtype, device), as ``x.transpose(0, 1)``
    passed as query and key is.
    Inside ``torch.func`` transforms (vmap, grad, jacrev, jvp) the wrappers are seen through: two views are
    one tensor when the plain tensors under them are and every level wraps them alike (same level, same
    mapped dimension), so self-attention is recognised there as in eager mode."""
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.device.type == "meta":
        return False
    try:
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        a, a_levels = _functorch_unwrapped(a)
        b, b_levels = _functorch_unwrapped(b)
        return (a_levels == b_levels and a.data_ptr() == b.data_ptr() != 0 and a.shape == b.shape
                and _strides(a) == _strides(b))
    except (RuntimeError, NotImplementedError):  # tensors without storage or sizes (traced, fake, nested)
        return False


def _strides(t: Tensor) -> tuple:
    """``t``'s strides where they address elements: a dimension of size 1 has no second element, so its
    stride (free in a view, e.g. ``x.view(x.shape)`` of a transposed batch of one) says nothing."""
    return tuple(None if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def _functorch_unwrapped(t: Tensor) -> tuple[Tensor, list]:
    """The plain tensor under ``torch.func``'s wrappers of ``t`` and, per wrapper from the outside in, its
    level and its mapped dimension (``None`` unless vmap's)."""
    functorch = torch._C._functorch
    levels = []
    while functorch.is_functorch_wrapped_tensor(t):
        bdim = functorch.maybe_get_bdim(t) if functorch.is_batchedtensor(t) else None
        levels.append((functorch.maybe_get_level(t), bdim))
        t = functorch.get_unwrapped(t)
    return t, levels


def positive_int(value: Any, name: str, extra: str = "") -> int:
    """``int(value)`` for a Python or NumPy integer >= 1 (not ``bool``), else a ``ValueError`` naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r}; expected a positive integer{extra}")
    return int(value)


def flag(value: Any, name: str) -> bool:
    """``bool(value)`` for ``True``/``False`` (NumPy's too): torch reads any truthy value, so ``"no"`` would
    mean yes."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r}; expected True or False")
    return bool(value)


def check_like_parameters(
    t: Tensor, weight: Tensor, what: str, owner: str, *, plural: bool = False, cast: str = "the inputs",
    holder: str = "module",
) -> None:
    """``t`` (named ``what``) on the device of ``owner``'s parameter ``weight`` and, outside autocast, of its
    dtype; else a ``ValueError`` naming both and the fix (a mismatch failed inside torch's matmul)."""
    is_, has = ("are", "have") if plural else ("is", "has")
    if t.device != weight.device:
        raise ValueError(
            f"{what} {is_} on {t.device} but {owner}'s parameters are on {weight.device}; move one with "
            ".to(device)"
        )
    if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
        raise ValueError(
            f"{what} {has} dtype {t.dtype} but {owner}'s parameters are {weight.dtype}; cast {cast} with "
            f".to({weight.dtype}) or the {holder} with .to({t.dtype})"
        )


def check_same_device_dtype(a: Tensor, a_what: str, b: Tensor, b_what: str, *, plural: bool = False,
                            hint: str = "") -> None:
    """Two inputs (``a`` named ``a_what``, ``b``) on one device and, outside autocast, of one dtype."""
    is_, has = ("are", "have") if plural else ("is", "has")
    if a.device != b.device:
        raise ValueError(
            f"{a_what} {is_} on {a.device} but {b_what} on {b.device}; move one with .to(device)"
        )
    if a.dtype != b.dtype and not torch.is_autocast_enabled(b.device.type):
        raise ValueError(
            f"{a_what} {has} dtype {a.dtype} but {b_what} {b.dtype}; cast one of them with .to(dtype){hint}"
        )


def zero_where(keep: Tensor, x: Tensor) -> Tensor:
    """``x`` with the entries where ``keep`` is False replaced by 0, by a select. On the CPU a tensor whose
    sum is finite (no NaN or inf anywhere) is returned as it is: its padded entries already weigh exactly 0,
    and the copies cost an RNN decoder, which attends to the same keys at every step, 25x the step's
    product. Inside ``torch.func.vmap``, where the sum cannot be read, always the select."""
    if x.device.type == "cpu" and not values_hidden(x) and bool(torch.isfinite(x.detach().sum())):
        return x
    return torch.where(keep, x, 0.0)


def readable(t: Tensor) -> Tensor:
    """``t`` itself, or inside ``torch.func.vmap`` the plain tensor of every example's values (the mapped
    dimensions among its leading ones), so that a check of the values (``.all()``, ``.min()``) can read them
    on the host there too: ``bool`` of a batched tensor raises torch's "data-dependent control flow"."""
    return unbatched_values(t) if values_hidden(t) else t


def all_finite(t: Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf (read on the host; for every example inside ``torch.func.vmap``)."""
    return bool(torch.isfinite(readable(t)).all())
