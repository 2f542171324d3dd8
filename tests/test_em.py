"""Tests of capslib.em (EM routing, Hinton et al. 2018, Procedure 1; the spread loss) and capslib.em_layers (its layers
and networks)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capslib
from capslib import em, em_layers
from capslib.book import ch05


def plain_em(V, a, beta_u, beta_a, iterations, final_lambda=em.FINAL_LAMBDA, var_floor=em.VAR_FLOOR, eps=em.EPS,
             normalize=em.NORMALIZE, lambdas=None):
    """Procedure 1 written with the plain formulas (no centring, no moment tricks); ``lambdas``: the
    inverse temperature of each iteration (default: the book's ramp)."""
    B, I, J, H = V.shape
    R = torch.full((B, I, J), 1.0 / J, dtype=V.dtype)
    for lam in lambdas or [final_lambda * (t + 1) / iterations for t in range(iterations)]:
        rp = R * a[:, :, None]
        S = rp.sum(1).clamp_min(eps)
        mu = (rp[..., None] * V).sum(1) / S[..., None]
        var = (rp[..., None] * (V - mu[:, None]) ** 2).sum(1) / S[..., None] + var_floor
        amount = rp.sum(1) / I if normalize == "mean" else rp.sum(1)
        cost = ((beta_u[:, None] + 0.5 * torch.log(var)) * amount[..., None]).sum(-1)
        if normalize == "std":
            cost = (cost - cost.mean(-1, keepdim=True)) / torch.sqrt(cost.var(-1, unbiased=False, keepdim=True)
                                                                      + em.STD_EPS)
        act = torch.sigmoid(lam * (beta_a - cost))
        logp = -((V - mu[:, None]) ** 2 / (2 * var[:, None]) + 0.5 * torch.log(2 * math.pi * var[:, None])).sum(-1)
        R = torch.softmax(torch.log(act)[:, None, :] + logp, dim=2)
    return mu, act, R


def _inputs(B=2, I=6, J=4, H=16, scale=1.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    V = scale * torch.randn(B, I, J, H, generator=g, dtype=dtype)
    a = torch.rand(B, I, generator=g, dtype=dtype)
    bu = 0.1 * torch.randn(J, generator=g, dtype=dtype)
    ba = 0.1 * torch.randn(J, generator=g, dtype=dtype)
    return V, a, bu, ba


def _finite_grads(V, a, bu, ba, iterations=3):
    V, a, bu, ba = (t.clone().requires_grad_(True) for t in (V, a, bu, ba))
    mu, act, R = em.em_routing(V, a, bu, ba, iterations)
    assert torch.isfinite(mu).all() and torch.isfinite(act).all() and torch.isfinite(R).all()
    torch.testing.assert_close(R.sum(-1), torch.ones_like(R.sum(-1)))
    (mu.square().sum() + act.sum() + (R * torch.arange(R.shape[-1], dtype=R.dtype)).sum()).backward()
    for t in (V, a, bu, ba):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    return mu, act, R


@pytest.mark.parametrize("normalize", ["mean", "none", "std"])
def test_matches_plain_procedure_float64(normalize):
    V, a, bu, ba = _inputs()
    lam = em.LITERAL_FINAL_LAMBDA if normalize == "none" else em.FINAL_LAMBDA
    for iterations in (1, 2, 3, 5):
        want_all = plain_em(V, a, bu, ba, iterations, lam, normalize=normalize)
        got_all = em.em_routing(V, a, bu, ba, iterations, final_lambda=lam, normalize=normalize)
        for want, got in zip(want_all, got_all):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_mean_normalisation_is_literal_with_scaled_lambda():
    # dividing sum_i r'_ij by I is the same as dividing lambda by I and multiplying beta_a by I
    # (Eq. ch5-costnorm): lambda (beta_a - cost / I) = (lambda / I) (I beta_a - cost)
    V, a, bu, ba = _inputs(I=9)
    got = em.em_routing(V, a, bu, ba, 3, final_lambda=0.9, normalize="mean")
    want = em.em_routing(V, a, bu, 9 * ba, 3, final_lambda=0.1, normalize="none")
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


def test_mean_normalisation_cost_independent_of_number_of_children():
    # the same 5 votes repeated 4 times: literal costs scale by 4, normalised ones do not
    V, a, bu, ba = _inputs(I=5)
    V4, a4 = V.repeat(1, 4, 1, 1), a.repeat(1, 4)
    mu, act, _ = em.em_routing(V, a, bu, ba, 2, normalize="mean")
    mu4, act4, _ = em.em_routing(V4, a4, bu, ba, 2, normalize="mean")
    torch.testing.assert_close(mu4, mu)
    torch.testing.assert_close(act4, act)
    assert not torch.allclose(em.em_routing(V, a, bu, ba, 1, normalize="none")[1],
                              em.em_routing(V4, a4, bu, ba, 1, normalize="none")[1])


def test_exported_from_capslib():
    assert capslib.em_routing is em.em_routing
    from capslib import layers, models
    assert layers.ConvCaps is em_layers.ConvCaps and layers.MatrixCaps is em_layers.MatrixCaps
    assert layers.PrimaryMatrixCaps is em_layers.PrimaryMatrixCaps and layers.ClassCaps is em_layers.ClassCaps
    assert models.EMCapsNet is em_layers.EMCapsNet


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 3), I=st.integers(1, 7), J=st.integers(1, 5), H=st.integers(1, 16), it=st.integers(1, 4))
def test_shapes_and_assignments_sum_to_one(B, I, J, H, it):
    V, a, bu, ba = _inputs(B, I, J, H, dtype=torch.float32)
    mu, act, R = em.em_routing(V, a, bu, ba, it)
    assert mu.shape == (B, J, H) and act.shape == (B, J) and R.shape == (B, I, J)
    torch.testing.assert_close(R.sum(-1), torch.ones(B, I))
    assert torch.isfinite(act).all() and ((act >= 0) & (act <= 1)).all()   # may round to 0 or 1 in float32


