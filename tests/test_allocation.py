"""capslib.tools.allocation: a GPU allocation's results packed on the lent machine and written back here, with
every member of the archive checked before anything is written; the whole command rehearsed at smoke size."""
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from capslib.book import units as U
from capslib.tools import allocation


def _tree(root):
    """A repository-like tree: one unit result, a bench report, a unit log, and a file no one packs."""
    files = {"results/full/02/main/s0.json": '{"metrics": {"test_error": 0.0038}}',
             "results/bench/fast_check.json": '{"ok": true}',
             "logs/02_main_s0.log": "epoch 1\n",
             "results/full-smoke/02/main/s0.json": '{"smoke": true}',
             "elsewhere/secret.txt": "not packed"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return [("book/results/full", root / "results/full"), ("book/results/bench", root / "results/bench"),
            ("_build/experiments", root / "logs"), ("book/results/full", root / "results/missing-folder")]


def test_pack_and_unpack_bring_exactly_the_result_files_home(tmp_path):
    sources = _tree(tmp_path / "gpu")
    names = allocation.pack(tmp_path / "out", sources=sources)
    assert names == ["_build/experiments/02_main_s0.log", "book/results/bench/fast_check.json",
                     "book/results/full/02/main/s0.json"]
    home = tmp_path / "home"
    assert sorted(allocation.unpack(tmp_path / "out" / allocation.ARCHIVE, home)) == sorted(names)
    assert json.loads((home / "book/results/full/02/main/s0.json").read_text())["metrics"]["test_error"] == 0.0038
    assert not list(home.rglob("*.tmp")) and not (home / "elsewhere").exists()


@pytest.mark.parametrize("name,kind", [("../outside.json", "file"), ("/etc/passwd", "file"),
                                       ("book/results/other/x.json", "file"), ("book/results/fullx/a.json", "file"),
                                       ("book/results/full/02/main/s0.json", "symlink"),
                                       ("book/results/full/02/main", "dir")])
def test_unpack_refuses_any_member_it_did_not_pack_and_writes_nothing(tmp_path, name, kind):
    archive = tmp_path / "results.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        good = tarfile.TarInfo("book/results/full/02/main/s1.json")
        good.size = 2
        tar.addfile(good, io.BytesIO(b"{}"))
        bad = tarfile.TarInfo(name)
        if kind == "symlink":
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif kind == "dir":
            bad.type = tarfile.DIRTYPE
        else:
            bad.size = 2
        tar.addfile(bad, io.BytesIO(b"{}") if kind == "file" else None)
    home = tmp_path / "home"
    with pytest.raises(ValueError, match="nothing was written"):
        allocation.unpack(archive, home)
    assert not home.exists()


def test_the_allocation_command_rehearsed_at_smoke_size_runs_a_unit_and_packs_its_result(tmp_path):
    """The one command of an allocation, end to end on the CPU: one smoke unit into a results folder of its own,
    the archive and the summary in the hand-back folder, then unpacked into another tree."""
    results, out = tmp_path / "results", tmp_path / "out"
    env = {**os.environ, "CAPSBOOK_UNITS_RESULTS": str(results), "CAPSBOOK_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "capslib.tools.allocation", "run", "--seconds", "120", "--out", str(out),
                           "--smoke", "--check-seconds", "0", "--jobs", "1", "--only", "03/routes/M1/s0"],
                          cwd=U.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "experiments run: exit 0" in summary and "03/routes/M1/s0: done" in summary
    assert (results / "full-smoke/03/routes/M1/s0.json").exists()
    home = tmp_path / "home"
    names = allocation.unpack(out / allocation.ARCHIVE, home)
    assert "book/results/full-smoke/03/routes/M1/s0.json" in names
    assert json.loads((home / "book/results/full-smoke/03/routes/M1/s0.json").read_text()) == \
        json.loads((results / "full-smoke/03/routes/M1/s0.json").read_text())


def test_run_refuses_a_budget_that_leaves_nothing_after_packing(capsys):
    with pytest.raises(SystemExit):
        allocation.main(["run", "--seconds", str(allocation.PACK_SECONDS), "--out", "/tmp/unused"])
    assert "--seconds must exceed" in capsys.readouterr().err
