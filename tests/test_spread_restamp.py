"""capslib.tools.spread.restamp: runs measured on a named earlier version of a chapter are marked as
measured on its current code only with a reason, keeping the old digest; runs of any other version
and chapters not named are left alone."""
import json

import nbformat
import pytest

from capslib.tools import spread


def _chapter(tmp_path, name, code):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def test_restamp_moves_old_runs_to_the_current_digest_and_keeps_the_old_one(tmp_path):
    nb = _chapter(tmp_path, "02_x", "plt.figure(figsize=(7, 3))")
    other = _chapter(tmp_path, "03_y", "print(1)")
    lib = spread.library_digest()
    table = {"runs": {"seed0-t2": {"seed": 0, "threads": 2, "chapters": {
        "02_x": {"source": "old", "library": lib, "claims": {}}, "03_y": {"source": "old3", "library": lib, "claims": {}}}},
        "seed1-t2": {"seed": 1, "threads": 2, "chapters": {"02_x": {"source": "older", "library": lib, "claims": {}}}}}}
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(table))
    lines = spread.restamp(path, [nb], "figure sizes only; glued numbers identical", {"02_x": "old"})
    runs = json.loads(path.read_text())["runs"]
    after = runs["seed0-t2"]["chapters"]
    assert lines == [f"02_x: 1 run(s) restamped to {spread.source_digest(nb)}; 1 run(s) of another version "
                     f"left as they are"]
    assert runs["seed1-t2"]["chapters"]["02_x"] == {"source": "older", "library": lib, "claims": {}}   # not the version named
    assert after["02_x"]["source"] == spread.source_digest(nb)
    assert after["02_x"]["restamped"][0]["from"] == "old" and "figure" in after["02_x"]["restamped"][0]["why"]
    assert "from_library" not in after["02_x"]["restamped"][0]            # the library was the current one
    assert after["03_y"] == {"source": "old3", "library": lib, "claims": {}}          # not named: untouched
    assert spread.restamp(path, [nb], "again", {"02_x": "old"})[0].startswith("02_x: 0 run(s)")
    assert spread.source_digest(other) != "old3"
    with pytest.raises(ValueError, match="why"):
        spread.restamp(path, [nb], "  ", {"02_x": "old"})


def test_rename_claim_renames_every_run_and_the_summary_and_keeps_the_values(tmp_path):
    def claim(name, value):
        return {"name": name, "value": value, "bound": "at_most", "limit": 4.0, "holds": value <= 4}
    runs = {f"seed {s}, 2 threads": {"seed": s, "threads": 2, "chapters": {"05_x": {
        "source": "d", "claims": [claim("05 runs at chance of the 9", v), claim("05 other", 1.0)]}}}
        for s, v in ((0, 0.0), (1, 2.0))}
    path = tmp_path / "spread.json"
    path.write_text(json.dumps({"runs": runs, "claims": spread.summarise(runs)}))
    assert spread.rename_claim(path, "05 runs at chance of the 9", "05 runs at chance, of the comparison's runs") == 2
    table = json.loads(path.read_text())
    assert set(table["claims"]) == {"05 runs at chance, of the comparison's runs", "05 other"}
    assert [c["value"] for e in table["runs"].values() for c in e["chapters"]["05_x"]["claims"]
            if c["name"].startswith("05 runs")] == [0.0, 2.0]
    assert table["claims"]["05 runs at chance, of the comparison's runs"]["worst_value"] == 2.0
    with pytest.raises(ValueError, match="no run measured"):
        spread.rename_claim(path, "05 runs at chance of the 9", "anything")
    with pytest.raises(ValueError, match="measured already"):
        spread.rename_claim(path, "05 other", "05 runs at chance, of the comparison's runs")


def test_digest_at_reads_the_committed_version():
    """digest_at(HEAD) of a committed chapter is the digest of the file as committed."""
    import subprocess

    nb = sorted(spread.chapters())[0]
    committed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(nb)], cwd=spread.ROOT).returncode == 0
    if not committed:
        pytest.skip(f"{nb.name} has uncommitted changes")
    assert spread.digest_at("HEAD", nb) == spread.source_digest(nb)
    with pytest.raises(ValueError, match="git cannot show"):
        spread.digest_at("no-such-revision", nb)


def test_cell_timeout_reaches_every_execution_and_refuses_nonsense(monkeypatch, capsys):
    from capslib.tools import spread as sp
    seen = []
    monkeypatch.setattr(sp, "_one_job", lambda seed, threads, nbs, workdir, cell_timeout: seen.append(cell_timeout) or {})
    monkeypatch.setattr(sp, "_write", lambda table, path: None)
    sp.measure([0], [1], sp.chapters()[:1], cell_timeout=1234)
    assert seen == [1234]
    with pytest.raises(SystemExit):
        sp.main(["--chapters", "01", "--cell-timeout", "0"])
    assert "--cell-timeout" in capsys.readouterr().err


