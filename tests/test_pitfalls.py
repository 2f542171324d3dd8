"""capslib.pitfalls: routing as coordinate ascent and the two pitfall switches (chapter 2)."""
import math

import pytest
import torch

import capslib
from capslib import pitfalls
from capslib.book import ch02


def _votes(seed=0, B=3, I=12, J=5, D=6, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(B, I, J, D, generator=g, dtype=torch.float64)


def test_defaults_equal_dynamic_routing():
    u = _votes()
    for r in (1, 2, 3, 5):
        v, c = pitfalls.routing(u, r)
        v_ref, c_ref = capslib.dynamic_routing(u, r)
        torch.testing.assert_close(v, v_ref)
        torch.testing.assert_close(c, c_ref)


def test_softmax_over_inputs_normalises_the_wrong_axis():
    u = _votes(1)
    _, c = pitfalls.routing(u, 3, softmax_over="inputs")
    torch.testing.assert_close(c.sum(dim=1), torch.ones(u.shape[0], u.shape[2], dtype=u.dtype))
    assert not torch.allclose(c.sum(dim=2), torch.ones(u.shape[:2], dtype=u.dtype))
    # one iteration: every coupling is 1/I, so s_j is the mean of the votes, J/I times the correct sum
    v_bad, c_bad = pitfalls.routing(u, 1, softmax_over="inputs")
    torch.testing.assert_close(c_bad, torch.full_like(c_bad, 1 / u.shape[1]))
    torch.testing.assert_close(v_bad, capslib.squash(u.mean(dim=1)))


def test_squash_without_epsilon_is_nan_at_zero_only():
    s = torch.tensor([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0]], dtype=torch.float64)
    out = pitfalls.squash_no_eps(s)
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1], capslib.squash(s)[1])
    torch.testing.assert_close(capslib.squash(s)[0], torch.zeros(3, dtype=torch.float64))


def test_zero_input_capsule_poisons_routing_and_gradients():
    u = _votes(2).requires_grad_(True)
    with torch.no_grad():
        u[0, :, 1] = 0.0  # parent 1 of example 0 receives only zero votes: s = 0 there
    v_ok, _ = pitfalls.routing(u, 3)
    v_bad, _ = pitfalls.routing(u, 3, squash_eps=False)
    assert torch.isfinite(v_ok).all()
    assert torch.isnan(v_bad[0]).all() and torch.isfinite(v_bad[1:]).all()  # NaN spreads to every parent of example 0
    v_ok.norm(dim=-1).sum().backward()
    assert torch.isfinite(u.grad).all()
    for loss in (v_bad.norm(dim=-1).sum(), v_bad[1:].norm(dim=-1).sum()):
        u.grad = None
        loss.backward(retain_graph=True)
        # example 0's votes get NaN gradients even when the loss leaves example 0 out (0 * inf in the
        # backward pass of the quotient); the other examples' gradients stay finite
        assert ch02.nonfinite_count(u.grad[0]) == u[0].numel()
        assert ch02.nonfinite_count(u.grad[1:]) == 0