def test_identical_votes_zero_variance_finite():
    V, a, bu, ba = _inputs()
    V = V[:, :1].expand_as(V).contiguous()          # every child casts the same vote
    mu, act, R = _finite_grads(V, a, bu, ba)
    torch.testing.assert_close(mu, V[:, 0])


def test_all_zero_activations_finite():
    V, a, bu, ba = _inputs()
    mu, act, R = _finite_grads(V, torch.zeros_like(a), bu, ba)
    torch.testing.assert_close(mu, V.mean(dim=1))   # no activation: the plain mean of the votes


def test_huge_votes_finite_float32():
    V, a, bu, ba = _inputs(scale=1e4, dtype=torch.float32)
    _finite_grads(V, a, bu, ba)


def test_one_input_capsule():
    V, a, bu, ba = _inputs(I=1)
    mu, act, R = _finite_grads(V, a, bu, ba)
    torch.testing.assert_close(mu, V[:, 0])


def test_gradcheck_float64():
    V, a, bu, ba = _inputs(B=1, I=4, J=3, H=4)
    f = lambda V, a, bu, ba: em.em_routing(V, a, bu, ba, 2)[:2]
    assert torch.autograd.gradcheck(f, tuple(t.clone().requires_grad_(True) for t in (V, a, bu, ba)))



class _UngatheredReads(capslib.ops.Reads):
    """Reads whose products are plain ``capslib.ops.bmm``: each read's outer product formed on its own."""

    def __init__(self, x):
        super().__init__(x)
        self._gathered, self.x = False, x


@pytest.mark.parametrize("kw", [dict(), dict(detach=True), dict(renormalise_over_parents=True),
                                dict(normalize="std"), dict(normalize="none", final_lambda=em.AUTHORS_FINAL_LAMBDA,
                                                            schedule="authors")])
def test_gradients_gathered_from_every_read_are_autograds(kw, monkeypatch):
    # every read of the votes leaves its part of their gradient to one product (capslib.ops.Reads): the
    # gradients must equal those of the votes' outer products formed read by read, and (float64) the
    # derivative (gradcheck) and autograd through the plain formulas, where routing is differentiated whole
    V, a, bu, ba = _inputs(B=2, I=5, J=3, H=4)
    lams = em.inverse_temperatures(3, kw.get("final_lambda", em.FINAL_LAMBDA), kw.get("schedule", "ramp"))
    plain = lambda *t: plain_em(*t, 3, normalize=kw.get("normalize", em.NORMALIZE), lambdas=lams)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (V, a, bu, ba)]
        mu, act, R = fn(*leaves)
        loss = mu.square().sum() + (act * torch.arange(3.0, dtype=act.dtype)).sum() + R[..., 0].sum()
        return torch.autograd.grad(loss, leaves)

    gathered = grads(lambda *t: em.em_routing(*t, 3, **kw))
    monkeypatch.setattr(em, "Reads", _UngatheredReads)
    for mine, ref in zip(gathered, grads(lambda *t: em.em_routing(*t, 3, **kw))):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    monkeypatch.undo()
    if kw.get("detach"):
        return       # detached couplings: by design not the derivative of the routing
    assert torch.autograd.gradcheck(lambda *t: em.em_routing(*t, 3, **kw)[:2],
                                    tuple(t.clone().requires_grad_(True) for t in (V, a, bu, ba)))
    if not kw.get("renormalise_over_parents"):             # plain_em has no pitfall switch
        for mine, ref in zip(gathered, grads(plain)):
            torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-10)

