r"""Look at attention: per layer and head, the weights over one text's tokens for each mechanism side by side.

``attnkit show`` builds on this module. A view holds, for one text, the ``(H, L, L)`` weights of every
attention layer for each mechanism (recorded with ``attnkit.functional.observe_weights``, so every
``ak.attention`` call is seen: attnkit models and converted Hugging Face models alike) and the hybrid weights
``u`` of HNAS.

The page shows, per layer, the heatmaps (queries down, keys across) and the per-key column sums

.. math::
    s_j = \sum_i \pi_{ij}, \qquad \text{Lemma 1 (DNAS): } s_j \ge 1 / n

(the explain-away picture of "Attention that does not explain away", Fig. 1): softmax may leave a key with
almost no weight from any query; DNAS never gives a key less than ``1/n``.

The weights are also exported in the layout the ``bertviz`` package expects (``head_view(attention, tokens)``
with ``attention`` a tuple over layers of ``(batch, heads, L, L)`` tensors): ``attention.safetensors`` (one
tensor ``"<mechanism>.<layer>"`` per layer, tokens in the metadata) and ``attention.json``; read them back
with :func:`load_bertviz`.
"""

from __future__ import annotations

import base64
import copy
import html
import inspect
import io
import json
import operator
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .._files import json_loads

__all__ = ["AttentionView", "record_attention", "is_run_directory", "canonical_mechanisms", "view_from_run",
           "view_from_hf", "render_view_html", "selected_layers", "write_bertviz", "load_bertviz"]


@dataclass
class AttentionView:
    """``weights[mechanism]``: one ``(H, L, L)`` tensor per attention layer; ``hybrid_u[mechanism]``:
    ``(layers, H)`` for HNAS (else absent); ``tokens``: the ``L`` token strings the model read; ``source``:
    what was loaded. ``text_tokens``: the tokens of the whole text (0: as many as ``tokens``), more than ``L``
    when the model reads at most ``token_limit`` tokens and the text was cut; ``limit_reason`` says why.
    ``layer_names[mechanism]``: the attention module of each entry of ``weights`` (e.g.
    ``encoder.layer.1.attention.self``), ``hybrid_u_names[mechanism]``: of each row of ``hybrid_u``.
    ``pair``: the text is a sentence pair ``a | b``, cut (if at all) at the end of each sentence, the longer
    first, as a sentence-pair run's models read it. ``converted_in_part``: the model's conversion record
    names fewer attention modules than the model has (``attnkit convert --layers``), so the page draws those
    only. ``value_ranges[mechanism]``: the ``(low, high)`` its weights can take (CoDA's depends on its
    activations: arctan's ``(-pi/2, pi/2)``), where known; the colour scale covers it."""

    text: str
    tokens: list[str]
    weights: dict[str, list[Tensor]] = field(default_factory=dict)
    hybrid_u: dict[str, list[list[float]]] = field(default_factory=dict)
    source: str = ""
    text_tokens: int = 0
    token_limit: Optional[int] = None
    limit_reason: str = ""
    layer_names: dict[str, list[str]] = field(default_factory=dict)
    hybrid_u_names: dict[str, list[str]] = field(default_factory=dict)
    pair: bool = False
    converted_in_part: bool = False
    value_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    def layer_name(self, layer: int) -> str:
        """How the page names ``layer``: its module (the first mechanism's), else ``layer i``."""
        names = next(iter(self.layer_names.values()), [])
        return f"layer {layer}: {names[layer]}" if layer < len(names) else f"layer {layer}"

    @property
    def mechanisms(self) -> list[str]:
        return list(self.weights)

    @property
    def num_layers(self) -> int:
        return min((len(w) for w in self.weights.values()), default=0)

    @property
    def truncation_note(self) -> str:
        """``""``, or the sentence that says the text was cut: "only the first 64 of 80 tokens are shown:
        the run's models read at most max_len = 64 tokens" (a pair: "only 64 of 80 ...")."""
        if self.text_tokens <= len(self.tokens):
            return ""
        why = f": {self.limit_reason}" if self.limit_reason else ""
        shown = f"{len(self.tokens)}" if self.pair else f"the first {len(self.tokens)}"
        return f"only {shown} of {self.text_tokens} tokens are shown{why}"


def record_attention(forward) -> list[Tensor]:
    """Run ``forward()`` and return the ``(H, Lq, Lk)`` weights of each non-causal attention call
    (batch item 0)."""
    from ..functional import observe_weights

    if not callable(forward):
        raise ValueError(f"forward must be a callable, got {type(forward).__name__}; pass e.g. "
                         "record_attention(lambda: model(x))")
    calls: list[Tensor] = []
    causal: list[int] = []

    def observer(weights, mask_info, config) -> None:
        if weights.shape[0] == 0:
            raise ValueError("the forward pass ran on an empty batch (B = 0); record_attention shows batch "
                             "item 0, pass at least one sample")
        if not mask_info.causal:
            calls.append(weights[0].detach().float().cpu())  # (H, Lq, Lk)
        else:
            causal.append(1)

    with torch.no_grad(), observe_weights(observer):
        forward()
    if not calls and causal:
        raise ValueError(f"the model's {len(causal)} attnkit attention call(s) were all causal, and "
                         "record_attention records non-causal calls only; record a non-causal (encoder) call")
    if not calls:
        raise ValueError("the model made no attnkit attention call; convert it first (attnkit convert) "
                         "or pass a run directory of attnkit compare")
    return calls


