"""capslib.engine.steps and fit(fast=...) on the CPU: the static path equals the eager one where the batches
divide the training set, the partial last batch is dropped, fused Adam stays within a few float32
rounding steps of the plain one, and the CUDA-graph loop (buffers, warm-up, capture, replay, the
learning-rate tensor, the fallback) runs with a stand-in for the CUDA calls."""
import pytest
import torch

from capslib import data, models, train
from capslib.engine import checkpoints, steps


def _tiny():
    torch.manual_seed(0)
    return models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,), iterations=2)


def _loss(model, x, y):
    out = model(x, y)
    return models.capsnet_loss(out, x, y), out.lengths


def _split(n: int, seed: int = 1) -> data.Split:
    g = torch.Generator().manual_seed(seed)
    return data.Split(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _tensor_lr_adam(model, fused=True):
    return torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), fused=fused)


KW = dict(epochs=2, batch_size=16, lr_decay=0.9, progress=False, seed=0)


def test_static_path_takes_the_eager_steps_when_the_batches_divide_the_set():
    d = _split(64)
    eager, static = _tiny(), _tiny()
    h_e = train.fit(eager, d, _loss, optimizer=torch.optim.Adam(eager.parameters(), 1e-3), **KW)
    h_s = train.fit(static, d, _loss, optimizer=torch.optim.Adam(static.parameters(), 1e-3), fast="static", **KW)
    assert _same_weights(eager, static)            # the same step function, the same batches: bit for bit
    assert h_e["loss"] == h_s["loss"] and h_e["train_acc"] == h_s["train_acc"]
    assert h_s["step_path"] == "static" and h_s["images_seen"] == [64, 64] and "step_path_reason" not in h_s
    assert "step_path" not in h_e and "images_seen" not in h_e   # the eager history is as it always was


def test_fast_on_a_cpu_uses_fused_adam_within_float32_rounding_and_names_the_missing_graph():
    # The fused kernel evaluates Adam's update in another order (bias corrections in float32, fused
    # multiply-adds), so each update differs from the plain one by a few float32 ulps (~1e-7 relative).
    # Measured over these 8 steps: at most 4e-7 relative to a tensor's largest entry; one Adam step at
    # lr 1e-3 moves the weights by ~1e-2 of that scale, so 1e-5 still catches a missed or doubled step.
    d = _split(64)
    plain, fused = _tiny(), _tiny()
    h_p = train.fit(plain, d, _loss, lr=1e-3, **KW)
    h_f = train.fit(fused, d, _loss, lr=1e-3, fast=True, **KW)
    assert h_f["step_path"] == "static"
    assert h_f["step_path_reason"].startswith("CUDA graphs need a CUDA device")
    init = _tiny().state_dict()
    for k, a in plain.state_dict().items():
        b = fused.state_dict()[k]
        scale = a.abs().max()
        assert (a - b).abs().max() <= 1e-5 * scale, k
        assert (a - init[k]).abs().max() > 1e-3 * scale, k     # trained: the bound is not vacuous
    assert h_f["loss"] == pytest.approx(h_p["loss"], rel=1e-5)


def test_fused_adam_is_what_fit_makes_on_the_fast_path():
    plan = steps.plan("static", torch.device("cpu"))
    opt = steps.adam(_tiny().parameters(), 1e-3, torch.device("cpu"), plan)
    assert opt.param_groups[0]["fused"] is True or plan.notes   # this torch has a CPU fused Adam, or says not
    assert not isinstance(opt.param_groups[0]["lr"], torch.Tensor)   # a plain number when nothing is captured


def test_a_partial_last_batch_is_dropped_and_a_small_set_is_one_batch():
    h = train.fit(_tiny(), _split(70), _loss, fast="static", **KW)
    assert h["images_seen"] == [64, 64]               # 4 whole batches of 16; 6 images left out each epoch
    h_e = train.fit(_tiny(), _split(70), _loss, **KW)
    assert h_e["images_per_s"][0] > 0 and len(h_e["loss"]) == 2   # the eager path keeps all 70
    h_small = train.fit(_tiny(), _split(10), _loss, fast="static", **KW)
    assert h_small["images_seen"] == [10, 10]


def _stand_in(monkeypatch, **kw):
    backend = steps.EagerGraphs(**kw)
    monkeypatch.setattr(steps, "graph_backend", lambda device: backend)
    return backend


