r"""PyTorch Geometric graph convolutions as capture sites (``attnkit.align.capture.find_sites`` finds them).

``GATConv``: GAT's logit is
:math:`e_{ij} = a_{dst}^\top W x_i + a_{src}^\top W x_j` for an edge from source ``j`` to destination
``i``; per head we take the query of node ``i`` as :math:`q_i = a_{dst} \odot W x_i` and the key of node
``j`` as :math:`k_j = a_{src} \odot W x_j`
(``(C,)`` vectors whose coordinate sums are the two halves of the logit, so aligning them aligns the
destination and source roles of the nodes; the projected features ``W x`` alone are shared by both
roles). A call ``conv((x_src, None), ...)`` has no destination term, hence no queries: it is left out with a
warning (a ``ValueError`` when ``layers=`` names it).

``TransformerConv`` (a graph transformer, logit :math:`q_i^\top k_j / \sqrt{C}` per
edge): its ``lin_query`` outputs of the destination nodes and ``lin_key`` outputs of the source nodes, split
into heads.

Graph membership for both PyG convs: the convs never see PyG's ``batch`` vector, so the capture takes it from
the call of the model the regularizer is attached to, from an argument named ``batch`` (an integer tensor
``(N,)``, graph index per node) or a ``torch_geometric`` ``Batch``/``Data`` argument that has one. Each graph
is then one sample, padded: ``q (G, H, max N_dst, C)``, ``k (G, H, max N_src, C)``, so that no graph's
queries are matched against another graph's keys. Without one, all the nodes of the call are one sample
``q (1, H, N_dst, C)``, ``k (1, H, N_src, C)``: right for one graph, wrong for a mini-batch of several (attach
the regularizer to a model whose ``forward`` takes ``batch``, not to a bare conv). A ``batch`` whose length is
not a layer's node count is refused like a mismatched padding mask (warning, or ``ValueError`` under
``layers=``).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor, nn

from ._sites import Captured, ForwardState, Record, Site, _PositionsMismatch

__all__ = ["GATSite", "GraphTransformerSite", "gat_class", "graph_batch", "graph_transformer_class"]


def graph_batch(arguments: dict) -> Optional[Tensor]:
    """PyG's batch vector (graph index per node) among the model's arguments: one named ``batch`` (a tensor,
    or a ``torch_geometric`` ``Batch``), else the ``batch`` of a ``torch_geometric`` data argument."""

    def vector(value) -> Optional[Tensor]:
        pyg = any(c.__module__.startswith("torch_geometric") for c in type(value).__mro__)  # Batch is made
        if not isinstance(value, Tensor) and pyg:  # at run time (DataBatch), its bases are PyG's
            value = getattr(value, "batch", None)
        if isinstance(value, Tensor) and value.dim() == 1 and not value.is_floating_point():
            return value
        return None

    found = vector(arguments.get("batch"))
    for value in arguments.values():
        if found is None and not isinstance(value, Tensor):
            found = vector(value)
    return found


def _graph_capture(site: Site, context: ForwardState, q: Tensor, k: Tensor) -> Optional[Captured]:
    """``q (N_dst, H, C)`` and ``k (N_src, H, C)`` of a graph conv's call as one sample per graph of the
    model's ``batch`` vector (padded, masks True = real), or the whole call as one sample without one. None
    (with a warning) when the ``batch`` does not fit the call's nodes; a ``ValueError`` under ``layers=``."""
    batch = context.graph_batch
    if batch is None or (len(batch) == 0 and len(q) == len(k) == 0):
        ones = lambda n: torch.ones(1, n, dtype=torch.bool, device=q.device)  # noqa: E731
        whole = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  (N, H, C) -> (1, H, N, C)
        return Captured(whole(q), whole(k), ones(len(q)), ones(len(k)))
    if len(batch) != len(q) or len(batch) != len(k):
        why = (
            f"the graph layer {site.name!r} runs over {len(k)} source and {len(q)} destination nodes but "
            f"the batch vector given to the model has {len(batch)} entries, so the alignment regularizer "
            "cannot tell which graph each node belongs to; pass layers= with the layers that run on the "
            "batch's nodes"
        )
        site.leave_out(context, why, _PositionsMismatch)
        return None
    batch = batch.to(q.device)
    if int(batch.min()) < 0:
        raise ValueError(
            f"the batch vector given to the model has a negative graph index {int(batch.min())}; PyG's "
            "batch numbers the graphs 0..G-1"
        )
    counts = torch.bincount(batch)  # (G,) nodes per graph
    kept = counts > 0  # a graph index with no node is no sample
    graph, order = batch.sort(stable=True)  # (N,)
    start = torch.cumsum(counts, 0) - counts  # (G,)
    slot = torch.arange(len(batch), device=q.device) - start[graph]  # (N,) position inside its graph
    G, L = len(counts), int(counts.max()) if len(counts) else 0
    valid = torch.zeros(G, L, dtype=torch.bool, device=q.device)
    valid[graph, slot] = True

    def pack(x: Tensor) -> Tensor:  # (N, H, C) -> (G, H, L, C)
        out = x.new_zeros(G, L, *x.shape[1:])  # (G, L, H, C)
        out = out.index_put((graph, slot), x[order])
        return out.transpose(1, 2)[kept]  # (G', H, L, C)

    return Captured(pack(q), pack(k), valid[kept], valid[kept])