def test_trace_ends_at_em_routing():
    V, a, bu, ba = _inputs()
    states = em.em_trace(V, a, bu, ba, 3)
    mu, act, R = em.em_routing(V, a, bu, ba, 3)
    assert len(states) == 3
    torch.testing.assert_close(states[-1].mu, mu)
    torch.testing.assert_close(states[-1].a, act)
    torch.testing.assert_close(states[-1].R, R)


def test_detach_same_forward():
    V, a, bu, ba = _inputs()
    for x, y in zip(em.em_routing(V, a, bu, ba, 3), em.em_routing(V, a, bu, ba, 3, detach=True)):
        torch.testing.assert_close(x, y)


def test_inverse_temperature_schedule():
    lams = em.inverse_temperatures(3, 0.3)
    assert lams == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(ValueError):
        em.inverse_temperatures(0)
    # constant: iteration t uses the same lambda whatever the number of iterations
    assert em.inverse_temperatures(3, 0.3, "constant") == [0.3, 0.3, 0.3]
    assert em.inverse_temperatures(1, 0.3, "constant") == em.inverse_temperatures(1, 0.3)
    with pytest.raises(ValueError, match="schedule"):
        em.inverse_temperatures(3, 0.3, "cosine")


def test_constant_schedule_routes_as_its_lambdas_say():
    V, a, bu, ba = _inputs()
    ramp = em.em_routing(V, a, bu, ba, 3, final_lambda=1.0)
    const = em.em_routing(V, a, bu, ba, 3, final_lambda=1.0, schedule="constant")
    # the first two M-steps differ (1/3, 2/3 against 1), so the result does
    assert not torch.allclose(ramp[1], const[1])
    # one iteration of either schedule is the same computation
    for x, y in zip(em.em_routing(V, a, bu, ba, 1, final_lambda=1.0),
                    em.em_routing(V, a, bu, ba, 1, final_lambda=1.0, schedule="constant")):
        torch.testing.assert_close(x, y)
    # against the plain formulas with lambda = final_lambda in every iteration
    for x, y in zip(const, plain_em(V, a, bu, ba, 3, final_lambda=1.0, lambdas=[1.0, 1.0, 1.0])):
        torch.testing.assert_close(x, y)
    # the network's argument reaches every routed layer
    torch.manual_seed(0)
    net = em_layers.EMCapsNet(A=4, B=2, C=2, D=2, iterations=2)
    x = torch.rand(2, 1, 28, 28)
    net.eval()
    base = net(x).activations
    torch.manual_seed(0)
    const_net = em_layers.EMCapsNet(A=4, B=2, C=2, D=2, iterations=2, schedule="constant").eval()
    assert all(layer.schedule == "constant" for layer in (const_net.conv_caps1, const_net.conv_caps2,
                                                          const_net.class_caps))
    assert "schedule='constant'" in repr(const_net) and "schedule" not in repr(net)
    assert not torch.allclose(base, const_net(x).activations)
    with pytest.raises(ValueError, match="schedule"):
        em_layers.EMCapsNet(A=4, B=2, C=2, D=2, schedule="warm")


def test_bad_inputs():
    V, a, bu, ba = _inputs()
    with pytest.raises(ValueError, match="votes"):
        em.em_routing(V[0], a, bu, ba)
    with pytest.raises(ValueError, match="activations"):
        em.em_routing(V, a[:, :3], bu, ba)
    with pytest.raises(TypeError, match="votes"):
        em.em_routing(V.long(), a, bu, ba)
    with pytest.raises(ValueError, match="beta_u"):
        em.em_routing(V, a, torch.zeros(7), ba)
    with pytest.raises(ValueError, match="iterations"):
        em.em_routing(V, a, bu, ba, 0)
    with pytest.raises(ValueError, match="normalize"):
        em.em_routing(V, a, bu, ba, normalize="sum")


