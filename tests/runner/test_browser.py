"""The compare report and the attention page in a real browser (headless Chromium, installed by
``scripts/test.sh``): every image decodes, nothing overflows a 1280 px viewport, a screenshot is kept in the
run directory."""

from __future__ import annotations

import struct

import pytest

from attnkit.runner import build_config, run_compare
from attnkit.runner.browser import check_page, find_chromium
from tests.runner._fixtures import tiny_overrides, write_classification_file

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium on PATH: scripts/test.sh installs the Debian package `chromium` (apt-get) "
    "when it can",
)


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_report_renders_in_chromium_and_the_screenshot_is_kept(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "run", seeds=2, steps=6, eval_every=2)))
    report = result.files["html"]
    shot = result.out / "report-screenshot.png"
    check = check_page(report, screenshot=shot)
    assert check.ok, check.problems()
    # curves, confusion matrices, hybrid weights
    assert check.images == report.read_text().count("<img ") >= 3
    assert check.viewport_width == 1280 and check.title.startswith("attnkit compare")
    width, height = _png_size(shot)
    assert width == 1280 and height > 900


def test_attention_page_renders_in_chromium(tmp_path):
    from attnkit.analysis.attention_view import render_view_html, view_from_run

    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "run", steps=2, eval_every=2)))
    page = tmp_path / "run" / "attention.html"
    page.write_text(render_view_html(view_from_run(tmp_path / "run", "goal team bank of the market")))
    check = check_page(page)
    assert check.ok, check.problems()
    assert check.images == 1


def test_the_check_sees_broken_images_and_overflow(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><head><title>bad</title></head><body>'
                    '<img alt="broken" src="data:image/png;base64,AAAA"><div style="width:2000px">wide</div>'
                    "</body></html>")
    check = check_page(page)
    assert check.broken == ["broken"] and check.scroll_width >= 2000 and not check.ok
    assert any("2000" in p or "wide" in p or "viewport" in p for p in check.problems())


def test_pages_fit_a_narrow_window(tmp_path):
    """At 400 px, the fidelity tables ran past the right edge, as did a long token on the attention page and a
    long --task path in the compare report's heading."""
    import torch

    from attnkit.analysis.attention_view import AttentionView, render_view_html
    from attnkit.analysis.fidelity import RunInfo, write_fidelity_html
    from attnkit.analysis.report import Claim, ReproduceResult

    folder = tmp_path / ("a-long-folder-name-without-any-spaces-" * 3)
    folder.mkdir()
    data = write_classification_file(folder / "topics.json")
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2,
                                                     eval_every=2, checkpoint_every=2)))
    pages = {"compare": result.files["html"]}
    view = AttentionView(text="goal " + "x" * 200, tokens=["goal", "x" * 200], source=str(folder))
    view.weights["softmax"] = [torch.full((1, 2, 2), 0.5)]
    pages["show"] = tmp_path / "attention.html"
    pages["show"].write_text(render_view_html(view), encoding="utf-8")
    target = ReproduceResult(name="lemma1", out=tmp_path, budget="25 cases x 3 inputs",
                             rows=[{"mechanism": "softmax", "cases": 25, "min n_k * sum_i pi_ij": 1.5e-9,
                                    "worst case": "(2, 4, 16, 16) with a key mask", "held": True}])
    target.claims.append(Claim("Lemma 1 (Sec. 3.2)", "every key receives at least 1/n_k of the attention",
                               True, "min over 75 inputs of n_k * sum_i pi_ij = 1.0000000000002 >= 1",
                               paper=">= 1", ours="1.0000000000002"))
    pages["fidelity"] = write_fidelity_html([target], tmp_path / "fidelity.html", run=RunInfo(quick=True))
    for name, page in pages.items():
        check = check_page(page, width=400)  # headless Chromium lays out at least 500 px
        assert check.viewport_width <= 500 and check.ok, (name, check.viewport_width, check.problems())
