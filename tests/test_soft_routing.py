"""Unit tests of capslib.soft_routing (chapter 3): hand-written gradients against autograd."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capslib import soft_routing as sr
from capslib.book import ch03


def _net(d_in=6, d_out=4, routes=3, seed=0, std=0.5):
    g = torch.Generator().manual_seed(seed)
    return sr.SoftRoutingNet(d_in, d_out, routes, init_std=std, generator=g, dtype=torch.float64)


def _batch(n, d_in, d_out, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    y_star = torch.rand(n, d_out, generator=g, dtype=torch.float64)
    return x, y_star


def _autograd(net, x, y_star):
    net.zero_grad(set_to_none=True)
    sr.energy(net(x), y_star).backward()
    return {"R": net.R.grad.clone(), "P": net.P.grad.clone()}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_shapes_and_forward():
    net = _net(d_in=5, d_out=3, routes=4)
    x, _ = _batch(7, 5, 3)
    r, Y, y = net.parts(x)
    assert r.shape == (7, 4) and Y.shape == (7, 4, 3) and y.shape == (7, 3)
    assert net.R.shape == (4, 5) and net.P.shape == (4, 3, 5)
    expect = sum(torch.sigmoid(x @ net.R[j]).unsqueeze(1) * torch.sigmoid(x @ net.P[j].T) for j in range(4))
    torch.testing.assert_close(y, expect)
    assert sum(p.numel() for p in net.parameters()) == 4 * 5 + 4 * 3 * 5


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), d_in=st.integers(1, 8), d_out=st.integers(1, 6), routes=st.integers(1, 5),
       seed=st.integers(0, 10_000))
def test_manual_gradients_equal_autograd(n, d_in, d_out, routes, seed):
    net = _net(d_in, d_out, routes, seed=seed)
    x, y_star = _batch(n, d_in, d_out, seed=seed + 1)
    manual = sr.manual_gradients(net, x, y_star)
    auto = _autograd(net, x, y_star)
    for k in ("R", "P"):
        assert manual[k].shape == auto[k].shape
        torch.testing.assert_close(manual[k], auto[k], rtol=1e-10, atol=1e-12)


def test_manual_gradients_use_no_autograd():
    net = _net()
    x, y_star = _batch(5, 6, 4)
    g = sr.manual_gradients(net, x, y_star)
    assert not g["R"].requires_grad and not g["P"].requires_grad
    assert net.R.grad is None and net.P.grad is None


def test_gradcheck_energy():
    net = _net(d_in=4, d_out=3, routes=2)
    x, y_star = _batch(5, 4, 3)

    def E(R, P):
        r = torch.sigmoid(x @ R.T)
        Y = torch.sigmoid(torch.einsum("moi,ni->nmo", P, x))
        return sr.energy(torch.einsum("nm,nmo->no", r, Y), y_star)

    R = net.R.detach().clone().requires_grad_(True)
    P = net.P.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(E, (R, P))


def test_finite_differences():
    net = _net(d_in=5, d_out=3, routes=3)
    x, y_star = _batch(6, 5, 3)
    g = sr.manual_gradients(net, x, y_star)
    h = 1e-6
    for name, idx in [("R", (0, 1)), ("R", (2, 4)), ("P", (1, 2, 0)), ("P", (2, 0, 3))]:
        param = getattr(net, name)
        with torch.no_grad():
            param[idx] += h
            up = float(sr.energy(net(x), y_star))
            param[idx] -= 2 * h
            down = float(sr.energy(net(x), y_star))
            param[idx] += h
        fd = (up - down) / (2 * h)
        assert math.isclose(fd, float(g[name][idx]), rel_tol=1e-6, abs_tol=1e-9), (name, idx, fd)


def test_error_signal_scaled_by_route_weight():
    net = _net(d_in=5, d_out=3, routes=4)
    x, y_star = _batch(8, 5, 3)
    r, Y, _ = net.parts(x)
    s = sr.error_signals(r.detach(), Y.detach(), y_star)
    unscaled = s.delta.unsqueeze(1) * Y.detach() * (1 - Y.detach())
    torch.testing.assert_close(s.eta, r.detach().unsqueeze(2) * unscaled)


def test_route_gradient_norms_matches_manual():
    net = _net(d_in=5, d_out=3, routes=3)
    x, y_star = _batch(6, 5, 3)
    r = net.routing(x).detach()
    norms = sr.route_gradient_norms(net.P.detach(), x, y_star, r)
    torch.testing.assert_close(norms, sr.manual_gradients(net, x, y_star)["P"].flatten(1).norm(dim=1))
    zero = sr.route_gradient_norms(net.P.detach(), x, y_star, torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64))
    assert zero[1] == 0 and zero[0] > 0


def test_gd_matches_autograd_sgd_step_for_step():
    a, b = _net(d_in=6, d_out=4, routes=3, std=0.3), _net(d_in=6, d_out=4, routes=3, std=0.3)
    x, y_star = _batch(40, 6, 4)
    opt = torch.optim.SGD(b.parameters(), lr=0.05)
    for step in range(50):
        idx = slice((step % 4) * 10, (step % 4 + 1) * 10)
        Ea = sr.gd_step(a, x[idx], y_star[idx], lr=0.05)
        opt.zero_grad()
        Eb = sr.energy(b(x[idx]), y_star[idx])
        Eb.backward()
        opt.step()
        assert abs(Ea - float(Eb.detach())) < 1e-10
    torch.testing.assert_close(a.P, b.P)
    torch.testing.assert_close(a.R, b.R)


def test_train_gd_lowers_energy():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    labels = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    x = torch.cat([x, torch.ones(200, 1, dtype=torch.float64)], dim=1)
    net = sr.SoftRoutingNet(6, 3, 2, init_std=0.1, generator=g, dtype=torch.float64)
    h = sr.train_gd(net, x, labels, epochs=15, batch_size=20, lr=0.1, progress=False)
    assert h["loss"][-1] < h["loss"][0]
    assert h["train_acc"][-1] > 0.7
    assert len(h["step_energy"]) == 15 * 10


def test_mixing_statistics():
    labels = torch.tensor([0, 0, 1, 1])
    routed = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    assert math.isclose(float(ch03.route_class_mutual_information(routed, labels, 2)), 1.0, abs_tol=1e-9)
    assert math.isclose(float(ch03.routing_entropy(routed)), 0.0, abs_tol=1e-9)
    even = torch.full((4, 2), 0.7, dtype=torch.float64)
    assert math.isclose(float(ch03.route_class_mutual_information(even, labels, 2)), 0.0, abs_tol=1e-9)
    assert math.isclose(float(ch03.routing_entropy(even)), 1.0, abs_tol=1e-9)
    torch.testing.assert_close(ch03.route_usage(routed, labels, 2), torch.eye(2, dtype=torch.float64))


def test_with_bias_and_one_hot():
    x = torch.rand(3, 1, 2, 2)
    xb = sr.with_bias(x)
    assert xb.shape == (3, 5) and torch.all(xb[:, -1] == 1)
    oh = sr.one_hot(torch.tensor([2, 0]), 3)
    assert oh.tolist() == [[0, 0, 1], [1, 0, 0]]


def test_bad_input_errors():
    net = _net(d_in=4, d_out=2, routes=2)
    with pytest.raises(ValueError, match=r"x must be \(N, 4\)"):
        net(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        net([1.0, 2.0])
    with pytest.raises(ValueError, match="y_star must be"):
        sr.manual_gradients(net, torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="net must be a SoftRoutingNet"):
        sr.manual_gradients(torch.nn.Linear(2, 2), torch.randn(3, 4), torch.rand(3, 2))
    with pytest.raises(ValueError, match="routes must be >= 1"):
        sr.SoftRoutingNet(4, 2, 0)
    with pytest.raises(ValueError, match="init_std"):
        sr.SoftRoutingNet(4, 2, 1, init_std=-1.0)
    with pytest.raises(ValueError, match="shapes must be"):
        sr.error_signals(torch.rand(3, 2), torch.rand(3, 3, 2), torch.rand(3, 2))


def _sample_energy_of(forward, R):
    return lambda P, xn, tn: sr.energy(forward(R, P, xn[None])[1], tn[None])


def _soft(R, P, x):
    r = torch.sigmoid(x @ R.T)
    return r, torch.einsum("nm,nmo->no", r, torch.sigmoid(torch.einsum("moi,ni->nmo", P, x)))


def _listening(R, P, x):
    Y = torch.sigmoid(torch.einsum("moi,ni->nmo", P, x))
    r = torch.sigmoid(x @ R.T + (Y * Y.mean(dim=1, keepdim=True)).sum(dim=2))
    return r, torch.einsum("nm,nmo->no", r, Y)


@pytest.mark.parametrize("forward, scaled", [(_soft, True), (_listening, False)])
def test_route_gradient_vs_alone_tells_a_multiplying_gate_from_one_that_reads_the_routes(forward, scaled):
    net = _net(d_in=5, d_out=3, routes=4, std=0.7)
    x, y_star = _batch(9, 5, 3)
    R, P = net.R.detach(), net.P.detach()
    r, y = forward(R, P, x)
    s = ch03.route_gradient_vs_alone(_sample_energy_of(forward, R), P, x, y_star, r, y - y_star, chunk=4)
    assert s.deviation.shape == (9, 4) and s.norm_ratio.shape == (9, 4)
    if scaled:
        assert float(s.deviation.max()) < 1e-12
        torch.testing.assert_close(s.norm_ratio, r, rtol=1e-12, atol=1e-12)
    else:
        assert float(s.deviation.median()) > 1e-2


def test_route_gradient_vs_alone_rejects_bad_shapes():
    net = _net(d_in=5, d_out=3, routes=2)
    x, y_star = _batch(4, 5, 3)
    with pytest.raises(ValueError, match="shapes must be"):
        ch03.route_gradient_vs_alone(lambda P, xn, tn: P.sum(), net.P, x, y_star, torch.rand(4, 3, dtype=torch.float64),
                                   y_star)


# ----------------------------------------------------------------------------- the collapse ablations

def _ablation_data(n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = sr.with_bias(torch.rand(n, 1, 6, 6, generator=g, dtype=torch.float64))
    return x, torch.randint(0, 4, (n,), generator=g)


def _ablation_net(seed=0):
    return sr.SoftRoutingNet(37, 4, 3, init_std=0.05, routing_init_std=0.3,
                             generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_slides_variant_reproduces_the_hand_coded_update():
    x, y = _ablation_data()
    a, b = _ablation_net(), _ablation_net()
    sr.train_gd(a, x, y, epochs=2, batch_size=20, lr=0.05, seed=3, progress=False)
    ch03.train_variant(b, x, y, "slides", epochs=2, batch_size=20, lr=0.05, seed=3)
    torch.testing.assert_close(b.R.detach(), a.R.detach())
    torch.testing.assert_close(b.P.detach(), a.P.detach())


def test_no_r_in_eta_drops_only_the_routes_factor_r():
    x, y = _ablation_data()
    t = sr.one_hot(y, 4, dtype=torch.float64)
    net = _ablation_net()
    r, Y, out = ch03.variant_outputs(net, x, "no r in eta")
    torch.testing.assert_close(out, net(x))                    # same forward values
    ch03.variant_energy(r, Y, out, t, "no r in eta").backward()
    sig = sr.error_signals(r.detach(), Y.detach(), t)
    eta_without_r = sig.eta / r.detach().unsqueeze(2)          # Eq. ch3-eta without its factor r(j)
    torch.testing.assert_close(net.P.grad, torch.einsum("nmo,ni->moi", eta_without_r, x))
    torch.testing.assert_close(net.R.grad, torch.einsum("nm,ni->mi", sig.eps, x))   # the gate's is unchanged


def test_competitive_error_scores_each_route_on_its_own_output():
    x, y = _ablation_data(n=5)
    t = sr.one_hot(y, 4, dtype=torch.float64)
    r, Y, out = ch03.variant_outputs(_ablation_net(), x, "competitive error")
    q = r / r.sum(dim=1, keepdim=True)
    want = sum(0.5 * float(q[n, j]) * float(((t[n] - Y[n, j]) ** 2).sum()) for n in range(5) for j in range(3))
    assert float(ch03.variant_energy(r, Y, out, t, "competitive error")) == pytest.approx(want, rel=1e-12)


def test_gates_sum_to_one_on_average_and_bad_arguments():
    x, y = _ablation_data()
    net = ch03.init_gates_sum_to_one(_ablation_net(), x)
    assert float(net.routing(x).sum(dim=1).mean()) == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError, match="variant must be one of"):
        ch03.train_variant(_ablation_net(), x, y, "cooperative", epochs=1, batch_size=10, lr=0.1)
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        ch03.train_variant(_ablation_net(), x, y, "slides", epochs=0, batch_size=10, lr=0.1)
    hist = ch03.train_variant(_ablation_net(), x, y, "softmax gate", epochs=2, batch_size=30, lr=0.05)
    assert len(hist["entropy"]) == len(hist["mutual_information"]) == 3
    assert hist["gate_sum"] == pytest.approx([1.0] * 3)       # a softmax gate always sums to 1
    assert len(hist["mean_gate"]) == 3 and all(len(g) == 3 for g in hist["mean_gate"])   # (epochs + 1) x M routes
    assert [sum(g) for g in hist["mean_gate"]] == pytest.approx(hist["gate_sum"])          # the mean of the sum
