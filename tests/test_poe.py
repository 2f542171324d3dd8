"""Tests of capslib.poe and capslib.poe_models (chapter 7: products of expert capsules, Hauser 2019)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capslib
from capslib import poe, poe_models
from capslib.book import ch07


def _problem(B=3, I=5, J=4, Do=3, Di=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    W = 0.5 * torch.randn(I, J, Do, Di, generator=g, dtype=dtype)
    x = capslib.squash(torch.randn(B, I, Di, generator=g, dtype=dtype))
    c = torch.softmax(torch.randn(B, I, J, generator=g, dtype=dtype), dim=2)
    return W, x, c


def test_free_energy_matches_definition():
    W, x, c = _problem()
    z = torch.stack([sum(c[:, i, j, None] * (x[:, i] @ W[i, j].T) for i in range(W.shape[0]))
                     for j in range(W.shape[1])], dim=1)                      # Eq. 3, by loops
    expected = -torch.log(1 + (z ** 2).sum(-1)).sum(1)
    torch.testing.assert_close(poe.free_energy(W, x, c), expected, rtol=1e-12, atol=1e-12)


def test_data_term_is_minus_autograd_of_free_energy():
    W, x, c = _problem()
    Wg = W.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(poe.free_energy(Wg, x, c).mean(), Wg)
    torch.testing.assert_close(poe.data_term(W, x, c), -grad, rtol=1e-10, atol=1e-10)


def test_data_term_finite_differences():
    W, x, c = _problem(seed=1)
    G = poe.data_term(W, x, c)
    h = 1e-6
    for idx in [(0, 0, 0, 0), (2, 3, 1, 1), (4, 1, 2, 0)]:
        Wp, Wm = W.clone(), W.clone()
        Wp[idx] += h
        Wm[idx] -= h
        fd = -(poe.free_energy(Wp, x, c).mean() - poe.free_energy(Wm, x, c).mean()) / (2 * h)
        assert abs(float(fd) - float(G[idx])) < 1e-7


def test_free_energy_gradcheck():
    W, x, c = _problem(B=2, I=3, J=2, Do=2, Di=2)
    assert torch.autograd.gradcheck(lambda w, xx: poe.free_energy(w, xx, c),
                                    (W.requires_grad_(True), x.requires_grad_(True)))


def test_firing_probability_is_sigmoid_of_log_norm_and_squash_length():
    z = torch.randn(6, 4, 5, dtype=torch.float64)
    p = poe.firing_probability(z)
    torch.testing.assert_close(p, torch.sigmoid(torch.log((z ** 2).sum(-1))))       # Eq. 12
    torch.testing.assert_close(p, capslib.squash(z).norm(dim=-1))                     # Eq. 13


def test_energy_marginal_is_free_energy():
    # sum over h in {0,1}^J of exp(-E(x, h)) = prod_j (1 + ||z_j||^2)  (Eq. 10)
    W, x, c = _problem(J=3)
    J = W.shape[1]
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    for k in range(2 ** J):
        h = torch.tensor([(k >> j) & 1 for j in range(J)], dtype=x.dtype).expand(x.shape[0], J)
        total = total + torch.exp(-poe.energy(W, x, c, h))
    torch.testing.assert_close(torch.log(total), -poe.free_energy(W, x, c))


def test_cd1_gradient_is_data_minus_reconstruction_term():
    W, x, _ = _problem(seed=2)
    r = poe.cd1(W, x, iterations=3)
    torch.testing.assert_close(r.delta, poe.data_term(W, x, r.c) - poe.data_term(W, r.x_tilde, r.c))
    torch.testing.assert_close(poe.cd1_gradient(W, x, 3), r.delta)
    torch.testing.assert_close(r.c.sum(dim=2), torch.ones(x.shape[:2], dtype=x.dtype))
    assert bool((r.x_tilde.norm(dim=-1) < 1).all())


def test_routing_one_iteration_is_uniform_and_normalize_inputs():
    W, x, _ = _problem()
    u = poe.votes(W, x)
    torch.testing.assert_close(poe.cosine_routing(u, 1), torch.full(u.shape[:3], 1 / u.shape[2], dtype=u.dtype))
    c = poe.cosine_routing(u, 3, normalize="inputs")
    torch.testing.assert_close(c.sum(dim=1), torch.ones(u.shape[0], u.shape[2], dtype=u.dtype))


def test_cosine_routing_ignores_vote_lengths_per_output():
    # scaling every vote of one output capsule leaves the cosines, hence c, unchanged
    W, x, _ = _problem(seed=3)
    u = poe.votes(W, x)
    u2 = u.clone()
    u2[:, :, 1] *= 7.0
    torch.testing.assert_close(poe.cosine_routing(u, 3), poe.cosine_routing(u2, 3))


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 4), I=st.integers(1, 6), J=st.integers(1, 5), Do=st.integers(1, 4), Di=st.integers(1, 4))
def test_shapes(B, I, J, Do, Di):
    W, x, c = _problem(B, I, J, Do, Di)
    assert poe.free_energy(W, x, c).shape == (B,)
    assert poe.data_term(W, x, c).shape == W.shape
    assert poe.cd1_gradient(W, x).shape == W.shape
    assert poe.route_reverse(W, torch.randn(B, J, Do, dtype=W.dtype), c).shape == (B, I, Di)
    U = torch.randn(I, J, Di, Do, dtype=W.dtype)
    y = capslib.squash(torch.randn(B, J, Do, dtype=W.dtype))
    assert poe.decode_capsules(U, y).shape == (B, I, Di)
    assert poe.decoder_gradient(U, y, x).shape == U.shape


def test_decoder_gradient_matches_loops():
    g = torch.Generator().manual_seed(4)
    U = torch.randn(5, 3, 2, 4, generator=g, dtype=torch.float64)
    y = capslib.squash(torch.randn(2, 3, 4, generator=g, dtype=torch.float64))
    t = capslib.squash(torch.randn(2, 5, 2, generator=g, dtype=torch.float64))
    e = poe.decoder_routing(U, y)
    torch.testing.assert_close(e.sum(dim=2), torch.ones(2, 5, dtype=torch.float64))
    B, I, J = e.shape
    z = torch.stack([sum(e[:, i, j, None] * (y[:, j] @ U[i, j].T) for j in range(J)) for i in range(I)], 1)
    torch.testing.assert_close(poe.decode_capsules(U, y), z)
    up = capslib.squash(torch.stack([sum(e[:, i, j, None] * (z[:, i] @ U[i, j]) for i in range(I)) for j in range(J)], 1))
    expected = torch.zeros_like(U)
    for b in range(B):
        for i in range(I):
            for j in range(J):
                pos = torch.outer(t[b, i], y[b, j]) / (1 + t[b, i].dot(t[b, i]))
                neg = torch.outer(z[b, i], up[b, j]) / (1 + z[b, i].dot(z[b, i]))
                expected[i, j] += 2 * e[b, i, j] * (pos - neg) / B
    torch.testing.assert_close(poe.decoder_gradient(U, y, t), expected)


def test_capsule_code_round_trip():
    h = torch.randn(2, 16, 6, 6, dtype=torch.float64)
    x = poe_models.code_to_capsules(h, 8)
    assert x.shape == (2, 6 * 6 * 2, 8)
    torch.testing.assert_close(poe_models.capsules_to_code(x, (16, 6, 6)), h)


def test_model_shapes_and_generation():
    torch.manual_seed(0)
    m = poe_models.PoECapsules(channels=16, out_caps=4, out_dim=6).eval()
    img = torch.rand(3, 1, 28, 28)
    x = m.capsules(img)
    assert x.shape == (3, 6 * 6 * 2, 8)
    y, c = m.encode(x)
    assert y.shape == (3, 4, 6) and c.shape == (3, 72, 4)
    assert m.decode(y).shape == (3, 1, 28, 28)
    g = torch.randn(5, 6)
    out = m.generate(2, g, hemisphere=torch.ones(6))
    assert out.shape == (5, 1, 28, 28)
    torch.testing.assert_close(m.generate(2, g, hemisphere=torch.ones(6)), m.generate(2, -g, hemisphere=torch.ones(6)))
    assert capslib.models.PoECapsules is poe_models.PoECapsules


def test_bad_inputs():
    W, x, c = _problem()
    with pytest.raises(ValueError, match=r"W must be \(I, J, Do, Di\)"):
        poe.free_energy(W[0], x, c)
    with pytest.raises(ValueError, match=r"x must be \(B, I, Di\)"):
        poe.data_term(W, x[:, :2], c)
    with pytest.raises(ValueError, match=r"c must be \(B, I, J\)"):
        poe.free_energy(W, x, c[:, :, :2])
    with pytest.raises(TypeError, match="W must be a torch.Tensor"):
        poe.cd1_gradient(W.numpy(), x)
    with pytest.raises(ValueError, match="normalize"):
        poe.cd1_gradient(W, x, normalize="rows")
    with pytest.raises(ValueError, match="iterations"):
        poe.cd1_gradient(W, x, iterations=0)
    with pytest.raises(ValueError, match="max_length"):
        poe_models.capsules_to_code(torch.zeros(1, 9, 8), (8, 3, 3), max_length=1.0)
    m = poe_models.PoECapsules(channels=16, out_caps=4, out_dim=6)
    with pytest.raises(ValueError, match="capsule must lie"):
        m.generate(4, torch.randn(2, 6))


def _reference_training(P, n, step, *, epochs, lr, batch, momentum, decay, l2, seed):
    """The schedule of Sec. 4.1 written out: momentum SGD, l2 on P, lr decay per epoch."""
    g = torch.Generator().manual_seed(seed)
    v = torch.zeros_like(P)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for k in range(0, n, batch):
            v = momentum * v + step(P, perm[k:k + batch]) - l2 * P
            P = P + lr * v
        lr *= decay
    return P


def test_train_weights_is_algorithm_1_with_momentum_decay_and_l2():
    W0, _, _ = _problem(B=7, I=5, J=3, Do=3, Di=2, seed=5)
    x = capslib.squash(torch.randn(7, 5, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64))
    kw = dict(epochs=3, lr=0.2, batch=3, momentum=0.8, decay=0.7, l2=1e-2)
    expected = _reference_training(W0.clone(), len(x), lambda P, idx: poe.cd1_gradient(P, x[idx], 2), seed=9, **kw)
    W = W0.clone()
    hist = poe_models.train_weights(W, x, iterations=2, generator=torch.Generator().manual_seed(9), **kw)
    torch.testing.assert_close(W, expected)
    assert set(hist) == {"reconstruction", "free_energy_gap", "firing", "weight_norm"}
    assert all(len(v) == 3 for v in hist.values())
    assert hist["weight_norm"][-1] == pytest.approx(float(W.norm()))
    # what the history measures: one epoch of one minibatch at lr = 0 gives the first W's chain
    one = x[:7]
    Wb = W0.clone()
    h1 = poe_models.train_weights(Wb, one, epochs=1, lr=0.0, batch=7, iterations=2, momentum=0.0, decay=1.0, l2=0.0)
    r = poe.cd1(W0, one, 2)
    assert h1["reconstruction"][0] == pytest.approx(float(((one - r.x_tilde) ** 2).mean()))
    gap = (torch.log1p(-r.y.norm(dim=-1)) - torch.log1p(-r.y_tilde.norm(dim=-1))).sum(1).mean()
    assert h1["free_energy_gap"][0] == pytest.approx(float(gap))
    torch.testing.assert_close(Wb, W0)                                        # lr = 0 moves nothing
    # F(x) = -sum_j log(1 + ||z_j||^2) = sum_j log(1 - ||squash(z_j)||)
    torch.testing.assert_close(poe.free_energy(W0, one, r.c), torch.log1p(-r.y.norm(dim=-1)).sum(1))


def test_train_decoder_matches_the_schedule_and_evaluates_each_epoch():
    g = torch.Generator().manual_seed(7)
    U0 = 0.3 * torch.randn(5, 3, 2, 4, generator=g, dtype=torch.float64)
    y = capslib.squash(torch.randn(6, 3, 4, generator=g, dtype=torch.float64))
    t = capslib.squash(torch.randn(6, 5, 2, generator=g, dtype=torch.float64))
    kw = dict(epochs=2, lr=0.1, batch=4, momentum=0.9, decay=0.5, l2=1e-3)
    expected = _reference_training(U0.clone(), len(y), lambda P, idx: poe.decoder_gradient(P, y[idx], t[idx], 3),
                                   seed=2, **kw)
    U = U0.clone()
    calls = []
    hist = poe_models.train_decoder(U, y, t, iterations=3, generator=torch.Generator().manual_seed(2),
                             evaluate=lambda: calls.append(1) or {"norm": U.norm().item()}, **kw)
    torch.testing.assert_close(U, expected)
    assert len(calls) == 2 and hist["norm"][-1] == pytest.approx(float(U.norm()))
    with pytest.raises(ValueError, match="same number of samples"):
        poe_models.train_decoder(U, y[:2], t, epochs=1, lr=0.1, batch=2)


def test_with_experts_shares_the_autoencoder_and_draws_w_u_from_the_seed():
    torch.manual_seed(0)
    m = poe_models.PoECapsules(channels=16, out_caps=4, out_dim=6, init_std=0.05)
    W_before = m.W.clone()
    a, b, c = m.with_experts(3), m.with_experts(3), m.with_experts(4)
    assert a.autoencoder is m.autoencoder and c.autoencoder is m.autoencoder
    torch.testing.assert_close(a.W, b.W)
    torch.testing.assert_close(a.U, b.U)
    assert not torch.equal(a.W, c.W)
    torch.testing.assert_close(m.W, W_before)                                  # the original keeps its W
    assert a.W.shape == m.W.shape and a.U.shape == m.U.shape and a.code_shape == m.code_shape
    assert 0.03 < float(a.W.std()) < 0.07
    with torch.no_grad():
        a.W.add_(1.0)
    torch.testing.assert_close(m.W, W_before)                                  # W is not shared
    with pytest.raises(ValueError, match="seed"):
        m.with_experts(-1)


# ----------------------------------------------------------------------------- exact toy, sparsity control

def _enumerable_toy(seed=0, scale=1.0, I=3, J=2, Di=2, Do=2, N=32):
    g = torch.Generator().manual_seed(seed)
    ang = torch.arange(4, dtype=torch.float64) * torch.pi / 2
    pts = torch.cat([torch.stack([r * torch.cos(ang), r * torch.sin(ang)], 1) for r in (0.3, 0.8)])
    states = pts[torch.cartesian_prod(*[torch.arange(len(pts))] * I)]
    W = scale * torch.randn(I, J, Do, Di, generator=g, dtype=torch.float64)
    draw = torch.randint(0, len(states), (N,), generator=g)
    data = torch.bincount(draw, minlength=len(states)).double() / N
    return W, states, data, states[draw]


def test_exact_gradient_with_couplings_fixed_is_data_minus_model_term():
    W, states, data, x = _enumerable_toy(seed=1)
    c = poe.cosine_routing(poe.votes(W, states), 3)
    z = poe.route_forward(W, states, c)
    neg_f = torch.log1p((z * z).sum(-1)).sum(1)
    p_model = torch.softmax(neg_f, 0)
    d = torch.stack([poe.data_term(W, states[s:s + 1], c[s:s + 1]) for s in range(len(states))])
    expected = torch.einsum("s,sijoe->ijoe", data - p_model, d)
    torch.testing.assert_close(ch07.exact_log_likelihood_gradient(W, states, data), expected)
    # the data half is the batch data term of Algorithm 1 on the same draws
    torch.testing.assert_close(torch.einsum("s,sijoe->ijoe", data, d), poe.data_term(W, x, poe.cosine_routing(
        poe.votes(W, x), 3)))


def test_exact_gradient_through_couplings_matches_finite_differences():
    W, states, data, _ = _enumerable_toy(seed=2, I=2)

    def loglik(Wp):
        u = poe.votes(Wp, states)
        z = torch.einsum("bij,bijo->bjo", poe._routing_differentiable(u, 3, "outputs"), u)
        neg_f = torch.log1p((z * z).sum(-1)).sum(1)
        return float((data * (neg_f - torch.logsumexp(neg_f, 0))).sum())

    grad = ch07.exact_log_likelihood_gradient(W, states, data, through_couplings=True)
    for idx in [(0, 0, 0, 0), (1, 1, 1, 0), (0, 1, 0, 1)]:
        Wp, Wm = W.clone(), W.clone()
        Wp[idx] += 1e-6
        Wm[idx] -= 1e-6
        assert abs((loglik(Wp) - loglik(Wm)) / 2e-6 - float(grad[idx])) < 1e-6


def test_exact_gradient_and_gibbs_cd1_vanish_when_the_data_follow_the_model():
    W, states, _, _ = _enumerable_toy(seed=3, scale=2.0)
    c = poe.cosine_routing(poe.votes(W, states), 3)
    z = poe.route_forward(W, states, c)
    p_model = torch.softmax(torch.log1p((z * z).sum(-1)).sum(1), 0)
    zero = torch.zeros_like(W)
    torch.testing.assert_close(ch07.exact_log_likelihood_gradient(W, states, p_model), zero)
    # a Gibbs step leaves the model distribution where it is, so its expected CD-1 update is 0 as well
    torch.testing.assert_close(ch07.gibbs_cd1_expected(W, states, p_model), zero)
    # on other data it is not 0 and points along the exact gradient
    _, _, data, _ = _enumerable_toy(seed=4)
    gibbs, exact = ch07.gibbs_cd1_expected(W, states, data), ch07.exact_log_likelihood_gradient(W, states, data)
    assert float((gibbs.flatten() @ exact.flatten()) / (gibbs.norm() * exact.norm())) > 0.5


def test_gibbs_cd1_matches_sampling():
    W, states, data, _ = _enumerable_toy(seed=5, scale=1.5, I=2)
    c = poe.cosine_routing(poe.votes(W, states), 3)
    z = poe.route_forward(W, states, c)
    n2 = (z * z).sum(-1)
    d = torch.stack([poe.data_term(W, states[s:s + 1], c[s:s + 1]) for s in range(len(states))])
    g = torch.Generator().manual_seed(0)
    n = 40000
    xs = torch.multinomial(data, n, replacement=True, generator=g)
    h = (torch.rand(n, W.shape[1], generator=g, dtype=torch.float64) < (n2 / (1 + n2))[xs]).double()
    log_w = h @ torch.log(n2).T                                     # (n, S)
    x2 = torch.multinomial(torch.softmax(log_w, 1), 1, generator=g).squeeze(1)
    sampled = torch.einsum("s,sijoe->ijoe", data, d) - d[x2].mean(0)
    torch.testing.assert_close(ch07.gibbs_cd1_expected(W, states, data), sampled, atol=0.02, rtol=0)


def test_exact_gradient_rejects_bad_data():
    W, states, data, _ = _enumerable_toy()
    with pytest.raises(ValueError, match="probability vector"):
        ch07.exact_log_likelihood_gradient(W, states, 2 * data)
    with pytest.raises(ValueError, match="one weight per state"):
        ch07.gibbs_cd1_expected(W, states, data[:-1])


def test_sparsity_term_is_the_ascent_direction_of_the_penalty():
    W, x, c = _problem(B=5, I=4, J=3, Do=3, Di=2, seed=7)
    W_req = W.clone().requires_grad_(True)
    z = poe.route_forward(W_req, x, c)
    n2 = (z * z).sum(-1)
    q = (n2 / (1 + n2)).mean(0)
    (grad,) = torch.autograd.grad(-0.5 * ((q - 0.2) ** 2).sum(), W_req)
    torch.testing.assert_close(poe.sparsity_term(W, x, c, 0.2), grad)
    with pytest.raises(ValueError, match="target"):
        poe.sparsity_term(W, x, c, 1.5)


def test_train_weights_sparse_with_zero_strength_is_train_weights():
    W0, x, _ = _problem(B=20, I=4, J=3, Do=3, Di=2, seed=8)
    Wa, Wb = W0.clone(), W0.clone()
    kw = dict(epochs=2, lr=0.05, batch=5, iterations=2)
    ha = poe_models.train_weights(Wa, x, generator=torch.Generator().manual_seed(0), **kw)
    hb = poe_models.train_weights_sparse(Wb, x, strength=0.0, target=0.1, generator=torch.Generator().manual_seed(0),
                                         **kw)
    torch.testing.assert_close(Wa, Wb)
    assert ha["reconstruction"] == pytest.approx(hb["reconstruction"])
    Wc = W0.clone()
    poe_models.train_weights_sparse(Wc, x, strength=5.0, target=0.1, generator=torch.Generator().manual_seed(0), **kw)
    assert not torch.allclose(Wc, Wa)