def record_module_attention(
    forward, modules: Sequence[tuple[str, torch.nn.Module]]
) -> list[tuple[str, Tensor]]:
    """Run ``forward()`` and return ``(module name, (H, Lq, Lk) weights of batch item 0)`` for each attention
    call made inside one of ``modules`` (``(name, module)`` pairs): the calls of other modules (layers left
    unconverted, a decoder's causal or cross-attention) are not taken for the mechanism's. A module called
    again (ALBERT shares one across its layers) is named with the count of its call."""
    from ..functional import observe_weights

    inside: list[str] = []
    calls: list[tuple[str, Tensor]] = []
    seen: dict[str, int] = {}

    def observer(weights, mask_info, config) -> None:
        if weights.shape[0] == 0:
            raise ValueError("the forward pass ran on an empty batch (B = 0); record_attention shows batch "
                             "item 0, pass at least one sample")
        if inside:
            name = inside[-1]
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name} (call {seen[name]})"
            calls.append((label, weights[0].detach().float().cpu()))  # (H, Lq, Lk)

    def enter(name):
        return lambda module, args: inside.append(name)

    def leave(module, args, output):
        inside.pop()

    handles = []
    try:
        for name, module in modules:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
        with torch.no_grad(), observe_weights(observer):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise ValueError("the model made no attnkit attention call in its attention modules; convert it "
                         "first (attnkit convert) or pass a run directory of attnkit compare")
    return calls


def _check_text(text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--text is empty; pass a sentence to look at, "
                         "e.g. --text 'the bank raised its rates'")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes the shell could not decode arrive as lone surrogates
        raise ValueError(
            f"--text is not valid UTF-8 (at character {exc.start}); pass the sentence as UTF-8 text"
        ) from None
    return text