def test_the_graphed_loop_with_a_stand_in_takes_the_static_steps(monkeypatch, capsys):
    # the stand-in's "capture" keeps the step and its replays run it on the static buffers: the same
    # numbers as the static path show that every batch reached the buffers and the step ran once per batch
    d = _split(96)
    static, graphed = _tiny(), _tiny()
    h_s = train.fit(static, d, _loss, optimizer=_tensor_lr_adam(static), fast="static", **KW)
    backend = _stand_in(monkeypatch)
    h_g = train.fit(graphed, d, _loss, optimizer=_tensor_lr_adam(graphed), fast=True, **KW)
    assert h_g["step_path"] == "graphed" and "step_path_reason" not in h_g
    assert backend.captures == 1 and backend.replays == 2 * 6 - steps.WARMUP_STEPS
    assert _same_weights(static, graphed) and h_s["loss"] == h_g["loss"] and h_s["train_acc"] == h_g["train_acc"]
    assert capsys.readouterr().out == ""



def test_an_em_network_takes_the_same_steps_through_the_graphed_loop(monkeypatch):
    # EM routing gathers the votes' gradient from every read of a pass (capslib.ops.Reads): the stand-in's replays
    # of the kept step must give the static path's numbers, as for the CapsNet above
    from capslib import em, em_layers

    def net():
        torch.manual_seed(0)
        return em_layers.EMCapsNet(A=4, B=2, C=2, D=2, iterations=2)

    def loss(model, x, y):
        out = model(x)
        return em.spread_loss(out.activations, y, 0.5), out.activations

    d = _split(48)
    kw = dict(KW, batch_size=12)
    static, graphed = net(), net()
    h_s = train.fit(static, d, loss, optimizer=_tensor_lr_adam(static), fast="static", **kw)
    backend = _stand_in(monkeypatch)
    h_g = train.fit(graphed, d, loss, optimizer=_tensor_lr_adam(graphed), fast=True, **kw)
    assert h_g["step_path"] == "graphed" and backend.captures == 1
    assert _same_weights(static, graphed) and h_s["loss"] == h_g["loss"]
    assert not _same_weights(static, net())                                 # it trained

def test_the_decayed_learning_rate_reaches_the_captured_step(monkeypatch):
    _stand_in(monkeypatch)
    net = _tiny()
    opt = _tensor_lr_adam(net)
    held = opt.param_groups[0]["lr"]
    h = train.fit(net, _split(96), _loss, optimizer=opt, fast=True, **dict(KW, epochs=3))
    assert h["step_path"] == "graphed" and opt.param_groups[0]["lr"] is held
    assert float(held) == pytest.approx(1e-3 * 0.9 ** 3, rel=1e-6)
    # a scheduler that put a new value in the group: written back into the tensor the graph reads
    runner = steps.GraphedSteps(lambda x, y: x.sum(), steps.EagerGraphs(), opt, warmup=0)
    runner(torch.zeros(2), torch.zeros(2))
    opt.param_groups[0]["lr"] = 5e-4
    runner.after_lr_change()
    assert opt.param_groups[0]["lr"] is held and float(held) == pytest.approx(5e-4)


def test_fit_makes_a_tensor_learning_rate_for_a_captured_step(monkeypatch):
    backend = _stand_in(monkeypatch)
    net = _tiny()
    h = train.fit(net, _split(96), _loss, lr=1e-3, fast=True, **KW)
    assert h["step_path"] == "graphed" and backend.captures == 1
    # a learning rate held as a number and changed by lr_decay cannot be captured: the static path runs
    h = train.fit(_tiny(), _split(96), _loss, optimizer=torch.optim.Adam(_tiny().parameters(), 1e-3), fast=True,
                  **KW)
    assert h["step_path"] == "static" and "learning rate held as a number" in h["step_path_reason"]


def test_a_failed_capture_falls_back_to_the_static_step_with_one_line(monkeypatch, capsys):
    d = _split(96)
    static, fell = _tiny(), _tiny()
    train.fit(static, d, _loss, optimizer=_tensor_lr_adam(static), fast="static", **KW)
    _stand_in(monkeypatch, fail=RuntimeError("operation not permitted when stream is capturing\nmore"))
    h = train.fit(fell, d, _loss, optimizer=_tensor_lr_adam(fell), fast=True, **KW)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("CUDA graph capture failed: RuntimeError: operation not permitted")
    assert h["step_path"] == "static" and h["step_path_reason"].startswith("CUDA graph capture failed")
    assert _same_weights(static, fell)            # the batch of the failed capture ran eagerly: nothing lost


