r"""``AlignmentRegularizer``: alignment attention as a plug-in regularizer for a model one already has
("Alignment Attention by Matching Key and Query Distributions", arXiv:2110.12567, eq. 1):

.. math::
    \mathcal{L} = \mathcal{L}_{\text{task}} + \lambda\, \frac{1}{|\text{layers}|} \sum_{\ell}
        \frac{1}{B H} \sum_{b, h} \mathcal{L}_{\text{align}}\big(q^{(\ell)}_{b h}, k^{(\ell)}_{b h}\big),
    \qquad \lambda = 0.01

where each :math:`\mathcal{L}_{\text{align}}` compares the queries and keys of the real tokens of one sample
in one head (``gan``, ``ot``, ``ct`` or ``mmd``; see the modules of the same names). The regularizer hooks the
model (``attnkit.align.capture``), so the model's outputs do not change; ``remove()`` takes the hooks away.

    reg = AlignmentRegularizer(model, method="ct", weight=0.01)
    opt = torch.optim.AdamW([*model.parameters(), *reg.parameters()])
    loss = task_loss(model(**batch)) + reg.loss()
"""

from __future__ import annotations

import keyword
import math
import numbers
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ._common import reduce_heads
from .capture import (
    Captured,
    ForwardState,
    _is_hf,
    cross_attention_hooks,
    end_hook,
    find_sites,
    mask_owner_hooks,
    start_hook,
)
from .ct import RHO, Critic, Navigator, ct_loss
from .gan import Discriminator, gan_loss
from .mmd import mmd as mmd_values
from .ot import BLUR, ot_loss

__all__ = ["AlignmentRegularizer", "AlignConfig", "METHODS"]

METHODS = ("gan", "ot", "ct", "mmd")


@dataclass(frozen=True)
class AlignConfig:
    """Settings of the alignment regularizer (defaults as in the paper and its code).

    ``method``: ``gan | ot | ct | mmd``; ``weight``: lambda >= 0; ``layers``: indices into the model's
    self-attention layers (None = all); ``hidden``: width of the discriminator / critic / navigator;
    ``rho``: CT's forward-direction weight; ``blur``: OT's blur (eps = blur^2); ``scaling``: OT's annealing
    ratio in ``(0, 1)`` (geomloss's; 0.5 stops short of the converged divergence on small heads, closer to 1
    converges further at more cost, see ``attnkit.align.ot``); ``gamma``: gradient-reversal factor;
    ``max_tokens``: when set, each call is matched on a random subset of at most this many positions (for
    graphs with thousands of nodes), drawn from the regularizer's own generator (seeded with ``seed``, in
    ``[0, 2**64)``). ``hidden`` and ``gamma`` are gan's and ct's, ``rho`` ct's, ``blur`` and ``scaling``
    ot's: a value other than the default for a method that does not use it is a ``ValueError``.
    """

    method: str = "ct"
    weight: float = 0.01
    layers: Optional[tuple[int, ...]] = None
    hidden: int = 16
    rho: float = RHO
    blur: float = BLUR
    scaling: float = 0.5
    gamma: float = 1.0
    max_tokens: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; expected one of {METHODS}")
        for name in ("weight", "rho", "blur", "scaling", "gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}; expected a finite number")
            object.__setattr__(self, name, float(value))  # NumPy scalars become Python floats
        if self.weight < 0:
            raise ValueError(f"weight={self.weight}; expected a number >= 0 (0.01 in the paper)")
        if not 0 <= self.rho <= 1:
            raise ValueError(f"rho={self.rho}; expected a number in [0, 1] (0.5 in the paper)")
        if not 0 < self.scaling < 1:
            raise ValueError(f"scaling={self.scaling}; expected a number in (0, 1) (geomloss's annealing "
                             "ratio, 0.5 by default; 0.9-0.99 converges further)")
        if self.blur <= 0 or self.gamma <= 0:
            raise ValueError(f"blur={self.blur}, gamma={self.gamma}; both must be > 0")
        for name in ("hidden", "max_tokens", "seed"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}={value!r}; expected an integer")
            if name != "seed" and value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
            object.__setattr__(self, name, int(value))  # NumPy integers become Python ints
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed}; expected an integer in [0, 2**64) (torch.Generator's range)")
        for name, users in _USED_BY.items():
            if self.method not in users and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} does nothing for method={self.method!r}; only "
                    f"method {' or '.join(map(repr, users))} uses it: drop it or choose that method"
                )
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, (tuple, list)):
                raise ValueError(f"layers={self.layers!r}; expected None or a sequence of layer indices")
            if not self.layers:
                raise ValueError("layers=(); pass None for every layer or at least one index")
            for i in self.layers:
                if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                    raise ValueError(f"layers={self.layers!r}: {i!r} is not an integer index")
            if len(set(self.layers)) != len(self.layers):
                raise ValueError(f"layers={self.layers!r} repeats an index")
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))