class GATSite(Site):
    kind = "gat"

    def attach(self, record: Record, context: ForwardState) -> list:
        conv = self.module
        outputs: list[tuple[str, Tensor]] = []
        H, C = self.num_heads, self.head_dim
        signature = inspect.signature(conv.forward)
        no_queries = [False]  # this call is conv((x_src, None), ...): PyG computes no destination term

        def collect(role: str):
            def hook(module, args, out):
                if module in (conv.lin, getattr(conv, "lin_src", None), getattr(conv, "lin_dst", None)):
                    outputs.append((role, out))

            return hook

        def start(module, args, kwargs):
            if module is conv:
                outputs.clear()
                try:
                    x = signature.bind_partial(*args, **kwargs).arguments.get("x")
                except TypeError:
                    x = None
                no_queries[0] = isinstance(x, (tuple, list)) and len(x) == 2 and x[1] is None

        def finish(module, args, kwargs, out):
            if module is not conv or not outputs:
                return
            if no_queries[0]:
                outputs.clear()
                why = (
                    f"GATConv {self.name or '(the model)'!r} was called with x=(x_src, None): it computes no "
                    "destination term a_dst . W x_i, so the layer has no queries to align; pass the "
                    "destination nodes' features as x=(x_src, x_dst)"
                )
                self.leave_out(context, why)
                return
            if conv.lin is not None:
                x_src = outputs[0][1]
                x_dst = outputs[1][1] if len(outputs) > 1 else x_src
            else:
                roles = dict(outputs)
                x_src, x_dst = roles["src"], roles["dst"]
            outputs.clear()
            q = x_dst.view(-1, H, C) * conv.att_dst  # (N_dst, H, C)
            k = x_src.view(-1, H, C) * conv.att_src  # (N_src, H, C)
            captured = _graph_capture(self, context, q, k)
            if captured is not None:
                record(captured)

        handles = [
            conv.register_forward_pre_hook(start, with_kwargs=True),
            conv.register_forward_hook(finish, with_kwargs=True),
        ]
        if conv.lin is not None:
            handles.append(conv.lin.register_forward_hook(collect("lin")))
        else:
            handles.append(conv.lin_src.register_forward_hook(collect("src")))
            handles.append(conv.lin_dst.register_forward_hook(collect("dst")))
        return handles


class GraphTransformerSite(Site):
    """PyTorch Geometric ``TransformerConv``: ``q_i = W_Q x_i`` of each destination node and ``k_j = W_K x_j``
    of each source node, split into heads, one sample per graph of the model's ``batch`` (the whole call
    without one; an ``edge_dim`` embedding added to the keys per edge is not in the capture)."""

    kind = "graph_transformer"

    def attach(self, record: Record, context: ForwardState) -> list:
        conv = self.module
        outputs: dict[str, Tensor] = {}
        H, C = self.num_heads, self.head_dim

        def collect(role: str, own: nn.Module):
            def hook(module, args, out):
                if module is own:  # not a copy of the model (copy.deepcopy keeps the hooks)
                    outputs[role] = out

            return hook

        def start(module, args, kwargs):
            if module is conv:
                outputs.clear()

        def finish(module, args, kwargs, out):
            if module is not conv or len(outputs) != 2:
                return
            q = outputs["q"].view(-1, H, C)  # (N_dst, H, C)
            k = outputs["k"].view(-1, H, C)  # (N_src, H, C)
            outputs.clear()
            captured = _graph_capture(self, context, q, k)
            if captured is not None:
                record(captured)

        return [
            conv.register_forward_pre_hook(start, with_kwargs=True),
            conv.register_forward_hook(finish, with_kwargs=True),
            conv.lin_query.register_forward_hook(collect("q", conv.lin_query)),
            conv.lin_key.register_forward_hook(collect("k", conv.lin_key)),
        ]


def gat_class():
    try:
        from torch_geometric.nn import GATConv
    except ImportError:
        return None
    return GATConv


def graph_transformer_class():
    try:
        from torch_geometric.nn import TransformerConv
    except ImportError:
        return None
    return TransformerConv