def test_graphed_steps_keep_their_buffers_and_need_static_shapes():
    seen = []

    def step(x, y):
        seen.append((x.data_ptr(), float(x.sum())))
        return x.sum()
    runner = steps.GraphedSteps(step, steps.EagerGraphs(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1),
                                warmup=2)
    for k in range(5):
        runner(torch.full((3, 2), float(k)), torch.zeros(3, dtype=torch.long))
    assert [s for _, s in seen] == [0.0, 6.0, 12.0, 18.0, 24.0]   # each batch, copied in, stepped once
    assert len({p for p, _ in seen}) == 1 and runner.x.data_ptr() == seen[0][0]   # always the static buffer
    assert float(runner.last_loss) == 24.0 and runner.graph is not None
    with pytest.raises(ValueError, match="same batch shape"):
        runner(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))


def test_plans_and_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(steps.FAST_ENV, raising=False)
    assert steps.plan(None, cpu).mode is None and steps.plan(False, cpu).path == "eager"
    monkeypatch.setenv(steps.FAST_ENV, "static")
    assert steps.plan(None, cpu).path == "static"
    monkeypatch.setenv(steps.FAST_ENV, "1")
    assert steps.requested(None) == "graph" and steps.requested(False) is None
    monkeypatch.setenv(steps.FAST_ENV, "warp")
    with pytest.raises(ValueError, match="fast must be"):
        steps.requested(None)
    p = steps.plan(True, cpu, before_step=True)
    assert p.path == "eager" and "before_step" in p.reason
    assert steps.plan("static", cpu, distributed=True).path == "eager"
    p = steps.plan(True, cpu, compiled=True)
    assert p.path == "static" and "torch.compile" in p.reason
    assert steps.static_steps(70, 16) == 4 and steps.static_steps(64, 16) == 4 and steps.static_steps(5, 16) == 1


def test_before_step_keeps_the_eager_step_and_says_so():
    calls = []
    h = train.fit(_tiny(), _split(40), _loss, before_step=lambda m, o: calls.append(1), fast=True, **KW)
    assert h["step_path"] == "eager" and "before_step" in h["step_path_reason"]
    assert len(calls) == 2 * 3 and h["images_seen"] == [40, 40]    # every batch, the partial one too


def test_a_fast_run_resumes_its_own_checkpoints_only(tmp_path, capsys):
    d = _split(64)
    ck = tmp_path / "fast.pt"
    straight = _tiny()
    train.fit(straight, d, _loss, fast="static", **KW)
    train.fit(_tiny(), d, _loss, checkpoint=ck, fast="static", **dict(KW, epochs=1))
    resumed = _tiny()
    h = train.fit(resumed, d, _loss, checkpoint=ck, fast="static", **KW)
    assert "resuming fast.pt at epoch 2/2" in capsys.readouterr().out and h["images_seen"] == [64, 64]
    assert _same_weights(straight, resumed)
    assert checkpoints.load_checkpoint(ck)["fingerprint"]["static_batches"] is True
    train.fit(_tiny(), d, _loss, checkpoint=ck, **KW)               # the eager step: another run
    assert "static_batches: true -> null" in capsys.readouterr().out


def test_the_gpu_fast_check_rehearses_on_a_cpu(tmp_path, capsys):
    import json

    from capslib.tools import bench
    out = tmp_path / "fast.json"
    assert bench.main(["fast-check", "--steps", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU here" in text and "fast-check passed" in text
    res = json.loads(out.read_text())
    assert res["agreement"]["graph_path"] == "graphed" and res["agreement"]["rel_graph_vs_same_optimizer"] == 0.0
    assert [r["step_path"] for r in res["fit"]] == ["eager", "static"]
    assert [r["images_seen"] for r in res["fit"]] == [20, 16]     # 2 batches of 8 and a partial one of 4
    assert res["raw_steps"]["graphed"]["path"] == "graphed" and res["raw_steps"]["eager"]["images_per_s"] > 0


def test_an_optimizer_without_a_fused_kernel_is_noted(monkeypatch):
    real = torch.optim.Adam

    def no_fused(params, **kw):
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, **kw)
    monkeypatch.setattr(torch.optim, "Adam", no_fused)
    h = train.fit(_tiny(), _split(32), _loss, fast="STATIC", **KW)
    assert h["step_path"] == "static" and h["step_notes"][0].startswith("fused Adam unavailable")
