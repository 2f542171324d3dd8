"""The scale box of every chapter (capslib.book.page): what it says follows the results that exist."""
import pytest

from capslib import datasets
from capslib.book import page
from capslib.book import units as U


def test_scale_note_counts_the_chapters_paper_scale_results(tmp_path, monkeypatch):
    monkeypatch.delenv("CAPSBOOK_PAPER_SCALE_ONLY", raising=False)
    text = page.scale_note("02", profile="ci")
    done = sum(U.state(u)[0] == "done" for u in U.all_units("02"))
    total = len(U.all_units("02"))
    assert f"{10 * datasets.EMBEDDED_SPLIT[0]:,} training digits" in text and f"plans {total} for this chapter" in text
    assert (f"{done} of the {total}" in text) if 0 < done < total else True
    assert page.PAPER_SCALE_SECTION in text
    # with no results at all the note says none has been made
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    empty = page.scale_note("02", profile="ci")
    assert "none of them has been made yet" in empty and "will show" in empty
    assert "MNIST's training digits less a validation set" in page.scale_note("05", profile="full")
    assert "trains no network" in page.scale_note("01")


def test_scale_note_rejects_unknown_chapters_and_reads_the_page_profile(monkeypatch):
    with pytest.raises(ValueError, match="chapter must be one of"):
        page.scale_note("09")
    monkeypatch.setenv("CAPSBOOK_PROFILE", "full")
    monkeypatch.setenv("CAPSBOOK_PAPER_SCALE_ONLY", "1")
    assert page.page_profile() == "ci"          # only the paper-scale cells run again: the page stays ci
    monkeypatch.setenv("CAPSBOOK_PAPER_SCALE_ONLY", "0")
    assert page.page_profile() == "full"


def test_every_chapter_opens_with_the_scale_box():
    import json
    from pathlib import Path
    for nb_path in sorted(Path(U.ROOT, "book").glob("0*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        md = ["".join(c["source"]) for c in cells[:4] if c["cell_type"] == "markdown"]
        assert any("{glue:text}`page_scale`" in m and "scoreboard" in m for m in md), nb_path.name
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        glue_cell = next(c for c in cells if "page.glue_scale" in "".join(c["source"]))
        assert "paper-scale" in glue_cell["metadata"]["tags"] and f'"{nb_path.name[:2]}"' in "".join(glue_cell["source"])
        assert code[0].strip().endswith("setup()")


def test_setup_lets_pandas_show_whole_tables():
    import pandas as pd

    from capslib.book import session
    with pd.option_context("display.max_rows", 10, "display.max_colwidth", 5):
        session.whole_tables()
        assert pd.get_option("display.max_rows") is None and pd.get_option("display.max_colwidth") is None
        frame = pd.DataFrame({"note": ["x" * 80] * 70})
        text = frame.to_string()
        assert "…" not in text and "..." not in text and len(text.splitlines()) == 71


def test_scale_note_says_which_processor_made_the_runs(monkeypatch):
    """The note names the kind of processor the chapter's paper-scale runs were made on: a small network's
    runs need no GPU (chapter 3's were made on a CPU)."""
    monkeypatch.delenv("CAPSBOOK_PAPER_SCALE_ONLY", raising=False)
    declared = U.all_units("03")[:3]
    monkeypatch.setattr(U, "all_units", lambda chapter: declared)
    made = {declared[0].key: "cpu (some processor, 2 threads)", declared[1].key: "cuda (NVIDIA H100)"}
    monkeypatch.setattr(U, "state", lambda u: ("done", {"device": made[u.key]}) if u.key in made else ("missing", None))
    assert "2 of the 3 have been made on GPUs and CPUs" in page.scale_note("03", profile="ci")
    made.pop(declared[1].key)
    assert "1 of the 3 has been made on a CPU, and" in page.scale_note("03", profile="ci")
    made[declared[1].key] = made[declared[2].key] = "cuda (NVIDIA H200)"
    del made[declared[0].key]
    assert "2 of the 3 have been made on a GPU, and" in page.scale_note("03", profile="ci")


def test_the_built_site_leaves_out_the_mathjax_entry_points_no_page_loads(tmp_path):
    import importlib
    from pathlib import Path

    import yaml

    from capslib.tools import sphinx_mathjax_trim as trim
    offline = importlib.import_module("sphinx-mathjax-offline")
    shipped = Path(offline.__file__).parent / "static" / "mathjax"

    class App:                       # what sphinx-mathjax-offline's setup writes into the configuration
        class config:
            mathjax_path = None
    offline.setup(type("A", (), {"config": App.config, "connect": lambda *a, **k: None})())
    assert Path(App.config.mathjax_path).name == trim.ENTRY and (shipped / trim.ENTRY).is_file()
    assert all((shipped / name).is_file() for name in trim.UNUSED)          # the list names real bundles
    extensions = yaml.safe_load((Path(__file__).parents[1] / "_config.yml").read_text())["sphinx"]["extra_extensions"]
    assert extensions.index("capslib.tools.sphinx_mathjax_trim") > extensions.index("sphinx-mathjax-offline")
    site = tmp_path / "mathjax"
    (site / "input" / "tex").mkdir(parents=True)
    for name in (trim.ENTRY, "loader.js", "input/tex/ams.js", *trim.UNUSED):
        (site / name).write_text("//")
    assert sorted(trim.trim(site)) == sorted(trim.UNUSED)
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*.js")) == ["input/tex/ams.js", "loader.js",
                                                                                 trim.ENTRY]
    (site / trim.ENTRY).unlink()
    (site / "tex-svg.js").write_text("//")
    assert trim.trim(site) == [] and (site / "tex-svg.js").is_file()       # laid out otherwise: left whole
    with pytest.raises(ValueError, match="cannot be trimmed"):
        trim.trim(site, entry="tex-svg.js")