def test_a_run_carries_the_digest_of_the_code_it_executed_and_an_edit_mid_spread_drops_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """A chapter edited while a spread runs: each run records the digest read just before it started, and runs
    of the code that is no longer the chapter's are dropped with a line saying so (a digest taken once at the
    start would have filed the later runs, made with the edited code, under the old version)."""
    import subprocess as sp_module

    from capslib.tools import spread as sp
    nb = _chapter(tmp_path, "03_z", "x = 1")
    calls = []

    def fake_run(cmd, **kw):   # the first execution: the chapter is edited while it runs
        calls.append(sp.source_digest(nb))
        if len(calls) == 1:
            nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 2")]), nb)
        return sp_module.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sp.subprocess, "run", fake_run)
    path = tmp_path / "spread.json"
    table = sp.measure([0, 1], [2], [nb], path=path)
    out = capsys.readouterr().out
    runs = table["runs"]
    assert len(calls) == 2 and calls[0] != calls[1]
    assert [e["seed"] for e in runs.values()] == [1]                          # seed 0 ran the old code: dropped
    assert next(iter(runs.values()))["chapters"]["03_z"]["source"] == sp.source_digest(nb) == calls[1]
    assert "03_z was edited after this run started" in out and "seed 0" in out


def test_the_library_digest_reads_the_library_the_chapters_compute_with_and_its_committed_version(tmp_path):
    """The library's half of a run's version: capslib's sources but its commands; at HEAD it is the committed
    library's digest (when the library has no uncommitted change)."""
    import subprocess

    root = tmp_path / "repo"
    for rel, text in (("capslib/routing.py", "a = 1\n"), ("capslib/book/ch02.py", "b = 2\n"),
                      ("capslib/tools/spread.py", "c = 3\n"), ("capslib/README.md", "d\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    before = spread.library_digest(root)
    (root / "capslib/tools/spread.py").write_text("c = 4\n")      # a command: not the library's numbers
    (root / "capslib/README.md").write_text("e\n")                 # not code
    assert spread.library_digest(root) == before
    (root / "capslib/book/ch02.py").write_text("b = 2.0\n")        # chapter code in the library: a new version
    assert spread.library_digest(root) != before
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "capslib"], cwd=spread.ROOT).returncode == 0
    if clean:
        assert spread.library_digest_at("HEAD") == spread.library_digest()
    with pytest.raises(ValueError, match="git cannot list"):
        spread.library_digest_at("no-such-revision")


def test_restamp_moves_runs_of_the_named_library_and_leaves_runs_of_another(tmp_path):
    nb = _chapter(tmp_path, "02_x", "print(2)")
    cur, lib = spread.source_digest(nb), spread.library_digest()
    table = {"runs": {f"seed{s}": {"seed": s, "threads": 2, "chapters": {"02_x": {"source": src, "library": lb,
                                                                                  "claims": {}}}}
                      for s, (src, lb) in enumerate(((cur, "oldlib"), ("old", "oldlib"), (cur, "otherlib"),
                                                     (cur, None), (cur, lib)))}}
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(table))
    lines = spread.restamp(path, [nb], "docstrings only", {"02_x": "old"}, "oldlib")
    runs = {k: e["chapters"]["02_x"] for k, e in json.loads(path.read_text())["runs"].items()}
    assert lines == [f"02_x: 2 run(s) restamped to {cur}; 2 run(s) of another version left as they are"]
    for k in ("seed0", "seed1"):
        assert (runs[k]["source"], runs[k]["library"]) == (cur, lib)
        assert runs[k]["restamped"][-1]["from_library"] == "oldlib"
    assert runs["seed2"]["library"] == "otherlib" and runs["seed3"]["library"] is None   # not the version named
    assert "restamped" not in runs["seed4"]                                              # already current


def test_measuring_a_chapter_drops_its_runs_of_another_library(tmp_path, monkeypatch):
    import subprocess as sp_module

    from capslib.tools import spread as sp
    nb = _chapter(tmp_path, "03_z", "x = 1")
    monkeypatch.setattr(sp.subprocess, "run", lambda cmd, **kw: sp_module.CompletedProcess(cmd, 0, "", ""))
    path = tmp_path / "spread.json"
    old = {"seed": 5, "threads": 2, "cpu": "elsewhere", "chapters": {
        "03_z": {"source": sp.source_digest(nb), "library": "oldlib", "claims": [], "seconds": 1.0},
        "04_w": {"source": "w", "library": "oldlib", "claims": [], "seconds": 1.0}}}
    path.write_text(json.dumps({"runs": {"seed 5, 2 threads, elsewhere": old}}))
    runs = sp.measure([0], [2], [nb], path=path)["runs"]
    assert runs["seed 5, 2 threads, elsewhere"]["chapters"].keys() == {"04_w"}   # not measured now: left alone
    new = next(e for k, e in runs.items() if e["seed"] == 0)["chapters"]["03_z"]
    assert new["library"] == sp.library_digest() and new["source"] == sp.source_digest(nb)


def test_every_run_of_the_spread_belongs_to_its_chapters_current_code_and_library():
    """The committed spread holds only measurements of the chapters as they are: a change to a chapter's code
    or to the library is either re-measured or restamped with the reason it cannot move a value
    (``python -m capslib.tools.spread --chapters ... --from-rev REV --restamp WHY``)."""
    table = json.loads(spread.SPREAD_FILE.read_text())
    digests = {nb.stem: spread.source_digest(nb) for nb in spread.chapters()}
    library = spread.library_digest()
    stale = sorted({(ch, res.get("source") != digests.get(ch), res.get("library") != library)
                    for e in table["runs"].values() for ch, res in e["chapters"].items()
                    if (res.get("source"), res.get("library")) != (digests.get(ch), library)})
    assert not stale, ("runs of another version (chapter, its code differs, the library differs): "
                       f"{stale}; re-measure or restamp them")
