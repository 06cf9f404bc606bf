"""PyG graph convs: one sample per graph of the model's batch vector, and no queries from x=(x_src, None)."""

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.nn import GATConv, TransformerConv  # noqa: E402

from attnkit.align import AlignmentRegularizer  # noqa: E402


class _Net(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x, edge_index, batch=None):
        return self.conv(x, edge_index)


def _graphs():
    torch.manual_seed(0)
    g1 = Data(x=torch.randn(3, 5), edge_index=torch.tensor([[0, 1], [1, 2]]))
    g2 = Data(x=torch.randn(4, 5), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]))
    return g1, g2, Batch.from_data_list([g1, g2])


@pytest.mark.parametrize("cls", [GATConv, TransformerConv])
def test_batched_graphs_match_graphs_one_by_one(cls):
    g1, g2, b = _graphs()
    net = _Net(cls(5, 4, heads=2))
    reg = AlignmentRegularizer(net, method="mmd")
    net(b.x, b.edge_index, b.batch)
    batched = reg.unweighted_loss()
    captured = reg._captured[0][1]
    assert captured.q.shape == (2, 2, 4, 4)  # (G, H, max N, C)
    assert captured.q_mask.sum(1).tolist() == [3, 4]
    net(g1.x, g1.edge_index)
    one = reg.unweighted_loss()
    net(g2.x, g2.edge_index)
    two = reg.unweighted_loss()
    torch.testing.assert_close(batched, (one + two) / 2)


def test_batch_object_argument_gives_one_sample_per_graph():
    g1, g2, b = _graphs()

    class DataNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = GATConv(5, 4, heads=2)

        def forward(self, data):
            return self.conv(data.x, data.edge_index)

    net = DataNet()
    reg = AlignmentRegularizer(net, method="mmd")
    net(b)
    assert reg._captured[0][1].q.shape[0] == 2


def test_batch_of_wrong_length_is_refused_under_layers():
    _, _, b = _graphs()
    net = _Net(GATConv(5, 4, heads=2))
    AlignmentRegularizer(net, method="mmd", layers=(0,))
    with pytest.raises(ValueError, match="batch vector given to the model has 6 entries"):
        net(b.x, b.edge_index, b.batch[:-1])


def test_gat_without_destination_features_is_not_captured():
    conv = GATConv(5, 4, heads=2)
    reg = AlignmentRegularizer(conv, method="mmd")
    with pytest.warns(UserWarning, match=r"x=\(x_src, None\)"):
        conv((torch.randn(6, 5), None), torch.tensor([[0, 1], [0, 1]]), size=(6, 3))
    with pytest.raises(ValueError, match="no self-attention layer was captured"):
        reg.unweighted_loss()


def test_gat_without_destination_features_raises_under_layers():
    conv = GATConv(5, 4, heads=2)
    AlignmentRegularizer(conv, method="mmd", layers=(0,))
    with pytest.raises(ValueError, match="no queries to align"):
        conv((torch.randn(6, 5), None), torch.tensor([[0, 1], [0, 1]]), size=(6, 3))
