"""Tests of capslib.coupling_gradient (chapter 4) and of the chapter's measurements and graphs in
capslib.book.ch04."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capslib
from capslib import coupling_gradient as cg
from capslib import models
from capslib.book import ch04


def _votes(B=2, I=7, J=4, D=3, scale=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = scale * torch.randn(B, I, J, D, generator=g, dtype=torch.float64)
    gv = torch.randn(B, J, D, generator=g, dtype=torch.float64)
    return u, gv


def test_scaled_routing_is_dynamic_routing_at_scale_one():
    u, _ = _votes()
    for K in (1, 2, 4):
        for detach in (False, True):
            v1, c1 = cg.scaled_routing(u, K, 1.0, detach=detach)
            v2, c2 = capslib.dynamic_routing(u, K, detach=detach)
            torch.testing.assert_close(v1, v2)
            torch.testing.assert_close(c1, c2)


@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), I=st.integers(1, 9), J=st.integers(1, 5), D=st.integers(1, 4),
       K=st.integers(1, 4), lam=st.sampled_from([0.5, 1.0, 3.0]))
def test_gradient_terms_match_autograd(B, I, J, D, K, lam):
    u, gv = _votes(B, I, J, D, seed=B * 1000 + I * 100 + J * 10 + D)
    direct, through = cg.gradient_terms(u, gv, K, lam)
    full, detached = cg.autograd_terms(u, gv, K, lam)
    torch.testing.assert_close(direct, detached, rtol=0, atol=1e-8)
    torch.testing.assert_close(direct + through, full, rtol=0, atol=1e-8)


def test_one_iteration_has_no_second_term():
    u, gv = _votes()
    _, through = cg.gradient_terms(u, gv, 1)
    assert float(through.abs().max()) == 0.0
    assert cg.second_term_ratio(u, gv, 1) == 0.0


def test_per_vote_comparison_does_not_depend_on_the_gradient_scale():
    """The ratio and cosine of each vote are scale-free: a loss gradient 1e-160 times as large (the direct terms of
    sharply routed votes reach such sizes) gives the same numbers, not cosines clamped towards 0."""
    u, gv = _votes(J=5, seed=3)
    for lam in (1.0, 4.0):
        assert float(cg.gradient_terms(u, gv, 3, lam)[0].norm(dim=-1).min()) > 1e-100   # nothing underflows at 1e-160
        a, b = cg.per_vote_comparison(u, gv, 3, lam), cg.per_vote_comparison(u, 1e-160 * gv, 3, lam)
        for key in ("ratio", "cosine"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-12)
        direct, through = cg.gradient_terms(u, gv, 3, lam)
        full = direct + through
        cos = torch.nn.functional.cosine_similarity(full, direct, dim=-1, eps=1e-300).flatten()
        big = direct.norm(dim=-1).flatten() > 1e-100        # where the plain formula is safe
        torch.testing.assert_close(a["cosine"][big], cos[big], rtol=1e-9, atol=1e-12)
        assert bool(((a["cosine"] >= -1 - 1e-12) & (a["cosine"] <= 1 + 1e-12)).all())
        g = cg.vote_gains(u, 1e-160 * gv, 3, lam)          # the same cosine, vote by vote, at the tiny scale
        torch.testing.assert_close(g["cosine"], a["cosine"][g["has_direct"]], rtol=1e-9, atol=1e-12)
        g1 = cg.vote_gains(u, gv, 3, lam)                    # and the same gain and norm ratio (both scale-free)
        for key in ("gain", "norm_ratio"):
            assert bool(torch.isfinite(g[key]).all())
            torch.testing.assert_close(g[key], g1[key], rtol=1e-9, atol=1e-12)


def test_second_term_vanishes_when_couplings_saturate():
    u, gv = _votes(J=5, seed=3)
    assert cg.second_term_ratio(u, gv, 3, 1.0) > 0.05
    assert cg.second_term_ratio(u, gv, 3, 1e4) < 1e-6


def test_squash_vjp_gradcheck_and_zero():
    s = torch.randn(3, 5, dtype=torch.float64)
    gv = torch.randn(3, 5, dtype=torch.float64)
    s_ = s.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad((capslib.squash(s_) * gv).sum(), s_)
    torch.testing.assert_close(cg.squash_vjp(s, gv), auto, rtol=1e-10, atol=1e-12)
    z = torch.zeros(2, 4, dtype=torch.float64)
    assert torch.equal(cg.squash_vjp(z, torch.ones_like(z)), torch.zeros_like(z))


def test_routing_gradcheck_float64():
    u, _ = _votes(1, 4, 3, 2)
    u.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: cg.scaled_routing(x, 3, 2.0)[0], (u,))


def test_polarization_extremes():
    J = 10
    uniform = torch.full((2, 5, J), 1.0 / J)
    p = cg.polarization(uniform)
    assert p["entropy"] == pytest.approx(math.log(J), rel=1e-6)
    assert p["frac_high"] == 0.0
    onehot = torch.nn.functional.one_hot(torch.randint(0, J, (2, 5)), J).float()
    q = cg.polarization(onehot)
    assert q["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert q["frac_high"] == pytest.approx(0.1)
    assert q["frac_low"] == pytest.approx(0.9)
    assert q["frac_polarized"] == pytest.approx(1.0)


def test_digit_gradients_and_probe():
    torch.manual_seed(0)
    net = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,),
                         iterations=3)
    x, y = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    g = ch04.digit_gradients(net, x, y)
    assert net.digit.detach is False and net.digit.W.grad is None
    assert g["full"].shape == net.digit.W.shape and 0 < g["rel_diff"]
    assert -1 <= g["cosine"] <= 1 and g["couplings"].shape == (6, net.digit.in_caps, 10)
    net.digit.detach = True
    assert ch04.digit_gradients(net, x, y)["rel_diff"] == pytest.approx(g["rel_diff"])
    assert net.digit.detach is True
    probe = ch04.CouplingProbe(x, y, every=2)
    probe.start(net)
    for _ in range(3):
        probe.before_step(net, None)
    history = {}
    probe.on_epoch_end(0, net, history)
    assert probe.trace["step"] == [0, 2, 3]   # the epoch-end measurement closes the trace
    assert probe.trace["entropy"][-1] == probe.by_epoch["entropy"][-1]
    probe.before_step(net, None)               # step 3 is already traced: not measured twice
    assert probe.trace["step"] == [0, 2, 3] and probe.step == 4
    assert probe.by_epoch["epoch"] == [0, 1] and len(probe.seconds_by_epoch) == 1
    assert history["coupling_trace"] == probe.trace and history["coupling_by_epoch"] == probe.by_epoch
    assert history["probe_seconds"] == probe.seconds_by_epoch


def test_graphs_show_the_coupling_path():
    u = torch.randn(1, 4, 3, 2, requires_grad=True)
    for detach, expected in ((False, 1), (True, 0)):
        v, _ = capslib.dynamic_routing(u, 2, detach=detach)
        G = ch04.autograd_graph(v, {"û": u})
        assert ch04.coupling_paths(G) == expected
        assert len(ch04.nodes_labelled(G, "û")) == 1
        assert not any(d["label"] in ch04.SHAPE_OPS for _, d in G.nodes(data=True))
    raw = ch04.autograd_graph(capslib.dynamic_routing(u, 3)[0], {"û": u}, simplify=False)
    assert ch04.coupling_paths(raw) == 2
    import matplotlib
    matplotlib.use("Agg")
    fig = ch04.draw_graph(G, title="t")
    assert fig.axes


def test_bad_inputs():
    u, gv = _votes()
    with pytest.raises(ValueError, match=r"u_hat must be \(B, I, J, D\)"):
        cg.gradient_terms(u[0], gv)
    with pytest.raises(ValueError, match="grad_v must be"):
        cg.gradient_terms(u, gv[:, :2])
    with pytest.raises(ValueError, match="logit_scale"):
        cg.scaled_routing(u, 3, 0.0)
    with pytest.raises(TypeError, match="iterations"):
        cg.gradient_terms(u, gv, 2.5)
    with pytest.raises(ValueError, match=r"c must be \(B, I, J\)"):
        cg.polarization(torch.rand(3, 4))
    with pytest.raises(ValueError, match="no grad_fn"):
        ch04.autograd_graph(torch.zeros(3))
    with pytest.raises(TypeError, match="DenseCaps"):
        ch04.digit_gradients(torch.nn.Linear(2, 2), torch.rand(1, 2), torch.zeros(1, dtype=torch.long))


def test_relative_low_threshold():
    assert ch04.relative_low(10) == pytest.approx(0.01) and ch04.relative_low(4, 0.5) == pytest.approx(0.125)
    uniform = torch.full((2, 3, 10), 0.1)
    assert cg.polarization(uniform, low=ch04.relative_low(10))["frac_low"] == 0.0
    with pytest.raises(ValueError, match="factor"):
        ch04.relative_low(10, 1.5)


def test_margin_upstream_is_the_loss_gradient_of_the_scaled_routing():
    u, _ = _votes(B=3, I=5, J=4, D=3)
    y = torch.tensor([0, 3, 1])
    for lam, alpha in ((1.0, 1.0), (8.0, 1.0), (1.0, 3.0)):
        votes, gv = ch04.margin_upstream(u, y, 3, lam, alpha)
        torch.testing.assert_close(votes, alpha * u)
        v = cg.scaled_routing(votes, 3, lam)[0].detach().requires_grad_(True)
        (ref,) = torch.autograd.grad(capslib.margin_loss(v.norm(dim=-1), y), v)
        torch.testing.assert_close(gv, ref)
    # a different lambda routes differently, so the upstream gradient differs
    assert not torch.allclose(ch04.margin_upstream(u, y, 3, 1.0)[1], ch04.margin_upstream(u, y, 3, 8.0)[1])
    with pytest.raises(ValueError, match="y must be"):
        ch04.margin_upstream(u, y[:2])


def test_vote_gains_against_the_two_terms():
    u, gv = _votes(B=2, I=6, J=4, D=3)
    g = cg.vote_gains(u, gv, 3)
    direct, through = cg.gradient_terms(u, gv, 3)
    d, f = direct.flatten(0, 2), (direct + through).flatten(0, 2)
    assert g["has_direct"].shape == (2 * 6 * 4,) and bool(g["has_direct"].all())
    torch.testing.assert_close(g["gain"], (f * d).sum(-1) / (d * d).sum(-1))
    torch.testing.assert_close(g["norm_ratio"], f.norm(dim=-1) / d.norm(dim=-1))
    assert bool((g["cosine"].abs() <= 1 + 1e-12).all())
    one = cg.vote_gains(u, gv, 1)                      # one iteration: full = detached, C = 1 everywhere
    torch.testing.assert_close(one["gain"], torch.ones_like(one["gain"]))
    gv0 = gv.clone(); gv0[:, 0] = 0                    # a parent with no gradient: its votes have no direct term
    assert int(cg.vote_gains(u, gv0, 3)["has_direct"].sum()) == 2 * 6 * 3


def test_routing_trace_and_semantic_graph():
    u = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    for detach in (False, True):
        v, named = cg.routing_trace(u, 3, detach=detach)
        ref, c = capslib.dynamic_routing(u, 3, detach=detach)
        torch.testing.assert_close(v, ref)
        torch.testing.assert_close(named["c(3)"], c)
        (g1,) = torch.autograd.grad(v.sum(), u)
        (g2,) = torch.autograd.grad(ref.sum(), u)
        torch.testing.assert_close(g1, g2)
        G = ch04.semantic_graph(named, {"û": u})
        assert G.nodes["c(1)"]["kind"] == "constant" and G.nodes["û"]["kind"] == "input"
        if detach:
            assert sorted(G.edges) == [("s(3)", "v(3)"), ("û", "s(3)")] and not ch04.coupling_gradient_edges(G)
        else:
            assert {("û", "B(2)"), ("v(1)", "B(2)"), ("B(2)", "c(2)"), ("c(3)", "s(3)"), ("B(2)", "B(3)")} <= set(G.edges)
            road = ch04.coupling_gradient_edges(G)
            assert ("B(3)", "c(3)") in road and ("û", "s(3)") not in road
    import matplotlib
    matplotlib.use("Agg")
    assert ch04.draw_semantic_graph(G, title="t").axes
    with pytest.raises(ValueError, match="at least one"):
        ch04.semantic_graph({}, {"û": u})


def test_step_cost_times_both_kinds_of_step_and_counts_their_work():
    torch.manual_seed(0)
    net = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,), iterations=3)
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    net.eval()
    out = ch04.step_cost(net, x, y, pairs=3, warmup=1)
    assert len(out["ratio"]) == 3 and all(r > 0 for r in out["ratio"])
    assert len(out["seconds"]["full"]) == len(out["seconds"]["detached"]) == 3
    # backward through the routing iterations is more matrix-product work than through the last one
    assert out["flops"]["full"] > out["flops"]["detached"] > 0
    assert net.digit.detach is False and not net.training and net.digit.W.grad is None
    with pytest.raises(ValueError, match="pairs"):
        ch04.step_cost(net, x, y, pairs=1)
    with pytest.raises(TypeError, match="CapsNet"):
        ch04.step_cost(torch.nn.Linear(2, 2), x, y)


def test_gradient_by_iteration_matches_autograd_on_one_copy_of_the_votes_per_iteration():
    # autograd sees the votes as K separate leaves, one per routing iteration (its s and its logit update):
    # the gradient of leaf t is what flows back through iteration t
    torch.manual_seed(4)
    B, I, J, D, K, lam = 3, 6, 4, 5, 3, 2.0
    u = 0.7 * torch.randn(B, I, J, D, dtype=torch.float64)
    gv = torch.randn(B, J, D, dtype=torch.float64)
    leaves = [u.clone().requires_grad_(True) for _ in range(K)]
    b = torch.zeros(B, I, J, dtype=torch.float64)
    for t in range(K):
        c = torch.softmax(lam * b, dim=2)
        v = capslib.squash(torch.einsum("bij,bijd->bjd", c, leaves[t]))
        if t < K - 1:
            b = b + torch.einsum("bijd,bjd->bij", leaves[t], v)
    grads = torch.autograd.grad((v * gv).sum(), leaves)
    pieces = cg.gradient_by_iteration(u, gv, K, lam)
    assert pieces.shape == (K, B, I, J, D)
    for t in range(K):
        torch.testing.assert_close(pieces[t], grads[t], rtol=1e-10, atol=1e-12)
    direct, through = cg.gradient_terms(u, gv, K, lam)
    torch.testing.assert_close(pieces[-1], direct, rtol=0, atol=0)
    torch.testing.assert_close(pieces[:-1].sum(0), through, rtol=0, atol=0)
    assert float(pieces[0].norm()) > 0    # the first iteration (couplings 1/J) does carry gradient


def test_second_term_by_row_classes_rows_and_splits_the_flow_by_iteration():
    torch.manual_seed(5)
    u = 0.5 * torch.randn(4, 12, 5, 6, dtype=torch.float64)
    y = torch.arange(4) % 5
    got = ch04.second_term_by_row(u, y, 3, [1.0, 256.0])
    assert set(got) == {1.0, 256.0}
    assert set(got[1.0]) == {"undecided"} and got[1.0]["undecided"]["rows"] == 1.0   # no row decided at lambda 1
    for at in got.values():
        assert sum(s["rows"] for s in at.values()) == pytest.approx(1.0)
        for s in at.values():
            assert len(s["by_iteration"]) == 2 and sum(s["by_iteration"]) == pytest.approx(1.0) and s["second"] >= 0
    assert "saturated" in got[256.0]                # a large logit scale saturates rows
    with pytest.raises(ValueError, match="iterations"):
        ch04.second_term_by_row(u, y, 1, [1.0])