def is_run_directory(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` holds a run of ``attnkit compare``: its ``config.json`` carries compare's marker
    (``created_by``). A Hugging Face model folder has a ``config.json`` too, and a Trainer's output folder a
    ``runs/`` of TensorBoard logs: neither is a run. A ``config.json`` next to ``runs/`` that cannot be read
    is a ``ValueError`` naming it as damaged."""
    from ..runner.compare import _check_config_file, _is_run_dir

    path = Path(path)
    if (path / "runs").is_dir():
        _check_config_file(path)
    return _is_run_dir(path)


def canonical_mechanisms(mechanisms: Optional[Sequence[str]], run: bool = False) -> Optional[list[str]]:
    """``mechanisms`` under their registered names (``"HNAS"``, ``"hybrid"`` -> ``"hnas"``): a mechanism is
    drawn, labelled and coloured (and HNAS's ``u`` found) by one name. For a compare run directory (``run``)
    an alignment suffix is kept (``"DNAS+ct"`` -> ``"dnas+ct"``) and the no-attention baseline ``"none"``
    passes (:func:`view_from_run` refuses it, naming the runs to pick from). An unknown name, or one mechanism
    named twice (``lnas,softmax``), is a ``ValueError``; ``None`` stays ``None`` (the default)."""
    from ..registry import resolve_mechanism
    from ..runner.baseline import NO_ATTENTION

    if mechanisms is None:
        return None
    names: list[str] = []
    seen: dict[str, str] = {}
    for m in mechanisms:
        if not isinstance(m, str):  # a config object's options (Sinkhorn's iters) would be dropped
            raise ValueError(f"mechanisms holds {m!r}; pass mechanism names, e.g. ['softmax', 'dnas']")
        base, plus, align = m.partition("+") if run else (m, "", "")
        label = (base if run and base == NO_ATTENTION else resolve_mechanism(base).name) + plus + align
        if label in seen:  # lnas and softmax: one mechanism drawn twice under two names
            raise ValueError(f"--mechanisms names {label!r} twice ({seen[label]!r} and {m!r}); name it once")
        seen[label] = m
        names.append(label)
    return names


PAIR_SEPARATOR = " | "  # a sentence-pair task's texts as the runner joins them (TextClassificationData)


def _split_pair(text: str, trained_on: str) -> tuple[str, str]:
    """``text`` as the pair ``"a | b"``; ``trained_on`` names what the model was trained on (in the error)."""
    first, sep, second = text.partition(PAIR_SEPARATOR)
    if not sep or not first.strip() or not second.strip():
        raise ValueError(f"--text {text[:60]!r} is one sentence, but {trained_on} reads sentence pairs; "
                         "write the pair as \"a | b\" (the two sentences around ' | ')")
    return first, second


def _encode_pair(tokenizer, first: str, second: str, max_len: int) -> tuple[Tensor, Tensor, list[str], int]:
    """``ids (1, L)``, ``mask (1, L)``, the ``L`` token strings and the token count of the whole pair, encoded
    by the runner's ``_encode_pairs`` (each sentence cut at its end, the longer first, around ``|``)."""
    from types import SimpleNamespace

    from ..runner.tasks import _encode_pairs

    raw = SimpleNamespace(test_texts=[first], test_text_pairs=[second])
    row = torch.tensor([0])
    ids, mask = _encode_pairs(tokenizer, raw, "test", row, max_len)  # (1, L)
    words: list[str] = []

    class _Numbered:  # the same cut over the token strings: a text's "ids" are its words' places in `words`
        pad_id = -1

        def encode_ids(self, part: str) -> list[int]:
            start = len(words)
            words.extend(tokenizer.tokenize(part))
            return list(range(start, len(words)))

    kept, _ = _encode_pairs(_Numbered(), raw, "test", row, max_len)  # (1, L)
    return ids, mask, [words[i] for i in kept[0].tolist() if i >= 0], len(words)


def view_from_run(run_dir: Union[str, os.PathLike], text: str, seed: Optional[int] = None,
                  mechanisms: Optional[Sequence[str]] = None) -> AttentionView:
    """Rebuild each mechanism's model of an ``attnkit compare`` run directory (classification tasks) and look
    at ``text`` with it. ``seed`` defaults to the first seed of the run. For a sentence-pair task (mrpc,
    snli) ``text`` is the pair ``"a | b"``, encoded as the runs were trained and evaluated on pairs."""
    from ..nn import MultiheadAttention, hybrid_weights
    from ..runner.baseline import NO_ATTENTION
    from ..runner.compare import _check_config_file, check_task_unchanged, saved_config
    from ..runner.config import build_config
    from ..runner.tasks import get_task

    text = _check_text(text)
    run_dir = Path(run_dir)
    _check_config_file(run_dir)  # a damaged config.json is named as damaged, not as "not a run directory"
    saved = saved_config(run_dir)
    if saved is None:
        raise FileNotFoundError(f"{str(run_dir)!r} is not an attnkit compare run directory "
                                "(no config.json of ours)")
    # the saved values as they are (a saved null is no cap, not "the preset's")
    config = build_config({"out": str(run_dir), "progress": "none"}, base=saved, keep_none=True)
    check_task_unchanged(config, run_dir, "attnkit show would encode the text as the model never saw it")
    task = get_task(config.task)
    if task.kind != "classification":
        raise ValueError(f"attnkit show reads classification runs; {config.task!r} is a {task.kind} task")
    seed = config.seed if seed is None else seed
    # The runs with attention: each mechanism with each alignment method ("dnas+ct"); the no-attention
    # baseline ("none") has no weights to draw.
    drawable = [v for v in config.variants if v.partition("+")[0] != NO_ATTENTION]
    if mechanisms:
        wanted = canonical_mechanisms(mechanisms, run=True)
        if any(m.partition("+")[0] == NO_ATTENTION for m in wanted):
            raise ValueError(f"mechanism {NO_ATTENTION!r} is the no-attention baseline and has no attention "
                             f"to draw; pick from {drawable}")
    else:
        wanted = drawable
        if not wanted:
            raise ValueError(f"{str(run_dir)!r} holds only the no-attention baseline {NO_ATTENTION!r}; "
                             "there is no attention to draw")
    def finished(m: str, s: int) -> bool:
        return (run_dir / "runs" / f"{m}-seed{s}" / "model.pt").is_file()

    missing = [m for m in wanted if not finished(m, seed)]
    if missing:
        done = [f"{m} seed {s}" for m in drawable for s in config.seed_list if finished(m, s)]
        choice = f"finished: {', '.join(done)}" if done else "no run has finished yet (resume the compare)"
        raise FileNotFoundError(f"no finished run for {missing} with seed {seed} in {str(run_dir)!r}; "
                                f"{choice}")
    raw = task.load(config)
    pair = _split_pair(text, f"the run's task {config.task!r}") if raw.is_pair else None
    task.load = lambda _config: raw  # prepare() would read the dataset a second time
    data = task.prepare(config)
    tokenizer = data.tokenizer
    limit_reason = f"the run's models read at most max_len = {config.max_len} tokens"
    if pair is not None:  # as the runs read their pairs (runner.tasks._encode_pairs)
        ids, mask, shown, whole = _encode_pair(tokenizer, *pair, config.max_len)  # (1, L), L <= max_len
        limit_reason += ", each sentence of a pair cut at its end, the longer first"
    else:
        ids, mask = tokenizer.encode([text], max_length=config.max_len)  # (1, L), L <= max_len
        shown = tokenizer.tokenize(text)
        whole = len(shown)
    unk = getattr(tokenizer, "unk_id", None)  # a word outside the vocabulary is read as <unk>: say so
    tokens = [f"{t} (<unk>)" if i == unk else t for t, i in zip(shown, ids[0].tolist())]
    view = AttentionView(text=text, tokens=tokens, source=f"{run_dir} (seed {seed})", text_tokens=whole,
                         token_limit=config.max_len, limit_reason=limit_reason, pair=pair is not None)
    for mech in wanted:
        model = task.build_model(config, mech.partition("+")[0], data)  # "dnas+ct" trained a dnas model
        _load_run_weights(model, run_dir / "runs" / f"{mech}-seed{seed}" / "model.pt")
        model.eval()
        modules = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiheadAttention)]
        calls = record_module_attention(lambda: model(ids, mask), modules)
        view.layer_names[mech] = [name for name, _ in calls]
        view.weights[mech] = [w[:, : len(tokens), : len(tokens)] for _, w in calls]
        view.value_ranges[mech] = _value_range(modules[0][1].config)
        if mech.partition("+")[0] == "hnas":
            view.hybrid_u[mech] = hybrid_weights(model).tolist()
            view.hybrid_u_names[mech] = [n for n, m in modules if m.theta is not None]
    return view


def _load_run_weights(model: torch.nn.Module, path: Path) -> None:
    """A finished compare run's ``model.pt`` into ``model``: tensors only (``weights_only``); a damaged or
    foreign file is one ``ValueError`` naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - truncated, garbage, pickled objects, other shapes: one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"run weights {str(path)!r} cannot be loaded ({type(exc).__name__}: {first[:200]}); delete "
            f"{str(path.parent)!r} and train that run again with attnkit compare --resume"
        ) from None


DEFAULT_HF_MECHANISMS = ("softmax", "dnas", "hnas")
HF_MAX_TOKENS = 128  # a (converted) model's text is cut here (or at its positions): the page draws L x L maps
DEFAULT_CAUSAL_MECHANISMS = ("softmax", "coda")  # dnas, hnas and sinkhorn refuse causal attention


def view_from_hf(model_dir: Union[str, os.PathLike], text: str,
                 mechanisms: Optional[Sequence[str]] = None) -> AttentionView:
    """A (converted) Hugging Face model: a converted model shows its own mechanism (with its trained ``u``);
    a stock model is converted, copy by copy, to each of ``mechanisms`` (same weights, other
    normalization; by default softmax, dnas and hnas, or for a decoder, whose attention is causal, softmax and
    CoDA)."""
    import attnkit.hf as akhf
    from attnkit.hf.checks import load_tokenizer, separated_pairs
    from attnkit.hf.convert import CONFIG_KEY, _causal
    from attnkit.hf.progress import quiet_load

    from ..registry import causal_problem, resolve_mechanism

    text = _check_text(text)
    mechanisms = canonical_mechanisms(mechanisms)  # an unknown name fails before the model loads
    base = quiet_load(model_dir)  # no progress bar above a one-line error about the options
    base.eval()
    own = akhf.conversion(base)
    if own is not None and mechanisms and list(mechanisms) != [own.name]:
        raise ValueError(
            f"{model_dir} is converted to {own.name!r} and shows that mechanism alone; drop --mechanisms "
            "or pass the unconverted model"
        )
    # causal as convert reads it: the module's is_causal, a decoder's is_decoder, or a forward above that
    # passes is_causal=True down (CLIP's text tower, whose modules say is_causal=False)
    causal = next((n for n, m in akhf.attention_modules(base) if _causal(base, n, m)), None)
    if mechanisms is None:
        mechanisms = DEFAULT_CAUSAL_MECHANISMS if causal is not None else DEFAULT_HF_MECHANISMS
    elif own is None and causal is not None:
        leaking = [m for m in mechanisms if causal_problem(resolve_mechanism(m)) is not None]
        if leaking:  # convert's own message would advise its --layers, which picks the layers show draws
            raise ValueError(
                f"{model_dir} has causal self-attention ({causal}), which {leaking[0]!r} cannot take (it "
                "normalizes over queries, so a position would see later ones); show it with --mechanisms "
                f"{','.join(DEFAULT_CAUSAL_MECHANISMS)} (its default) or mechanisms of those"
            )
    tokenizer = load_tokenizer(model_dir, "model directory")
    limit, reason = HF_MAX_TOKENS, f"attnkit show reads at most {HF_MAX_TOKENS} tokens of a text"
    positions = getattr(base.config, "max_position_embeddings", None)
    offset = _position_offset(base)
    if isinstance(positions, int) and 0 < positions - offset < limit:  # a longer text would not fit the model
        limit, reason = positions - offset, f"the model has {positions} positions (max_position_embeddings)"
        if offset:
            reason += f" numbered from padding_idx + 1 = {offset}, so a text fits in {limit}"
    trained = _finetune_max_length(model_dir)
    if trained is not None and trained < limit:  # a fine-tune reads (and predicts from) that many tokens
        limit = trained
        reason = f"the model was fine-tuned on at most {trained} tokens of a text (finetune --max-length)"
    # a model fine-tuned on sentence pairs (attnkit finetune on MRPC, SNLI) reads "a | b" as the pair
    dataset = _pair_dataset(model_dir)
    pair = _split_pair(text, dataset) if dataset is not None else None  # "the model fine-tuned on ..."
    parts = (text,)
    if pair is not None:  # as finetune encoded the pairs
        parts = tuple(side[0] for side in separated_pairs(tokenizer, [pair[0]], [pair[1]]))
    enc = tokenizer(*parts, return_tensors="pt", truncation=True, max_length=limit)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    whole = len(tokenizer(*parts, verbose=False)["input_ids"])  # not cut (no warning past the model's limit)
    view = AttentionView(text=text, tokens=tokens, source=str(model_dir), text_tokens=whole,
                         token_limit=limit, limit_reason=reason, pair=pair is not None)
    models = {own.name: base} if own is not None else {}
    if own is not None:  # a stock model is converted whole below: never "in part"
        recorded = set(getattr(base.config, CONFIG_KEY)["modules"])
        view.converted_in_part = not {n for n, _ in akhf.attention_modules(base)} <= recorded
    if own is None:
        for m in mechanisms:
            models[m] = akhf.convert(copy.deepcopy(base), m)
    for name, model in models.items():
        # the converted modules only: a layer left out of a conversion (--layers), or a decoder's attention
        # that a conversion does not touch, is not this mechanism
        converted = getattr(model.config, CONFIG_KEY)["modules"]
        by_name = dict(model.base_model.named_modules())
        calls = record_module_attention(
            lambda: _forward_text(model, enc, model_dir), [(n, by_name[n]) for n in converted]
        )
        view.layer_names[name] = [n for n, _ in calls]
        view.weights[name] = [w for _, w in calls]
        view.value_ranges[name] = _value_range(akhf.conversion(model))
        if name == "hnas":
            view.hybrid_u[name] = akhf.hybrid_weights(model).tolist()
            view.hybrid_u_names[name] = list(converted)
    return view


def _value_range(config) -> tuple[float, float]:
    """The ``(low, high)`` that the weights of mechanism ``config`` can take: ``(0, 1)`` for the normalized
    mechanisms; CoDA's ``M = f_E(E) * gate`` lies in the range of ``f_E`` (``ACTIVATION_RANGES``: tanh's
    ``(-1, 1)``, arctan's ``(-pi/2, pi/2)``, sigmoid's ``(0, 1)``), its gate in ``[0, 1]`` (``N <= 0`` keeps
    the scaled gate ``2 f_N(N)`` at most 1; a centered gate is ``f_N(N)`` alone)."""
    from ..config import CoDA
    from ..mechanisms.coda import ACTIVATION_RANGES

    if not isinstance(config, CoDA):
        return (0.0, 1.0)
    return ACTIVATION_RANGES[config.e_activation]


PAIRS_CONFIG_KEY = "attnkit_sentence_pairs"  # config.json of a converted pair fine-tune: the words below
MAX_LENGTH_CONFIG_KEY = "attnkit_max_length"  # config.json of a converted fine-tune: its --max-length


def _read_json(path: Path):
    """The JSON in ``path``, or ``None`` where there is none or it is not JSON (not ours: ignored)."""
    try:
        return json_loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _finetune_record(model_dir) -> Optional[dict]:
    """The ``metrics.json`` that ``attnkit finetune`` wrote beside the model in ``model_dir`` (a dict with the
    run's ``config``), else ``None`` (a stock or converted model, or a file that is not ours)."""
    metrics = _read_json(Path(model_dir) / "metrics.json")
    if not isinstance(metrics, dict) or not ("config" in metrics or "sentence_pairs" in metrics):
        return None
    return metrics | {"config": metrics["config"] if isinstance(metrics.get("config"), dict) else {}}


def _finetune_max_length(model_dir) -> Optional[int]:
    """The ``--max-length`` that ``attnkit finetune`` trained the model in ``model_dir`` with: its own
    ``metrics.json`` first (a converted fine-tune fine-tuned again is that second run's), else what ``attnkit
    convert`` of a fine-tune recorded in ``config.json``; ``None`` for neither. The model reads, and predicts
    from, that many tokens of a text."""
    record = _finetune_record(model_dir)
    if record is not None:
        length = record["config"].get("max_length")
    else:
        config = _read_json(Path(model_dir) / "config.json")
        length = config.get(MAX_LENGTH_CONFIG_KEY) if isinstance(config, dict) else None
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length
    return None


def _pair_dataset(model_dir) -> Optional[str]:
    """Words naming the model in ``model_dir`` as ``attnkit finetune`` trained it on sentence pairs (its own
    ``metrics.json`` says so: ``sentence_pairs``, or for a fine-tune of an earlier version a catalog dataset
    of pairs; without one, ``attnkit convert`` of such a fine-tune recorded them in ``config.json``), else
    ``None``."""
    record = _finetune_record(model_dir)
    if record is None:  # a converted copy of a fine-tune, or a stock model
        config = _read_json(Path(model_dir) / "config.json")
        words = config.get(PAIRS_CONFIG_KEY) if isinstance(config, dict) else None
        return words if isinstance(words, str) and words else None
    dataset = record["config"].get("dataset")
    dataset = str(dataset) if dataset is not None else None
    pairs = record.get("sentence_pairs")
    if not (pairs is True or (not isinstance(pairs, bool) and dataset in _PAIR_DATASETS)):
        return None
    return f"the model fine-tuned on {dataset!r}" if dataset is not None else "the fine-tuned model"


_PAIR_DATASETS = ("mrpc", "snli")  # the catalog's sentence pairs (metrics.json of earlier versions)


def _position_offset(model) -> int:
    """How many of ``max_position_embeddings`` no token can use: ``padding_idx + 1`` for a model whose
    position ids start after its padding index (RoBERTa, XLM-R, CamemBERT, Longformer, ESM, ...: transformers'
    ``create_position_ids_from_input_ids``, a method of their embeddings or a function of their module), else
    0."""
    import sys

    for module in model.modules():
        padding_idx = getattr(module, "padding_idx", None)
        numbering = "create_position_ids_from_input_ids"
        numbered = hasattr(module, numbering) or hasattr(sys.modules.get(type(module).__module__), numbering)
        if isinstance(padding_idx, int) and hasattr(module, "position_embeddings") and numbered:
            return padding_idx + 1
    return 0


def _forward_text(model, enc, model_dir):
    """The forward pass that reads the text: an encoder-decoder model's encoder (the converted attention is
    the encoder's; the whole model would want decoder inputs); a failure is one ``ValueError``."""
    forward = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    try:
        return forward(**enc)
    except Exception as exc:  # noqa: BLE001 - a model that cannot read the text fails in many ways
        first = (str(exc).strip().splitlines() or [""])[0]
        hint = "check that it runs with model(**tokenizer(text, return_tensors='pt'))"
        if "pixel_values" in inspect.signature(forward.forward).parameters and "pixel_values" not in enc:
            # CLIP, SigLIP, BLIP: the whole model wants an image beside the text
            hint = ("it reads an image too (pixel_values), and show draws a text; show its text model alone "
                    "(e.g. CLIPTextModel.from_pretrained(...).save_pretrained(...))")
        raise ValueError(
            f"the model in {model_dir} cannot read the text ({type(exc).__name__}: {first[:200]}); {hint}"
        ) from None


# --------------------------------------------------------------------------- the page


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{data}">'


def _layer_figure(view: AttentionView, layer: int, heads: Sequence[int]) -> str:
    """Heatmaps: rows = the chosen heads and the mean over all heads, columns = mechanisms; then the column
    sums."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import MECHANISM_COLORS, literal_text

    mechs = view.mechanisms
    L = len(view.tokens)
    labels = [literal_text(t if len(t) <= 12 else t[:11] + "…") for t in view.tokens]  # drawn as written
    rows = [*[f"head {h}" for h in heads], f"mean over all {view.weights[mechs[0]][layer].shape[0]} heads"]
    title = literal_text(view.layer_name(layer))
    size = 1.2 + 0.16 * L
    # wide enough, per mechanism, for the legend below its bars, and for the title (about 0.09 inch a
    # character at fontsize 10) up to 6 inches, whatever the token count; a longer title is wrapped
    width = max(max(size, 2.0) * len(mechs), min(0.09 * len(title) + 0.6, 6.0))
    title = textwrap.fill(title, width=int((width - 0.6) / 0.09))
    lines = title.count("\n") + 1
    height = size * len(rows) + 2.6 + 0.2 * lines
    fig, axes = plt.subplots(len(rows) + 1, len(mechs), figsize=(width, height), squeeze=False)
    for c, mech in enumerate(mechs):
        w = view.weights[mech][layer]  # (H, L, L)
        panels = [w[h] for h in heads] + [w.mean(0)]
        # one scale per mechanism: the range its weights can take (view.value_ranges: [0, 1], CoDA's the range
        # of its f_E, arctan's (-pi/2, pi/2)), widened to the largest |weight| of the layer where that is
        # larger, symmetric wherever the mechanism or any head of the layer is signed: a near-uniform head is
        # drawn pale, not as saturated as a one-hot one, and the mechanisms compare side by side; its colour
        # bar, which says the range, beside its first panel
        low, high = view.value_ranges.get(mech, (-1.0, 1.0) if mech.split("+")[0] == "coda" else (0.0, 1.0))
        signed = low < 0 or bool((w < 0).any())
        top = max(abs(low), abs(high), float(w.abs().max()) if w.numel() else 0.0)
        for r, (name, panel) in enumerate(zip(rows, panels)):
            ax = axes[r][c]
            image = ax.imshow(panel.numpy(), cmap="RdBu_r" if signed else "viridis",
                              vmin=-top if signed else 0, vmax=top)
            if r == 0:
                bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, panchor=False)  # panel in place
                bar.ax.tick_params(labelsize=6)
                bar.set_label(f"colour scale [{-top if signed else 0:.3g}, {top:.3g}]", fontsize=6)
            ax.set_title(literal_text(f"{mech}: {name}"), fontsize=8)
            ax.set_xticks(range(L), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(L), labels if c == 0 else [""] * L, fontsize=6)
        ax = axes[-1][c]
        sums = w.sum(dim=1)  # (H, L): column sums s_j per head
        ax.bar(range(L), sums.min(0).values.numpy(), color=MECHANISM_COLORS.get(mech, "#777"), alpha=0.8,
               label="min over all heads")
        ax.plot(range(L), sums.mean(0).numpy(), "k.", ms=4, label="mean over all heads")
        ax.axhline(1.0 / L, color="red", ls="--", lw=1, label=f"1/n = {1.0 / L:.3f} (Lemma 1)")
        if bool((sums > 0).all()):
            ax.set_yscale("log")
        ax.set_title(literal_text(f"{mech}: Σ_i π_ij per key"), fontsize=8)
        ax.set_xticks(range(L), labels, rotation=90, fontsize=6)
        # below the panel, outside the bars
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=1, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.1 + 0.2 * lines) / height))  # room for the title's lines
    image = _png(fig)
    plt.close(fig)
    return image


def _u_table(view: AttentionView) -> str:
    parts = []
    for n, (mech, u) in enumerate(view.hybrid_u.items()):
        table_id = "hybrid-u" if n == 0 else f"hybrid-u-{n + 1}"  # one page, unique ids (hnas, hnas+mmd)
        heads = len(u[0]) if u else 0
        head = "".join(f"<th>head {h}</th>" for h in range(heads))
        names = view.hybrid_u_names.get(mech, [])
        body = "".join(
            f"<tr><td>{html.escape(names[i]) if i < len(names) else f'layer {i}'}</td>"
            + "".join(f"<td>{x:.3f}</td>" for x in row) + "</tr>"
            for i, row in enumerate(u)
        )
        parts.append(f"<h2>{html.escape(mech)}: hybrid weight u per layer and head</h2>"
                     "<p>u = share of DNAS in "
                     "π = u·π<sup>D</sup> + (1 − u)·π<sup>L</sup> (0: softmax, 1: DNAS).</p>"
                     f'<div class="wide"><table id="{table_id}"><thead><tr><th></th>{head}</tr></thead>'
                     f"<tbody>{body}</tbody></table></div>")
    return "".join(parts)


def selected_layers(view: AttentionView, layers: Optional[Sequence[int]] = None) -> list[int]:
    """The layers a page of ``view`` draws, each once, in the order given (default: all); a layer out of
    range, one that is not an integer, or none at all is a ``ValueError`` that names the valid ones."""
    _check_drawable(view)
    if layers is not None:
        layers = _indices(layers, "layers", view.num_layers)
    layers = list(range(view.num_layers)) if layers is None else list(dict.fromkeys(layers))
    bad = [i for i in layers if not 0 <= i < view.num_layers]
    if bad:
        names = next(iter(view.layer_names.values()), [])
        listed = "; ".join(f"{i}: {n}" for i, n in enumerate(names[:6])) + ("; ..." if len(names) > 6 else "")
        # from the conversion record (layers 1 and 4 of a model's 6), not from module names: ALBERT calls one
        # shared module per layer, other models number stages and blocks
        why = " (a model converted in part shows its converted layers only)" if view.converted_in_part else ""
        raise ValueError(f"layers {bad} out of range; --layers counts the attention layers drawn, 0.."
                         f"{view.num_layers - 1}, which are the model's modules {listed}{why}")
    return layers


# Narrow windows: the body keeps a margin at the sides and a long token or path wraps instead of running
# past the right edge; tables scroll inside their ``.wide`` box.
_CSS = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1180px;padding:0 1em;"
        "box-sizing:border-box;overflow-wrap:break-word}"
        "img{max-width:100%;height:auto}table{border-collapse:collapse}th,td{border:1px solid #ccc;"
        "padding:3px 6px;font-size:13px}.wide{overflow-x:auto;max-width:100%}code{background:#f3f3f3}"
        ".note{background:#fff6dd;border-left:4px solid #e0a800;padding:6px 10px}")


def _check_drawable(view: AttentionView) -> None:
    """A ``ValueError`` unless ``view`` holds at least one mechanism with at least one layer of weights."""
    if not view.weights or view.num_layers == 0:
        raise ValueError(f"the view holds no attention weights (mechanisms {view.mechanisms}, "
                         f"{view.num_layers} layers); build it with view_from_hf or view_from_run")


def _indices(values, name: str, count: int, allow_empty: bool = False) -> list[int]:
    """``values`` as a list of integers, non-empty unless ``allow_empty`` (a bool or float is refused:
    ``True`` is not layer 1)."""
    valid = f"pass a {'' if allow_empty else 'non-empty '}list of integers in 0..{count - 1}, e.g. {name}=[0]"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}={values!r} is not a list of indices; {valid}")
    bad = [v for v in values if isinstance(v, bool) or not hasattr(v, "__index__")]
    if bad or not (values or allow_empty):
        raise ValueError(f"{name}={list(values)!r} " + (f"holds {bad}, not integers" if bad else "is empty")
                         + f"; {valid}")
    return [operator.index(v) for v in values]


def render_view_html(view: AttentionView, heads: Optional[Sequence[int]] = None,
                     layers: Optional[Sequence[int]] = None) -> str:
    """One self-contained HTML page (PNG figures inlined as base64; every text escaped). A text the model
    read only in part (:attr:`AttentionView.truncation_note`) says so above the figures. ``heads`` and
    ``layers`` are lists of indices (default: the first 4 heads, every layer); a value that is not one, out
    of range, or an empty ``layers`` is a ``ValueError``; an empty ``heads`` draws the mean over heads
    only."""
    _check_drawable(view)
    H = min(w[0].shape[0] for w in view.weights.values())
    if heads is not None:
        heads = _indices(heads, "heads", H, allow_empty=True)
    heads = list(range(min(H, 4))) if heads is None else list(dict.fromkeys(heads))
    bad = [h for h in heads if not 0 <= h < H]
    if bad:
        raise ValueError(f"heads {bad} out of range; the models have {H} heads (0..{H - 1})")
    layers = selected_layers(view, layers)
    tokens = " ".join(f"<code>{html.escape(t)}</code>" for t in view.tokens)
    note = view.truncation_note
    first = "" if view.pair else "the first "
    counted = (f"{view.text_tokens} tokens; {first}{len(view.tokens)} drawn" if note
               else f"{len(view.tokens)} tokens")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>attnkit show: {html.escape(view.text[:60])}</title><style>{_CSS}</style></head><body>",
        "<h1>attnkit show</h1>",
        f"<p>Text: “{html.escape(view.text)}” ({counted}: {tokens})<br>"
        f"Model: <code>{html.escape(view.source)}</code>; "
        f"mechanisms: {html.escape(', '.join(view.mechanisms))}.</p>",
        f'<p class="note" id="truncated">{html.escape(note[0].upper() + note[1:])}.</p>' if note else "",
        "<p>Per layer: the attention weights π (queries down, keys across) of the heads shown and the "
        "mean over all the layer's heads, one column per mechanism; below, each key's column sum "
        "Σ<sub>i</sub> π<sub>ij</sub> (bars: smallest over all heads, dots: their mean) against the bound "
        "1/n that DNAS guarantees (Lemma 1). "
        "A key far below the line is explained away: almost no query attends to it. "
        "CoDA's weights are signed (red/blue) and not normalized.</p>",
        _u_table(view),
    ]
    for layer in layers:
        title = html.escape(view.layer_name(layer)[0].upper() + view.layer_name(layer)[1:])
        parts.append(f"<h2>{title}</h2>{_layer_figure(view, layer, heads)}")
    parts.append("</body></html>")
    return "\n".join(parts)


# --------------------------------------------------------------------------- bertviz layout


BERTVIZ_FILES = ("attention.safetensors", "attention.json")


def write_bertviz(view: AttentionView, out: Union[str, os.PathLike], *, overwrite: bool = True) -> dict:
    """Write ``attention.safetensors`` and ``attention.json`` into ``out``; return ``{kind: path}``.

    For each mechanism, layer ``l`` is stored as a ``(1, H, L, L)`` tensor
    (bertviz's ``(batch, heads, L, L)``). Each file is written whole or not at all; without ``overwrite`` a
    file already there is kept (``FileExistsError``).
    """
    from safetensors.torch import save_file

    from .._files import write_file_with, write_text_file

    empty = [m for m in view.mechanisms if not view.weights[m]]
    if not view.tokens or not view.mechanisms or empty:
        raise ValueError(f"the view has no attention to write (tokens {len(view.tokens)}, mechanisms "
                         f"{view.mechanisms}, without layers {empty}); load_bertviz would refuse the file: "
                         "build the view with view_from_hf or view_from_run")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"{m}.{l}": w.unsqueeze(0).contiguous() for m in view.mechanisms
               for l, w in enumerate(view.weights[m])}  # (1, H, L, L)
    meta = {"tokens": json.dumps(view.tokens), "mechanisms": json.dumps(view.mechanisms), "text": view.text}
    files = {"safetensors": out / "attention.safetensors", "json": out / "attention.json"}
    write_file_with(
        files["safetensors"], lambda tmp: save_file(tensors, tmp, metadata=meta), overwrite=overwrite
    )
    payload = {
        "layout": "bertviz head_view: attention[mechanism] is a list over layers of [batch=1][heads][L][L]",
        "tokens": view.tokens, "text": view.text, "mechanisms": view.mechanisms,
        "attention": {m: [w.unsqueeze(0).tolist() for w in view.weights[m]] for m in view.mechanisms},
    }
    write_text_file(files["json"], json.dumps(payload), overwrite=overwrite)
    return files


def load_bertviz(path: Union[str, os.PathLike],
                 mechanism: Optional[str] = None) -> tuple[tuple[Tensor, ...], list[str]]:
    """``(attention, tokens)`` for ``bertviz.head_view(attention, tokens)`` from a file of
    :func:`write_bertviz`, or the folder that ``attnkit show --out`` wrote (its ``attention.safetensors``).

    ``attention`` is a tuple over layers of ``(1, H, L, L)`` tensors; ``mechanism`` defaults to the first
    stored.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("attention.safetensors", "attention.json") if (path / n).is_file()]
        if not found:
            raise FileNotFoundError(
                f"{str(path)!r} holds no attention.safetensors or attention.json; write them with "
                "`attnkit show ... --out DIR`"
            )
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; write it with `attnkit show ... --out DIR`")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tokens, mechanisms = json_loads(meta["tokens"]), json_loads(meta["mechanisms"])
                mechanism = _pick(mechanism, mechanisms)
                layers = sorted((int(k.rsplit(".", 1)[1]), k) for k in f.keys()
                                if k.rsplit(".", 1)[0] == mechanism)
                attention = tuple(f.get_tensor(k) for _, k in layers)
        else:
            payload = json_loads(path.read_text(encoding="utf-8"))
            tokens, mechanisms = payload["tokens"], payload["mechanisms"]
            mechanism = _pick(mechanism, mechanisms)
            attention = tuple(torch.tensor(layer) for layer in payload["attention"][mechanism])
        problem = _bertviz_problem(attention, tokens, [i for i, _ in layers] if path.suffix == ".safetensors"
                                   else list(range(len(attention))))
    except _PickError:
        raise
    except Exception as exc:  # a corrupt or foreign file (safetensors raises its own error type)
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        raise ValueError(
            f"{str(path)!r} is not an attention file of attnkit show ({problem}); write one with "
            "`attnkit show SOURCE --text ... --out DIR`"
        )
    return attention, tokens


def _bertviz_problem(attention: tuple, tokens, numbers: list[int]) -> Optional[str]:
    """What makes ``attention`` (per layer) and ``tokens`` not what :func:`write_bertviz` writes, or ``None``:
    bertviz would fail far from the file, or draw nonsense."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or not tokens:
        return "its tokens are not a list of strings"
    if not attention:
        return "the mechanism has no layers in it"
    if numbers != list(range(len(numbers))):
        return f"its layers are numbered {numbers}, not 0..{len(numbers) - 1}"
    L = len(tokens)
    heads = attention[0].shape[1] if attention[0].dim() == 4 else None
    for i, layer in enumerate(attention):
        if layer.dim() != 4 or tuple(layer.shape) != (1, heads, L, L):
            return (f"layer {i} has shape {tuple(layer.shape)}; expected (1, {heads}, {L}, {L}) for {L} "
                    "tokens and the first layer's heads")
        if not layer.is_floating_point() or not bool(torch.isfinite(layer).all()):
            return f"layer {i} holds values that are not finite numbers"
    return None


class _PickError(ValueError):
    pass


def _pick(mechanism: Optional[str], mechanisms: list[str]) -> str:
    if mechanism is None:
        return mechanisms[0]
    if mechanism not in mechanisms:
        raise _PickError(f"mechanism {mechanism!r} is not in the file; it holds {mechanisms}")
    return mechanism
