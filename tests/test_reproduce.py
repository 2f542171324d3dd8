"""The GPU-side tools: the benchmark's quick mode, chapter lookup of the reproduce runner, and the
switch to each chapter's longer paper schedule."""
import json

import pytest

from capslib.book import profiles
from capslib.tools import bench, reproduce


def test_bench_quick_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["quick"] and len(table["rows"]) == 3
    for row in table["rows"]:
        assert row["images_per_s"] > 0 and row["flops_per_image"] > 0
        assert row["tflops"] == pytest.approx(row["flops_per_image"] * row["images_per_s"] / 1e12)


def test_bench_flops_grow_with_the_network():
    small, big = bench.cases(quick=True)[0], bench.cases(quick=False)[0]
    small.batch_size = big.batch_size = 2
    import torch
    assert bench.flops_per_image(big, torch.device("cpu")) > 100 * bench.flops_per_image(small, torch.device("cpu"))


def test_bench_schedule_counts_image_epochs():
    s = profiles.settings("02_dynamic_routing", "full")
    work = bench.schedule("02")
    assert work["02"] == (s.epochs * bench.FULL_TRAIN + 4 * s.ablation_seeds * s.ablation_epochs * bench.FULL_TRAIN
                          + s.multimnist_epochs * s.multimnist_train)
    assert work["02x"] == s.compare_seeds * s.expanded_epochs * bench.FULL_TRAIN
    with pytest.raises(KeyError, match="no schedule"):
        bench.schedule("99")


def test_interleaved_seconds_rotates_the_order_and_keeps_only_the_timed_rounds():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = bench.interleaved_seconds(steps, rounds=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")   # round r starts at name r mod 3; the first is warm-up
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in out.values() for t in v)
    with pytest.raises(ValueError, match="callables"):
        bench.interleaved_seconds({})
    with pytest.raises(ValueError, match="rounds"):
        bench.interleaved_seconds(steps, rounds=0)


def test_notebook_lookup():
    assert reproduce.notebook_of("2").name.startswith("02_")
    assert reproduce.notebook_of("04").name.startswith("04_")
    with pytest.raises(ValueError, match="chapter must be a number"):
        reproduce.notebook_of("two")
    with pytest.raises(FileNotFoundError, match="expected one"):
        reproduce.notebook_of("42")


def test_paper_schedule_switch(monkeypatch):
    monkeypatch.delenv("CAPSBOOK_PAPER_SCHEDULE", raising=False)
    short = profiles.settings("04_coupling_gradient_proof", "full")
    monkeypatch.setenv("CAPSBOOK_PAPER_SCHEDULE", "1")
    long = profiles.settings("04_coupling_gradient_proof", "full")
    ci = profiles.settings("04_coupling_gradient_proof", "ci")
    assert long.epochs > short.epochs and long.seeds >= short.seeds
    assert ci.epochs == profiles.SIZES["04_coupling_gradient_proof"]["ci"]["epochs"]  # ci is untouched
    # everything but the schedule is the same
    same = {k for k in vars(short) if k not in profiles.SIZES["04_coupling_gradient_proof"]["paper"]}
    assert all(getattr(short, k) == getattr(long, k) for k in same)


def test_paper_schedule_keys_must_exist():
    with pytest.raises(KeyError, match="not keys of the full profile"):
        profiles.register("99_test", ci=dict(epochs=1), full=dict(epochs=2), paper=dict(epoch=3))
    assert "99_test" not in profiles.SIZES


def test_progress_bars_switch(monkeypatch):
    monkeypatch.delenv("CAPSBOOK_PROGRESS", raising=False)
    assert profiles.progress_bars()
    monkeypatch.setenv("CAPSBOOK_PROGRESS", "0")
    assert not profiles.progress_bars()


def test_bundle_pins_every_package_from_the_lock():
    from capslib.tools import bundle
    versions = bundle.locked_versions()
    reqs = bundle.requirements(bundle.CORE + bundle.SCIENTIFIC, versions)
    assert len(reqs) == len(bundle.CORE + bundle.SCIENTIFIC)
    assert all("==" in r for r in reqs)
    assert not any(r.lower().startswith(("torch==", "torchvision==", "jupyter-book==")) for r in reqs)
    with pytest.raises(KeyError, match="not in requirements.lock: no-such-package"):
        bundle.requirements(("nbclient", "no-such-package"), versions)


def test_bundle_run_script_installs_without_an_index():
    from capslib.tools import bundle
    assert "--no-index" in bundle.RUN_SH and "capslib.tools.reproduce" in bundle.RUN_SH
    with pytest.raises(SystemExit):
        bundle.main(["--python-version", "three"])