# the options a method reads (the others apply to every method)
_USED_BY = {"hidden": ("gan", "ct"), "rho": ("ct",), "blur": ("ot",), "scaling": ("ot",),
            "gamma": ("gan", "ct")}
_DEFAULTS = {f.name: f.default for f in fields(AlignConfig)}


def _hf_submodules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models inside ``model`` (not ``model`` itself) that have self-attention:
    name and module. An attention-free one (a ResNet or ConvNeXt backbone) is not listed; one whose attention
    the regularizer cannot read is."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and _is_hf(module) and not any(name.startswith(n + ".") for n, _ in found):
            found.append((name, module))
    return [(name, module) for name, module in found if _has_attention(module)]


def _has_attention(model: nn.Module) -> bool:
    """Whether the Hugging Face ``model`` has self-attention layers: ones the regularizer reads, or ones it
    refuses (no query/key projections it knows)."""
    try:
        return bool(find_sites(model)[0])
    except ValueError:
        return True


def _access(name: str) -> str:
    """Python that reaches the submodule ``name`` of ``model``: ``model.bert``, or
    ``model.get_submodule('0.auto_model')`` where a part is not an identifier (a Sequential's index) or is a
    Python keyword (``class``)."""
    if all(part.isidentifier() and not keyword.iskeyword(part) for part in name.split(".")):
        return f"model.{name}"
    return f"model.get_submodule({name!r})"


def _unwrap_adapters(model):
    """The Hugging Face model inside a PEFT ``PeftModel`` (``get_base_model()``), whose attention the
    adapters change in place; any other model as it is."""
    get = getattr(model, "get_base_model", None)
    if callable(get) and not _is_hf(model):
        inner = get()
        if _is_hf(inner):
            return inner
    return model


