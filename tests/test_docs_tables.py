"""bench/docs_tables.py: the committed pages say what their records say, a changed record is caught and named, and a
figure that is not a speed figure can't be shown as one."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "bench" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(_spec)
sys.modules["docs_tables"] = docs_tables  # its dataclasses look their module up
_spec.loader.exec_module(docs_tables)

#: a render the README's what-to-pick table reads (its 2-GPU row: the one-GPU baseline of the CFG split)
README_RECORD = "4xh200/2026-11-27_energy/res/w13/1gpu/fav3/results/timing.json"


def test_the_committed_pages_match_their_records(capsys):
    assert docs_tables.main(["--check"]) == 0, capsys.readouterr().err


def _copy_of_the_checkout(tmp_path: Path) -> Path:
    """The pages, the declarations and every record they read, under tmp_path (the committed files untouched)."""
    spec = docs_tables.load()
    pages = {d["page"] for d in spec.get("table", []) + spec.get("fig", [])}
    for rel in [*pages, "bench/docs_tables.toml"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for rel in docs_tables.records_read(spec):
        dest = tmp_path / docs_tables.RESULTS / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / docs_tables.RESULTS / rel, dest)
    return tmp_path


def test_check_names_the_cell_when_a_record_the_readme_links_changes(tmp_path, capsys):
    root = _copy_of_the_checkout(tmp_path)
    args = ["--check", "--root", str(root), "--declarations", str(root / "bench" / "docs_tables.toml")]
    assert docs_tables.main(args) == 0, capsys.readouterr().err  # the copy is whole
    assert "2026-11-27_energy/" in (root / "README.md").read_text()  # the README links the record's folder
    path = root / docs_tables.RESULTS / README_RECORD
    entries = json.loads(path.read_text())
    entries[0]["step_times"] = [t * 1.1 for t in entries[0]["step_times"]]  # the one-GPU step, 10% slower
    path.write_text(json.dumps(entries))
    capsys.readouterr()
    assert docs_tables.main(args) == 1
    err = capsys.readouterr().err
    assert "README.md: table pick, row 2 (2 GPUs), column 'gain'" in err, err
    assert "docs/RECOMMENDATIONS.md: table rec_multi" in err, err  # every page that shows the figure
    assert docs_tables.main(args[1:]) == 0  # without --check it rewrites the pages from the records ...
    assert docs_tables.main(args) == 0  # ... which then match them
    assert (ROOT / "README.md").read_text() != (root / "README.md").read_text()


def _one_render(tmp_path: Path, steps: list, cell: str, measure: str = "warm_ms") -> dict:
    """A root with one render record of ``steps`` (seconds) on a GPU, one page and one table showing it."""
    rec = tmp_path / docs_tables.RESULTS / "h200" / "2026-01-01_x" / "timing.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps([{"attention_type": "fav3", "step_times": steps,
                                "run": {"system": {"device": "cuda:0"}, "backend": {"name": "fav3"}}}]))
    (tmp_path / "docs" / "P.md").write_text("<!-- table:t -->\n<!-- /table:t -->\n")
    return {"table": [{"name": "t", "page": "docs/P.md", "head": ["render", "figure"],
                       "row": [{"cells": ["fav3", cell], "figs": {"a": {
                           "rec": "h200/2026-01-01_x/timing.json", "m": measure}}}]}]}


def test_a_warm_figure_of_three_warm_steps_is_written_with_its_n(tmp_path):
    spec = _one_render(tmp_path, [1.5, 1.0, 1.1, 1.2], "{a} ms ({a.how}), {links}")
    pages, diffs = docs_tables.generate(tmp_path, spec)
    assert "| fav3 | 1100.0 ms (warm, n = 3), [x/timing.json](gpu_results/h200/2026-01-01_x/timing.json) |" \
        in pages["docs/P.md"]
    assert diffs == ["docs/P.md: table t: empty in the page, its records give 1 rows"]


def test_a_figure_of_fewer_than_three_warm_steps_is_refused_as_a_speed_figure(tmp_path):
    spec = _one_render(tmp_path, [1.5, 1.0, 1.1], "{a} ms ({a.how})")
    with pytest.raises(docs_tables.DocsError, match=r"refused as a speed figure \(n=2 timed samples"):
        docs_tables.generate(tmp_path, spec)
    spec = _one_render(tmp_path / "obs", [1.5, 1.0, 1.1], "{a} ms ({a.how})", measure="obs_warm_ms")
    pages, _ = docs_tables.generate(tmp_path / "obs", spec)
    assert "| fav3 | 1050.0 ms (n = 2: not a speed figure) |" in pages["docs/P.md"]


def test_a_cpu_timing_is_refused_as_a_speed_figure(tmp_path):
    spec = _one_render(tmp_path, [1.5, 1.0, 1.1, 1.2], "{a} ms ({a.how})")
    rec = tmp_path / docs_tables.RESULTS / "h200" / "2026-01-01_x" / "timing.json"
    rec.write_text(rec.read_text().replace("cuda:0", "cpu"))
    with pytest.raises(docs_tables.DocsError, match="CPU timing"):
        docs_tables.generate(tmp_path, spec)


def test_a_row_that_does_not_say_how_its_figure_was_taken_is_refused(tmp_path):
    spec = _one_render(tmp_path, [1.5, 1.0, 1.1, 1.2], "{a} ms")
    with pytest.raises(docs_tables.DocsError, match="holds a warm figure and the row does not say 'warm'"):
        docs_tables.generate(tmp_path, spec)


def test_a_ratio_says_how_both_its_figures_were_taken_and_a_marker_nobody_fills_is_named(tmp_path):
    spec = _one_render(tmp_path, [1.5, 1.0, 1.1, 1.2], "{x}× ({a.how})")
    row = spec["table"][0]["row"][0]
    row["figs"]["b"] = {**row["figs"]["a"], "m": "mean_ms"}
    row["figs"]["x"] = {"ratio": ["b", "a"], "d": 3}
    with pytest.raises(docs_tables.DocsError, match="holds a mean figure and the row does not say 'mean of'"):
        docs_tables.generate(tmp_path, spec)
    row["cells"][1] = "{x}× ({b.how} over {a.how})"
    page = tmp_path / "docs" / "P.md"
    page.write_text(page.read_text() + "<!-- fig:gone -->1.5×<!-- /fig:gone -->\n")
    pages, diffs = docs_tables.generate(tmp_path, spec)
    assert "| fav3 | 1.091× (mean of 4 steps over warm, n = 3) |" in pages["docs/P.md"]  # 1200 ms / 1100 ms
    assert "docs/P.md: fig gone: a marker no declaration in docs_tables.toml fills" in diffs