def test_spread_loss_and_margin():
    act = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1]])
    y = torch.tensor([0, 2])
    # sample 0: gaps 0.8, 0.4 -> max(0, 0.5-0.8)=0, max(0, 0.5-0.4)=0.1 -> 0.01
    # sample 1: gaps -0.1, -0.2 -> 0.6^2 + 0.7^2 = 0.85
    torch.testing.assert_close(em.spread_loss(act, y, 0.5), torch.tensor((0.01 + 0.85) / 2))
    assert em.margin_at(0, 11) == pytest.approx(0.2) and em.margin_at(10, 11) == pytest.approx(0.9)
    assert em.margin_at(5, 11) == pytest.approx(0.55)
    with pytest.raises(TypeError):
        em.spread_loss(act, y.float(), 0.5)


def test_conv_caps_matches_loop():
    torch.manual_seed(0)
    layer = em_layers.ConvCaps(3, 2, kernel_size=3, stride=2, iterations=2).double()
    pose = torch.randn(2, 7, 5, 3, 4, 4, dtype=torch.float64)
    a = torch.rand(2, 7, 5, 3, dtype=torch.float64)
    mu, act = layer(pose, a)
    assert mu.shape == (2, 3, 2, 2, 4, 4) and act.shape == (2, 3, 2, 2)
    # one patch by hand: output position (1, 0) reads rows 2..4, cols 0..2
    M = pose[:, 2:5, 0:3].reshape(2, 27, 4, 4)
    votes = torch.einsum("nipq,ijqr->nijpr", M, layer.W).reshape(2, 27, 2, 16)
    mu1, act1, _ = em.em_routing(votes, a[:, 2:5, 0:3].reshape(2, 27), layer.beta_u, layer.beta_a, 2,
                                 final_lambda=layer.final_lambda, normalize=layer.normalize)
    torch.testing.assert_close(mu[:, 1, 0].reshape(2, 2, 16), mu1)
    torch.testing.assert_close(act[:, 1, 0], act1)