def test_sliced_wait_reads_a_message_that_a_long_poll_would_miss():
    """A channel whose poll misses the wake-up (the stall): one long wait sleeps until its timeout,
    the sliced wait reads the message at its next slice; the overall timeout still holds."""
    import asyncio
    import time
    from queue import Empty

    from capslib.tools import execute

    ready_at = time.monotonic() + 0.3

    async def missing_poll(timeout=None):  # like an edge-triggered poll that missed its wake-up
        if time.monotonic() < ready_at:
            await asyncio.sleep(timeout if timeout is not None else 3600)
            raise Empty
        return {"msg": "reply"}

    start = time.monotonic()
    assert asyncio.run(execute.sliced(missing_poll, 0.1)(timeout=30)) == {"msg": "reply"}
    assert time.monotonic() - start < 2
    start = time.monotonic()
    assert asyncio.run(execute.sliced(missing_poll, 0.1)(timeout=None)) == {"msg": "reply"}  # no deadline
    ready_at = time.monotonic() + 3600
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(execute.sliced(missing_poll, 0.1)(timeout=0.35))
    assert 0.3 < time.monotonic() - start < 1.5
    with pytest.raises(ValueError, match="slice_seconds must be positive"):
        execute.sliced(missing_poll, 0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        execute.client(None, reproduce.BOOK / "x.ipynb", timeout=-1)


def test_book_execution_stages_copies_outside_the_sources(tmp_path):
    book = reproduce.stage(tmp_path / "src")
    assert (book.parent / "_config.yml").exists() and (book.parent / "_toc.yml").exists()
    names = {p.name for p in book.iterdir()}
    assert {p.name for p in reproduce.every_notebook()} <= names and "intro.md" in names
    assert "results" not in names and (book / "_static" / "capsbook.css").exists()
    assert (book / "_theme" / "templates" / "layout.html").exists()
    assert reproduce.every_notebook()[-1].name == "scoreboard.ipynb"
    for bad in (reproduce.ROOT, reproduce.BOOK / "sub", reproduce.ROOT.parent):
        with pytest.raises(ValueError, match="--into must be a folder outside"):
            reproduce.stage(bad)


def test_kernel_environment_keeps_the_inline_backend(monkeypatch):
    from capslib.tools import execute

    monkeypatch.setenv("MPLBACKEND", "agg")
    env = execute.environment("full", CAPSBOOK_SMOKE="1")
    assert "MPLBACKEND" not in env and env["CAPSBOOK_PROFILE"] == "full" and env["CAPSBOOK_SMOKE"] == "1"
    with pytest.raises(ValueError, match="profile must be 'ci' or 'full'"):
        execute.environment("gpu")


def test_execute_main_writes_the_executed_copy_and_reports_a_failing_cell(tmp_path):
    import nbformat

    from capslib.tools import execute

    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]), good)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), bad)
    out = tmp_path / "out"
    assert execute.main([str(good), "--output-dir", str(out), "--timeout", "60"]) == 0
    cell = nbformat.read(out / "good.ipynb", as_version=4).cells[0]
    assert cell.outputs[0]["text"].strip() == "42"
    assert execute.main([str(bad), "--output-dir", str(out), "--timeout", "60"]) == 1
    assert (out / "bad.ipynb").exists()
    with pytest.raises(SystemExit):
        execute.main([str(tmp_path / "missing.ipynb"), "--output-dir", str(out)])


def test_full_edition_without_a_gpu_renders_only_the_paper_scale_cells(tmp_path):
    import nbformat

    assert reproduce.paper_scale_only("full", forced=False, cuda=False)
    assert not reproduce.paper_scale_only("full", forced=False, cuda=True)
    assert not reproduce.paper_scale_only("ci", forced=False, cuda=False)
    assert reproduce.paper_scale_only("ci", forced=True, cuda=True)
    # a chapter's own training (here: a cell that would fail) keeps its committed output; the
    # paper-scale cell runs after the first code cell, in a fresh kernel, and its new output replaces its old one
    setup = nbformat.v4.new_code_cell("base = 40")
    training = nbformat.v4.new_code_cell("raise RuntimeError('a training would run here')")
    training.outputs = [nbformat.v4.new_output("stream", name="stdout", text="committed\n")]
    paper = nbformat.v4.new_code_cell("print(base + 2)", metadata={"tags": ["hide-input", "paper-scale"]})
    paper.outputs = [nbformat.v4.new_output("stream", name="stdout", text="old\n")]
    path = tmp_path / "09_x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[setup, training, paper]), path)
    assert reproduce.paper_scale_cells(nbformat.read(path, as_version=4)) == [2]
    ok, _, nb = reproduce.render_paper_scale(path, "ci", timeout=60)
    assert ok
    assert nb.cells[1].outputs[0]["text"] == "committed\n"
    assert nb.cells[2].outputs[0]["text"].strip() == "42"
    # a notebook without paper-scale cells is left as it is, unexecuted
    nbformat.write(nbformat.v4.new_notebook(cells=[training]), path)
    ok, seconds, nb = reproduce.render_paper_scale(path, "ci", timeout=60)
    assert ok and seconds == 0.0 and nb.cells[0].outputs[0]["text"] == "committed\n"


def test_every_paper_scale_cell_is_self_contained():
    # rendered after the first code cell only: a paper-scale cell may use only names it imports or
    # defines itself, and the names the first code cell defines
    import ast
    import builtins as py_builtins

    import nbformat

    builtins = set(dir(py_builtins)) | {"display", "get_ipython"}   # the last two: IPython's
    for path in reproduce.every_notebook():
        nb = nbformat.read(path, as_version=4)
        cells = reproduce.paper_scale_cells(nb)
        if not cells:
            continue
        first = next(c for c in nb.cells if c.cell_type == "code")
        known = set(builtins)
        for cell in [first] + [nb.cells[i] for i in cells]:
            tree = ast.parse(cell.source)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    known |= {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    known.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    known.add(node.name)
                elif isinstance(node, ast.arg):
                    known.add(node.arg)
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            assert used <= known, f"{path.name}: a paper-scale cell uses {sorted(used - known)} from earlier cells"