def test_bad_arguments_raise_clear_errors():
    u = _votes()
    with pytest.raises(ValueError, match="softmax_over"):
        pitfalls.routing(u, 3, softmax_over="children")
    with pytest.raises(TypeError, match="squash_eps"):
        pitfalls.routing(u, 3, squash_eps="no")
    with pytest.raises(ValueError, match="detach"):
        pitfalls.routing(u, 3, detach=True)
    with pytest.raises(ValueError, match="iterations"):
        pitfalls.routing(u, 0)
    with pytest.raises(ValueError):
        pitfalls.routing(u[0], 3)
    with pytest.raises(ValueError, match="variant"):
        pitfalls.capsnet("softmax over children")
    with pytest.raises(ValueError, match="softmax_over"):
        pitfalls.routing_fn(softmax_over="j")
    with pytest.raises(ValueError, match="lengths"):
        pitfalls.length_penalty(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="vote_std"):
        ch02.noise_parent_length(10, 2, 4, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        c = torch.full(u.shape[:3], 1 / u.shape[2], dtype=u.dtype)
        pitfalls.objective(u, c, capslib.squash(u.mean(1)), temperature=-1.0)


def test_capsnet_variants_switch_routing_and_primary_squash():
    kw = dict(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,), iterations=2)
    x = torch.rand(2, 1, 28, 28)
    outs = {}
    for name in pitfalls.VARIANTS:
        torch.manual_seed(0)
        net = pitfalls.capsnet(name, **kw)
        outs[name] = net(x)
        assert isinstance(net.primary, capslib.layers.PrimaryCaps)
    torch.manual_seed(0)
    ref = capslib.models.CapsNet(**kw)(x)
    torch.testing.assert_close(outs["correct"].lengths, ref.lengths)
    torch.testing.assert_close(outs["squash without epsilon"].lengths, ref.lengths)  # no zero capsule here
    torch.testing.assert_close(outs["softmax over inputs"].couplings.sum(1), torch.ones(2, 10))
    # a dead primary capsule type (weights and bias zero): s = 0 there
    torch.manual_seed(0)
    bad = pitfalls.capsnet("squash without epsilon", **kw)
    with torch.no_grad():
        bad.primary.conv.weight[:4] = 0.0
        bad.primary.conv.bias[:4] = 0.0
    assert torch.isnan(bad(x).lengths).all()


def test_c_step_is_the_softmax_and_v_step_is_the_squash():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(20, 5, generator=g, dtype=torch.float64)
    for tau in (0.5, 1.0):
        c = torch.softmax(a / tau, dim=1)
        best = (c * a).sum(1) - tau * torch.special.xlogy(c, c).sum(1)
        torch.testing.assert_close(best, tau * torch.logsumexp(a / tau, dim=1))
        other = torch.distributions.Dirichlet(torch.ones(5, dtype=torch.float64)).sample((200, 20))
        val = (other * a).sum(-1) - tau * torch.special.xlogy(other, other).sum(-1)
        assert (val <= best + 1e-12).all()
    # R'(rho) = sqrt(rho / (1 - rho)), and rho n - R(rho) peaks at the squash's length n^2 / (1 + n^2)
    rho = torch.linspace(0.01, 0.98, 50, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(pitfalls.length_penalty(rho).sum(), rho)
    torch.testing.assert_close(grad, torch.sqrt(rho / (1 - rho)).detach())
    grid = torch.linspace(0, 1 - 1e-9, 200_001, dtype=torch.float64)
    for n in (0.1, 0.7, 1.0, 2.5):
        peak = grid[torch.argmax(grid * n - pitfalls.length_penalty(grid))]
        assert abs(float(peak) - n * n / (1 + n * n)) < 1e-4


def test_ascent_routing_never_lowers_the_objective():
    u = _votes(5, B=2, I=20, J=4, D=8, scale=0.6)
    cs, vs = pitfalls.ascent_routing(u, 8)
    values = []
    for t in range(len(cs)):
        values.append(pitfalls.objective(u, cs[t], vs[t]))
        if t + 1 < len(cs):
            values.append(pitfalls.objective(u, cs[t + 1], vs[t]))
    steps = torch.stack(values).diff(dim=0)
    assert (steps >= -1e-10).all()
    # the first two iterations coincide with Procedure 1
    cs1, vs1 = capslib.routing.routing_trace(u, 2)
    torch.testing.assert_close(cs[1], cs1[1])
    torch.testing.assert_close(vs[1], vs1[1])


def test_noise_parent_length_prediction():
    assert math.isclose(ch02.noise_parent_length(100, 10, 16, 0.5), 4.0 / 5.0)
    g = torch.Generator().manual_seed(0)
    u = 0.3 * torch.randn(400, 64, 8, 8, generator=g, dtype=torch.float64)
    v, _ = capslib.dynamic_routing(u, 1)
    assert abs(float(v.norm(dim=-1).mean()) - ch02.noise_parent_length(64, 8, 8, 0.3)) < 0.03