def test_class_caps_coordinate_addition():
    torch.manual_seed(0)
    layer = em_layers.ClassCaps(2, classes=3, iterations=1).double()
    pose = torch.zeros(1, 2, 2, 2, 4, 4, dtype=torch.float64)
    a = torch.ones(1, 2, 2, 2, dtype=torch.float64)
    mu, act = layer(pose, a)
    # zero poses: votes are only the coordinates, whose mean is the grid centre 0.5
    torch.testing.assert_close(mu[0, :, 0, 3], torch.full((3,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(mu[0, :, 1, 3], torch.full((3,), 0.5, dtype=torch.float64))
    assert float(mu[0, :, 2:, :].detach().abs().max()) == 0.0


def test_em_capsnet_forward_backward():
    torch.manual_seed(0)
    model = em_layers.EMCapsNet(A=8, B=4, C=4, D=4, iterations=2)
    x = torch.rand(3, 1, 28, 28)
    model.calibrate(x)
    out = model(x)
    assert out.activations.shape == (3, 10) and out.poses.shape == (3, 10, 4, 4)
    em.spread_loss(out.activations, torch.tensor([0, 1, 2]), 0.2).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.iterations = 1
    assert model.conv_caps1.iterations == 1 and model.class_caps.iterations == 1
    assert model(torch.rand(2, 1, 40, 40)).activations.shape == (2, 10)   # any input size
    with pytest.raises(ValueError, match="x must be"):
        model(torch.rand(2, 3, 28, 28))


def _small_net(iterations, images):
    """A small EMCapsNet (seed 0), calibrated on ``images`` random images and put in eval mode; and the images."""
    torch.manual_seed(0)
    model = em_layers.EMCapsNet(A=8, B=4, C=4, D=4, iterations=iterations)
    x = torch.rand(images, 1, 28, 28)
    model.calibrate(x)
    return model.eval(), x


def test_routing_stays_float32_under_bf16_autocast():
    """The full profile trains under bf16 autocast on CUDA; EM must still run in float32.
    CPU autocast exercises the same code path here."""
    model, x = _small_net(3, 4)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            mu, act = model.class_caps.route(torch.randn(2, 10, 6, 4, 4).bfloat16(), torch.rand(2, 6).bfloat16())
    assert mu.dtype == torch.float32 and act.dtype == torch.float32
    assert out.activations.dtype == torch.float32 and torch.isfinite(out.activations).all()
    # only the votes' matmuls ran in bf16, so the activations stay close to the float32 ones
    assert float((out.activations - ref.activations).abs().max()) < 0.1


def test_matched_cnn_is_the_nearest_in_parameters_and_refuses_bad_input():
    from capslib import models
    target = models.count_parameters(em_layers.EMCapsNet(A=16, B=4, C=4, D=4))
    w = ch05.matched_width(target)
    count = lambda k: models.count_parameters(ch05.SmallConvNet(k))   # noqa: E731
    assert abs(count(w) - target) <= min(abs(count(w - 1) - target), abs(count(w + 1) - target))
    assert ch05.matched_width(1) == 1
    for side in (28, 40):
        assert ch05.SmallConvNet(w)(torch.rand(3, 1, side, side)).shape == (3, 10)
    with pytest.raises(ValueError, match=r"x must be \(B, 1, H, W\)"):
        ch05.SmallConvNet(w)(torch.rand(3, 2, 28, 28))
    with pytest.raises(ValueError, match="width"):
        ch05.SmallConvNet(0)


def test_renormalising_over_parents_cancels_the_activations():
    # the pitfall divides r' = R a by its sum over the parents, a_i: the routing then sees every child as fully active
    V, a, bu, ba = _inputs(I=8)
    a = 0.05 + 0.95 * a                                           # every activation above eps
    for iterations in (1, 3):
        pit = em.em_routing(V, a, bu, ba, iterations, renormalise_over_parents=True)
        for got, want in zip(pit, em.em_routing(V, torch.ones_like(a), bu, ba, iterations)):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        for got, want in zip(em.em_routing(V, a, bu, ba, iterations), plain_em(V, a, bu, ba, iterations)):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)    # off by default
    # one M-step from uniform R: a silent child (a = 1e-3) whose votes move by 50 moves a parent's mean by
    # 50 a_0 / sum_i a_i as printed, and by 50 / I with the pitfall (every child counts alike)
    far = V.clone()
    far[:, 0] += 50.0
    quiet = a.clone()
    quiet[:, 0] = 1e-3
    moved = {pit: em.em_routing(far, quiet, bu, ba, 1, renormalise_over_parents=pit)[0]
             - em.em_routing(V, quiet, bu, ba, 1, renormalise_over_parents=pit)[0] for pit in (False, True)}
    share = (50.0 * quiet[:, 0] / quiet.sum(1))[:, None, None].expand_as(moved[False])
    torch.testing.assert_close(moved[False], share, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(moved[True], torch.full_like(moved[True], 50.0 / 8), atol=1e-10, rtol=1e-10)


def test_the_pitfall_is_a_switch_of_a_trained_network():
    model, x = _small_net(2, 3)
    with torch.no_grad():
        plain = model(x).activations
        assert model.renormalise_over_parents is False
        model.renormalise_over_parents = True
        assert all(layer.renormalise_over_parents for layer in (model.conv_caps1, model.conv_caps2, model.class_caps))
        assert "renormalise_over_parents=True" in repr(model.class_caps)
        switched = model(x).activations
        model.renormalise_over_parents = False
        torch.testing.assert_close(model(x).activations, plain)
    assert not torch.allclose(switched, plain)
    with pytest.raises(ValueError, match="must be a bool"):
        model.renormalise_over_parents = 1


def test_random_turn_draws_each_image_an_angle_within_its_range():
    x = capslib.data.embedded_mnist()["test"].x[:48]
    turn = ch05.RandomTurn(20, seed=3)
    first, second = turn(x), turn(x)
    assert not torch.equal(first, second)                                  # new angles for every batch
    assert torch.equal(ch05.RandomTurn(20, seed=3)(x), first)              # seeded
    # each image equals one turn of itself by an angle in [-20, 20]: the nearest of a fine grid of turns
    grid = torch.linspace(-20, 20, 81)
    turned = torch.stack([capslib.data.rotate(x, float(a), seed=None) for a in grid])          # (81, N, 1, 28, 28)
    err = (turned - first).abs().flatten(2).max(dim=2).values                           # (81, N)
    best = grid[err.argmin(dim=0)]
    assert float(err.min(dim=0).values.max()) < 0.25                   # a grid step (0.5 degree) away at most
    assert best.min() < -5 and best.max() > 5                          # both ways, and not all near 0
    outside = torch.stack([capslib.data.rotate(x, a, seed=None) for a in (-35.0, 35.0)])
    assert float((outside - first).abs().flatten(2).max(dim=2).values.min()) > 0.25
    assert torch.equal(ch05.RandomTurn(0)(x), x)
    for bad in (-1, 200, float("nan")):
        with pytest.raises(ValueError, match="max_degrees"):
            ch05.RandomTurn(bad)
    with pytest.raises(ValueError, match="x must be"):
        turn(x[0])