class AlignmentRegularizer(nn.Module):
    """Matches the query and key distributions of every (selected) self-attention layer of ``model``.

    ``model``: an attnkit model (``attnkit.nn.MultiheadAttention`` anywhere inside, any mechanism), a torch
    model with ``nn.MultiheadAttention``, a Hugging Face model (encoders such as BERT, RoBERTa, ALBERT,
    DistilBERT, MiniLM, DeBERTa-v2, ModernBERT; the encoder of T5 and BART; decoders such as Llama, Qwen,
    Mistral, Phi-3, GPT-2, GPT-NeoX, with grouped-query attention) or a model with PyTorch Geometric
    ``GATConv`` or ``TransformerConv`` layers. Attaching registers hooks; the model's outputs stay
    bit-identical. The regularizer's own parameters (one discriminator, or one critic and navigator, per
    layer, shared by its heads) are on the device of the model's first parameter; move both together with
    ``.to()``.

    After each forward pass of ``model``:

    - ``loss()``: ``weight *`` the alignment loss (a scalar tensor to add to the task loss);
    - ``mmd()``: the total MMD(q, k) (summed over layers and heads, mean over samples), a float;
    - ``mmd_per_head()``: a list with one ``(H,)`` tensor per captured layer call.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str = "ct",
        weight: float = 0.01,
        layers: Optional[Sequence[int]] = None,
        **options,
    ) -> None:
        super().__init__()
        layers = tuple(layers) if isinstance(layers, (list, range)) else layers
        unknown = sorted(set(options) - set(_DEFAULTS))
        if unknown:
            valid = ", ".join(sorted(set(_DEFAULTS) - {"method", "weight", "layers"}))
            raise ValueError(f"unknown option {unknown[0]!r}; the options are {valid}")
        self.config = AlignConfig(method=method, weight=weight, layers=layers, **options)
        model = _unwrap_adapters(model)
        sites, is_hf = find_sites(model)
        inner = [] if is_hf or (sites and self.config.layers is not None) else _hf_submodules(model)
        if inner:  # a Hugging Face model inside a plain module, whose attention_mask the outer call hides
            names = ", ".join(f"{_access(n)} ({type(m).__name__})" for n, m in inner)
            escape = " (or pass layers= to take this module's own attention layers only)" if sites else ""
            raise ValueError(
                f"{type(model).__name__} is not a Hugging Face model but holds one ({names}), whose "
                f"self-attention layers the regularizer cannot read from here; attach it to that model, e.g. "
                f"AlignmentRegularizer({_access(inner[0][0])}, ...), so that it reads the attention_mask "
                f"given to it{escape}"
            )
        if not sites:
            raise ValueError(
                f"{type(model).__name__} has no self-attention layer the regularizer knows (attnkit or torch "
                "MultiheadAttention, a Hugging Face model's self-attention with query and key projections, "
                "torch_geometric GATConv or TransformerConv)"
            )
        chosen = self.config.layers if self.config.layers is not None else tuple(range(len(sites)))
        for i in chosen:
            if not 0 <= i < len(sites):
                raise ValueError(
                    f"layers={self.config.layers!r}: index {i} is out of range; the model has {len(sites)} "
                    f"self-attention layers (0..{len(sites) - 1})"
                )
        self.sites = [sites[i] for i in chosen]
        for site in self.sites:
            site.strict = self.config.layers is not None
        self.layer_indices = chosen
        like = next(model.parameters(), None)
        factory = {}
        if like is not None:  # the model's device; float64 for a float64 model, else float32
            factory = {"device": like.device}
            if like.is_floating_point():
                factory["dtype"] = torch.promote_types(like.dtype, torch.float32)
        self.discriminators = nn.ModuleList()
        self.critics = nn.ModuleList()
        self.navigators = nn.ModuleList()
        # drawn from a fork of torch's global (CPU) RNG: the init follows the global seed, and what the model
        # draws next (dropout) is as without the regularizer, so weight=0 reproduces the plain run
        with torch.random.fork_rng(devices=[]):
            for site in self.sites:  # built on the CPU, then moved
                if method == "gan":
                    self.discriminators.append(Discriminator(site.head_dim, self.config.hidden).to(**factory))
                elif method == "ct":
                    self.critics.append(Critic(site.head_dim, self.config.hidden).to(**factory))
                    self.navigators.append(Navigator(site.head_dim, self.config.hidden).to(**factory))
        self._model = [model]  # a list, so that the model is not a submodule (its parameters are not ours)
        self._captured: list[tuple[int, Captured]] = []
        self._drawn: Optional[list[tuple[int, Captured]]] = None  # the forward's subsample (max_tokens)
        self._untrainable: Optional[int] = None  # a layer captured with gradients off in this forward
        self._state = ForwardState()
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._handles = [start_hook(model, is_hf, self._state, self.clear)]
        for index, site in enumerate(self.sites):
            self._handles += site.attach(self._recorder(index), self._state)
        if is_hf:
            # every layer's path, chosen or not: the text tower takes the mask even when only a vision layer
            # is regularized
            self._handles += mask_owner_hooks(model, sites, self._state)
            self._handles += cross_attention_hooks(model, sites, self._state)
        self._handles.append(end_hook(model, self._state, self._drop))

    # -- hooks -------------------------------------------------------------------------------------------

    def _recorder(self, index: int):
        def record(captured: Captured) -> None:
            if not self._state.active:  # a submodule called alone, or checkpointing's recompute in backward
                return
            if self._state.grad_enabled and not torch.is_grad_enabled() and self._untrainable is None:
                self._untrainable = index
            self._captured.append((index, captured))

        return record

    def _drop(self, captures: list[Captured]) -> None:
        """Take back captures of this forward (layers found to be outside the attention_mask's part)."""
        gone = {id(c) for c in captures}
        self._captured = [(i, c) for i, c in self._captured if id(c) not in gone]

    def clear(self) -> None:
        """Forget the captured queries and keys (done at the start of every forward pass of the model)."""
        self._captured.clear()
        self._drawn = None
        self._untrainable = None

    def remove(self) -> None:
        """Take every hook away; the model is as before attaching. The regularizer cannot be used after."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # -- losses ------------------------------------------------------------------------------------------

    def _calls(self) -> list[tuple[int, Captured]]:
        if not self.attached:
            raise ValueError("the regularizer was removed; build a new AlignmentRegularizer to use it again")
        if not self._captured and self._state.skipped:
            why = next(iter(self._state.skipped.values()))
            more = len(self._state.skipped) - 1
            raise ValueError(
                f"no self-attention layer was captured in the last forward pass: {why} (and {more} more "
                "layer(s) alike); the alignment regularizer cannot read this model's padding"
            )
        if not self._captured and self._state.last_cached:
            model = type(self._model[0]).__name__
            raise ValueError(
                f"the last forward pass of the {model} was a step of cached decoding (generate, or "
                "past_key_values given), whose earlier keys are in the cache and are not captured; run a "
                "full forward pass without a cache before calling loss() or mmd()"
            )
        if not self._captured and self._state.forwards:
            model = type(self._model[0]).__name__
            names = ", ".join(repr(s.name) for s in self.sites)
            raise ValueError(
                f"the last forward pass of the {model} called none of the chosen self-attention layers "
                f"({names}) on one sequence (queries and keys from one input); choose layers= that it runs "
                "as self-attention"
            )
        if not self._captured:
            model = type(self._model[0]).__name__
            raise ValueError(
                f"no queries and keys captured yet; run a forward pass of the {model} the regularizer is "
                "attached to (with self-attention) before calling loss() or mmd(); a submodule called on "
                "its own is not captured"
            )
        if self._drawn is None or len(self._drawn) != len(self._captured):
            # drawn once per forward pass: loss(), mmd() and mmd_per_head() read the same tokens, and a
            # diagnostic call does not move the subsampling stream (which training and resuming follow); nor
            # does the draw of an evaluation forward (under no_grad), made on a copy of the stream
            state = None if self._state.training_forward else self._generator.get_state()
            self._drawn = [(i, self._subsample(c)) for i, c in self._captured]
            if state is not None:
                self._generator.set_state(state)
            self._check_finite(self._drawn)
        return self._drawn

    def _check_finite(self, calls: list[tuple[int, Captured]]) -> None:
        """A ``ValueError`` naming the layer and head when a real token's query or key is NaN or infinite
        (every loss would be NaN); one device sync per forward pass."""

        def bad(x: Tensor, mask: Tensor) -> Tensor:  # (B, H, L, d), (B, L) -> (H,)
            return (~torch.isfinite(x) & mask[:, None, :, None]).any(-1).any(-1).any(0)

        flags = [bad(c.q, c.q_mask) | bad(c.k, c.k_mask) for _, c in calls]  # (H,) per call
        if not flags or not bool(torch.cat(flags).any()):
            return
        n, (index, _) = next((n, call) for n, call in enumerate(calls) if bool(flags[n].any()))
        head = int(flags[n].nonzero()[0])
        raise ValueError(
            f"the queries or keys of layer {self.sites[index].name!r}, head {head}, hold NaN or inf at real "
            "tokens in the last forward pass, so the alignment loss would be NaN; find where the model's "
            "activations overflow (lower the learning rate, or train in float32 or bfloat16, not float16)"
        )

    def _subsample(self, c: Captured) -> Captured:
        limit = self.config.max_tokens
        if limit is None:
            return c
        out = []
        for x, m in ((c.q, c.q_mask), (c.k, c.k_mask)):
            L = x.shape[2]
            if L > limit:
                idx = torch.randperm(L, generator=self._generator)[:limit].sort().values.to(x.device)
                x, m = x.index_select(2, idx), m.index_select(1, idx)
            out += [x, m]
        return Captured(out[0], out[2], out[1], out[3])

    def _values(self, index: int, c: Captured) -> Tensor:
        # outside autocast: under a bfloat16 autocast the kernel sums and cosines would run in bfloat16 (mmd
        # 0.13% from float32 on the same captures, ct 0.08%); the regularizer's few small products cost little
        with torch.autocast(c.q.device.type, enabled=False):
            return self._values_in_own_dtype(index, c)

    def _values_in_own_dtype(self, index: int, c: Captured) -> Tensor:
        cfg = self.config
        if cfg.method in ("gan", "ct"):
            dtype = next(self.parameters()).dtype
        else:  # at least float32 (bfloat16/half models), float64 stays float64
            dtype = torch.promote_types(c.q.dtype, torch.float32)
        q, k = c.q.to(dtype), c.k.to(dtype)
        if cfg.method == "gan":
            return gan_loss(q, k, self.discriminators[index], c.q_mask, c.k_mask, gamma=cfg.gamma)
        if cfg.method == "ct":
            return ct_loss(
                q,
                k,
                self.critics[index],
                self.navigators[index],
                c.q_mask,
                c.k_mask,
                rho=cfg.rho,
                gamma=cfg.gamma,
            )
        if cfg.method == "ot":
            return ot_loss(q, k, c.q_mask, c.k_mask, blur=cfg.blur, scaling=cfg.scaling)
        return mmd_values(q, k, key_mask=c.k_mask, query_mask=c.q_mask)

    def unweighted_loss(self) -> Tensor:
        """The alignment loss of the last forward pass, mean over captured layer calls, samples and heads."""
        calls = self._calls()
        if self._untrainable is not None:
            name = self.sites[self._untrainable].name
            raise ValueError(
                f"the queries and keys of layer {name!r} were computed with gradients off inside a forward "
                "pass that had them on (gradient checkpointing with use_reentrant=True), so the alignment "
                "loss cannot train the model; use non-reentrant checkpointing (Hugging Face: model."
                "activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False}); "
                "torch: checkpoint(..., use_reentrant=False))"
            )
        if (any(c.q.is_inference() for _, c in calls) and torch.is_grad_enabled()
                and not torch.is_inference_mode_enabled()):
            raise ValueError(
                "the last forward pass ran under torch.inference_mode(), whose tensors cannot enter a loss "
                "(autograd cannot save them); read the loss under torch.no_grad(), or run the forward with "
                "gradients to train with it"
            )
        terms = [reduce_heads(self._values(i, c), c.q_mask, c.k_mask) for i, c in calls]
        return torch.stack(terms).mean()

    def loss(self) -> Tensor:
        """``weight *`` the alignment loss of the last forward pass (a scalar tensor to add to the task
        loss)."""
        if self.config.weight == 0:
            return self.unweighted_loss() * 0.0
        return self.config.weight * self.unweighted_loss()

    forward = loss

    @torch.no_grad()
    def mmd_per_head(self) -> list[Tensor]:
        """MMD(q, k) of the last forward pass: one ``(H,)`` tensor (mean over samples) per captured layer
        call."""
        out = []
        for _, c in self._calls():
            with torch.autocast(c.q.device.type, enabled=False):  # float32 sums, as outside autocast
                values = mmd_values(c.q.float(), c.k.float(), key_mask=c.k_mask,
                                    query_mask=c.q_mask)  # (B, H)
            has = c.q_mask.any(-1) & c.k_mask.any(-1)
            out.append(values[has].mean(0) if bool(has.any()) else values.new_zeros(values.shape[1]))
        return out

    def mmd(self) -> float:
        """Total MMD(q, k) of the last forward pass: summed over layers and heads, mean over samples."""
        return float(sum(v.sum() for v in self.mmd_per_head()))

    # -- distributed training ----------------------------------------------------------------------------

    @torch.no_grad()
    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy every parameter and buffer of the regularizer from process ``src`` to the others of
        ``torch.distributed``.

        DDP broadcasts the wrapped model's weights only: without this, processes that built the regularizer
        from different RNG states train different discriminators / critics forever (``sync_gradients``
        averages gradients, not weights). Call it once before training, after loading a checkpoint
        (``attnkit.align.trainer`` does it at the start of ``Trainer.train``). A no-op in one process.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        for tensor in (*self.parameters(), *self.buffers()):
            dist.broadcast(tensor.data, src=src)

    def sync_gradients(self) -> None:
        """Average the gradients of the regularizer's parameters over the processes of ``torch.distributed``.

        The model's gradients are averaged by DDP; the discriminator/critic/navigator are not part of the
        wrapped model, so call this after ``backward()`` and before ``optimizer.step()`` when training with
        several processes (``attnkit.align.trainer`` does it for the ``Trainer``). A no-op in one process.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)

    def extra_repr(self) -> str:
        c = self.config
        return f"method={c.method}, weight={c.weight}, layers={list(self.layer_indices)}"
