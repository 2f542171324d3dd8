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
    table = {"runs": {"seed0-t2": {"seed": 0, "threads": 2, "chapters": {
        "02_x": {"source": "old", "claims": {}}, "03_y": {"source": "old3", "claims": {}}}},
        "seed1-t2": {"seed": 1, "threads": 2, "chapters": {"02_x": {"source": "older", "claims": {}}}}}}
    path = tmp_path / "spread.json"
    path.write_text(json.dumps(table))
    lines = spread.restamp(path, [nb], "figure sizes only; glued numbers identical", {"02_x": "old"})
    runs = json.loads(path.read_text())["runs"]
    after = runs["seed0-t2"]["chapters"]
    assert lines == [f"02_x: 1 run(s) restamped to {spread.source_digest(nb)}; 1 run(s) of another version "
                     f"left as they are"]
    assert runs["seed1-t2"]["chapters"]["02_x"] == {"source": "older", "claims": {}}   # not the version named
    assert after["02_x"]["source"] == spread.source_digest(nb)
    assert after["02_x"]["restamped"][0]["from"] == "old" and "figure" in after["02_x"]["restamped"][0]["why"]
    assert after["03_y"] == {"source": "old3", "claims": {}}          # not named: untouched
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
