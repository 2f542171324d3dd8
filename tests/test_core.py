"""Unit tests of capslib's core: squash, routing, losses, layers, CapsNet."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch.nn.utils.prune  # noqa: F401

import capslib
from capslib import layers, models

f64 = dict(dtype=torch.float64)


# ------------------------------------------------------------------ squash / unsquash

def test_squash_lengths_and_direction():
    s = torch.randn(50, 7, **f64) * torch.logspace(-3, 3, 50, **f64)[:, None]
    v = capslib.squash(s)
    n = s.norm(dim=-1)
    torch.testing.assert_close(v.norm(dim=-1), n**2 / (1 + n**2))
    cos = (v * s).sum(-1) / (v.norm(dim=-1) * n)
    torch.testing.assert_close(cos, torch.ones_like(cos))


def test_squash_zero_has_zero_value_and_finite_zero_grad():
    s = torch.zeros(3, 4, requires_grad=True)
    v = capslib.squash(s)
    v.sum().backward()
    assert torch.equal(v, torch.zeros_like(v))
    assert torch.isfinite(s.grad).all() and torch.equal(s.grad, torch.zeros_like(s.grad))


def test_squash_gradcheck():
    s = torch.randn(4, 3, 5, **f64, requires_grad=True)
    assert torch.autograd.gradcheck(capslib.squash, (s,))
    assert torch.autograd.gradcheck(lambda t: capslib.squash(t, dim=1), (s,))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.floats(1e-3, 1e3))
def test_unsquash_inverts_squash(shape, scale):
    s = torch.randn(*shape, **f64) * scale
    torch.testing.assert_close(capslib.unsquash(capslib.squash(s)), s, rtol=1e-7, atol=1e-9)


def test_unsquash_rejects_long_vectors():
    with pytest.raises(ValueError, match="length < 1"):
        capslib.unsquash(torch.tensor([[0.6, 0.9]]))


def test_squash_rejects_non_tensor():
    with pytest.raises(TypeError, match="s must be a torch.Tensor"):
        capslib.squash([1.0, 2.0])


# ------------------------------------------------------------------ margin loss

def test_margin_loss_hand_values():
    lengths = torch.tensor([[0.95, 0.05, 0.5], [0.2, 0.3, 0.0]])
    target = torch.tensor([0, 2])
    # sample 0: all within margins except class 2: 0.5*(0.5-0.1)^2 = 0.08
    # sample 1: target 2 length 0 -> 0.81; class 0: 0.5*0.1^2=0.005; class 1: 0.5*0.2^2 = 0.02
    expected = (0.08 + 0.81 + 0.005 + 0.02) / 2
    torch.testing.assert_close(capslib.margin_loss(lengths, target), torch.tensor(expected))


@pytest.mark.parametrize("lengths,target,err,msg", [
    (torch.rand(4), torch.zeros(4, dtype=torch.long), ValueError, "lengths must be"),
    (torch.rand(4, 3), torch.zeros(3, dtype=torch.long), ValueError, "target must be"),
    (torch.rand(4, 3), torch.zeros(4), TypeError, "integer class labels"),
    (torch.rand(4, 3), torch.full((4,), 3), ValueError, r"\[0, 3\)"),
])
def test_margin_loss_bad_input(lengths, target, err, msg):
    with pytest.raises(err, match=msg):
        capslib.margin_loss(lengths, target)


# ------------------------------------------------------------------ dynamic routing

def naive_routing(u_hat, iterations):
    """Procedure 1 with explicit loops (reference for tiny sizes)."""
    B, I, J, D = u_hat.shape
    b = torch.zeros(B, I, J, dtype=u_hat.dtype)
    for t in range(iterations):
        c = torch.softmax(b, dim=2)
        v = torch.stack([torch.stack([capslib.squash(sum(c[n, i, j] * u_hat[n, i, j] for i in range(I)))
                                      for j in range(J)]) for n in range(B)])
        if t < iterations - 1:
            for n in range(B):
                for i in range(I):
                    for j in range(J):
                        b[n, i, j] = b[n, i, j] + u_hat[n, i, j] @ v[n, j]
    return v, c


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_routing_matches_loops(iterations):
    u = torch.randn(2, 5, 3, 4, **f64)
    v, c = capslib.dynamic_routing(u, iterations)
    v0, c0 = naive_routing(u, iterations)
    torch.testing.assert_close(v, v0)
    torch.testing.assert_close(c, c0)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 5), st.integers(1, 4), st.integers(1, 4),
       st.booleans())
def test_routing_shapes_and_simplex(B, I, J, D, iterations, detach):
    u = torch.randn(B, I, J, D)
    v, c = capslib.dynamic_routing(u, iterations, detach=detach)
    assert v.shape == (B, J, D) and c.shape == (B, I, J)
    torch.testing.assert_close(c.sum(-1), torch.ones(B, I))
    assert (v.norm(dim=-1) < 1).all()


def test_routing_detach_same_forward():
    u = torch.randn(3, 6, 4, 5)
    v1, c1 = capslib.dynamic_routing(u, 3, detach=False)
    v2, c2 = capslib.dynamic_routing(u, 3, detach=True)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(c1, c2)


def test_routing_gradcheck():
    u = torch.randn(2, 4, 3, 3, **f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: capslib.dynamic_routing(t, 3)[0], (u,))


def test_routing_detach_gradcheck():
    """With detach=True the couplings are constants: the Jacobian of routing at u0 is the
    (gradchecked) Jacobian of u -> squash(sum_i c(u0)_ij u_ij) with c frozen at u0."""
    u0 = torch.randn(2, 4, 3, 3, **f64)
    _, c0 = capslib.dynamic_routing(u0, 3)
    frozen = lambda t: capslib.squash(torch.einsum("bij,bijd->bjd", c0, t))
    assert torch.autograd.gradcheck(frozen, (u0.clone().requires_grad_(True),))
    jac = torch.autograd.functional.jacobian(lambda t: capslib.dynamic_routing(t, 3, detach=True)[0], u0)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(frozen, u0))
    full = torch.autograd.functional.jacobian(lambda t: capslib.dynamic_routing(t, 3)[0], u0)
    assert (full - jac).abs().max() > 1e-6  # the coupling path is really cut


def test_routing_detach_gradient_is_coupling_times_squash_jacobian():
    """With detach the gradient through û is the first term of Gu & Tresp's Eq. 1 only."""
    u = torch.randn(1, 4, 3, 3, **f64, requires_grad=True)
    v, c = capslib.dynamic_routing(u, 3, detach=True)
    w = torch.randn_like(v)
    (v * w).sum().backward()
    s = torch.einsum("bij,bijd->bjd", c, u.detach()).requires_grad_(True)
    (capslib.squash(s) * w).sum().backward()
    torch.testing.assert_close(u.grad, c.unsqueeze(-1) * s.grad.unsqueeze(1))


@pytest.mark.parametrize("arg,err,msg", [
    (torch.randn(3, 5), ValueError, r"u_hat must be \(B, I, J, D\)"),
    (torch.randint(0, 3, (1, 2, 3, 4)), TypeError, "floating-point"),
])
def test_routing_bad_input(arg, err, msg):
    with pytest.raises(err, match=msg):
        capslib.dynamic_routing(arg)


def test_routing_bad_iterations():
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        capslib.dynamic_routing(torch.randn(1, 2, 3, 4), 0)


def test_routing_trace_ends_at_routing():
    u = torch.randn(2, 7, 4, 6)
    cs, vs = capslib.routing.routing_trace(u, 3)
    v, c = capslib.dynamic_routing(u, 3)
    assert len(cs) == 3
    torch.testing.assert_close(cs[-1], c)
    torch.testing.assert_close(vs[-1], v)
    torch.testing.assert_close(cs[0], torch.full_like(c, 1 / 4))


# ------------------------------------------------------------------ ops.bmm (the routing contractions)

def _reference(fn, *inputs, grad_out):
    """Output and input gradients of ``fn`` by autograd on fresh copies of ``inputs``."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    return (out, *torch.autograd.grad(out, xs, grad_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,M,K,P", [(640, 1, 288, 16), (640, 288, 16, 1), (3200, 36, 32, 1), (5, 3, 4, 2),
                                     (7, 1, 1, 1)])
def test_bmm_is_torch_bmm(N, M, K, P, dtype):
    # the outer products of the backward pass (a gradient of a factor with M = 1 or P = 1) are formed by
    # broadcasting: each entry one product, the same bits as torch.bmm's; a matrix times a column (P = 1)
    # goes as the column times the matrix, both transposed: dot products of the same length, equal to rounding
    g = torch.Generator().manual_seed(N + M + K + P)
    a, b = torch.randn(N, M, K, generator=g, dtype=dtype), torch.randn(N, K, P, generator=g, dtype=dtype)
    grad_out = torch.randn(N, M, P, generator=g, dtype=dtype)
    out, ga, gb = _reference(capslib.ops.bmm, a, b, grad_out=grad_out)
    ref_out, ref_ga, ref_gb = _reference(torch.bmm, a, b, grad_out=grad_out)
    assert out.dtype == ga.dtype == gb.dtype == ref_out.dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    column_out = P == 1 and M > 1           # the output: a matrix times a column
    column_gb = M > 1 and P == 1 and K > 1  # b's gradient, a^T g: a matrix times a column
    for mine, ref, exact in ((out, ref_out, not column_out), (ga, ref_ga, True), (gb, ref_gb, not column_gb)):
        if exact:
            assert torch.equal(mine, ref)
        else:
            torch.testing.assert_close(mine, ref, **tol)


def test_bmm_first_and_second_derivatives():
    a = torch.randn(3, 1, 4, **f64, requires_grad=True)
    b = torch.randn(3, 4, 2, **f64, requires_grad=True)
    assert torch.autograd.gradcheck(capslib.ops.bmm, (a, b))
    assert torch.autograd.gradgradcheck(capslib.ops.bmm, (a, b))
    c = torch.randn(3, 5, 4, **f64, requires_grad=True)
    d = torch.randn(3, 4, 1, **f64, requires_grad=True)
    assert torch.autograd.gradgradcheck(capslib.ops.bmm, (c, d))


def test_bmm_under_vmap_and_autocast():
    a, b = torch.randn(4, 6, 1, 5), torch.randn(4, 6, 5, 3)
    torch.testing.assert_close(torch.func.vmap(capslib.ops.bmm)(a, b), torch.stack([torch.bmm(x, y) for x, y in zip(a, b)]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert capslib.ops.bmm(a[0], b[0]).dtype == torch.bmm(a[0], b[0]).dtype == torch.bfloat16


@pytest.mark.parametrize("a,b,err,msg", [
    (torch.zeros(2, 3), torch.zeros(2, 3, 4), ValueError, "a must be"),
    (torch.zeros(2, 1, 3), torch.zeros(2, 4, 4), ValueError, "same N and K"),
    (torch.zeros(2, 1, 3), torch.zeros(3, 3, 4), ValueError, "same N and K"),
    (torch.zeros(2, 1, 3, dtype=torch.long), torch.zeros(2, 3, 4), TypeError, "floating"),
])
def test_bmm_bad_input(a, b, err, msg):
    with pytest.raises(err, match=msg):
        capslib.ops.bmm(a, b)



# ------------------------------------------------------------------ ops.Reads (one tensor read by a loop)

def _loop_of_reads(x, w0, z0, *, gathered):
    """Two weighted sums and two projections of ``x``, each factor made from earlier reads."""
    reads = capslib.ops.Reads(x) if gathered else None
    weigh = reads.weigh if gathered else (lambda w: torch.bmm(w, x))
    project = reads.project if gathered else (lambda z: torch.bmm(x, z))
    s = weigh(w0)                                                    # (N, 1, P)
    q = project(z0 + s.transpose(1, 2))                              # (N, K, 1)
    s2 = weigh(torch.softmax(q.transpose(1, 2), dim=-1))
    q2 = project(torch.tanh(s2).transpose(1, 2))
    return s2.square().sum() + (q2 * q).sum()


def test_reads_gradients_equal_torch_bmm_in_a_loop():
    g = torch.Generator().manual_seed(3)
    x, w0 = torch.randn(5, 7, 3, generator=g, **f64), torch.rand(5, 1, 7, generator=g, **f64)
    z0 = torch.randn(5, 3, 1, generator=g, **f64)
    grads = []
    for gathered in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w0, z0)]
        loss = _loop_of_reads(*leaves, gathered=gathered)
        grads.append((loss, *torch.autograd.grad(loss, leaves)))
    for mine, ref in zip(*grads):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: _loop_of_reads(*t, gathered=True),
                                    tuple(t.clone().requires_grad_() for t in (x, w0, z0)))


def test_reads_backward_twice_and_without_a_graph():
    x = torch.randn(4, 6, 2, **f64, requires_grad=True)
    w = torch.rand(4, 1, 6, **f64)
    reads = capslib.ops.Reads(x)
    out = reads.weigh(w).sum() + reads.project(torch.ones(4, 2, 1, **f64)).sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], first)    # the book starts empty each time
    torch.testing.assert_close(first, w.transpose(1, 2).expand(4, 6, 2) + 1.0)
    with torch.no_grad():                                                # no graph: plain products, x as given
        plain = capslib.ops.Reads(x)
        assert plain.x is x and torch.equal(plain.weigh(w), torch.bmm(w, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = capslib.ops.Reads(x.float())
        assert cast.x.dtype == cast.weigh(w.float()).dtype == torch.bfloat16


@pytest.mark.parametrize("call,factor,msg", [
    ("weigh", torch.zeros(4, 2, 6), "weigh needs a factor"),
    ("weigh", torch.zeros(3, 1, 6), "weigh needs a factor"),
    ("project", torch.zeros(4, 6, 1), "project needs a factor"),
])
def test_reads_bad_factor(call, factor, msg):
    reads = capslib.ops.Reads(torch.zeros(4, 6, 2))
    with pytest.raises(ValueError, match=msg):
        getattr(reads, call)(factor)
    with pytest.raises(ValueError, match="x must"):
        capslib.ops.Reads(torch.zeros(4, 6))


def _routing_by_einsum(u_hat, iterations, detach):
    """Procedure 1 written with einsum, as capslib wrote it before ops.bmm."""
    b = u_hat.new_zeros(u_hat.shape[:3])
    u = u_hat.detach() if detach else u_hat
    for _ in range(iterations - 1):
        c = torch.softmax(b, dim=2)
        v = capslib.squash(torch.einsum("bij,bijd->bjd", c, u))
        b = b + torch.einsum("bijd,bjd->bij", u, v)
    c = torch.softmax(b, dim=2)
    return capslib.squash(torch.einsum("bij,bijd->bjd", c, u_hat))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("shape", [(64, 288, 10, 16), (8, 30, 4, 8)])
def test_routing_is_the_einsum_routing(shape, detach, dtype):
    # the parent-major pass (softmax over dimension 1, the votes' gradient gathered from every read) computes
    # Procedure 1 as the einsum form does, outputs and gradients, to rounding
    g = torch.Generator().manual_seed(3)
    u = 0.1 * torch.randn(*shape, generator=g, dtype=dtype)
    grad_out = torch.randn(shape[0], shape[2], shape[3], generator=g, dtype=dtype)
    mine = _reference(lambda t: capslib.dynamic_routing(t, 3, detach=detach)[0], u, grad_out=grad_out)
    ref = _reference(lambda t: _routing_by_einsum(t, 3, detach), u, grad_out=grad_out)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(mine, ref):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
def test_full_and_detached_routing_compute_the_same_forward_values(iterations):
    # chapter 4 compares the two gradients of one forward computation: the bits must be the same
    g = torch.Generator().manual_seed(iterations)
    u = 0.2 * torch.randn(16, 72, 10, 8, generator=g).requires_grad_()
    v_full, c_full = capslib.dynamic_routing(u, iterations)
    v_det, c_det = capslib.dynamic_routing(u, iterations, detach=True)
    assert torch.equal(v_full, v_det) and torch.equal(c_full, c_det)
    assert c_full.shape == (16, 72, 10) and c_full.is_contiguous()
    cs, vs = capslib.routing.routing_trace(u.detach(), iterations)
    assert torch.equal(cs[-1], c_full) and torch.equal(vs[-1], v_full)


def test_setup_keeps_freed_memory_on_linux_glibc():
    import platform

    from capslib.book import session

    applies = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert session.keep_freed_memory() is applies


# ------------------------------------------------------------------ layers and CapsNet

def test_primary_caps_shapes_and_errors():
    pc = layers.PrimaryCaps(16, types=4, dim=8, kernel_size=9, stride=2)
    u = pc(torch.randn(2, 16, 20, 20))
    assert u.shape == (2, 4 * 6 * 6, 8)
    assert (u.norm(dim=-1) < 1).all()
    with pytest.raises(ValueError, match=r"x must be \(B, 16, H, W\)"):
        pc(torch.randn(2, 3, 20, 20))


def test_dense_caps_votes_and_errors():
    dc = layers.DenseCaps(5, 4, 3, 6, iterations=2)
    u = torch.randn(2, 5, 4)
    manual = torch.stack([torch.stack([dc.W[i, j] @ u[:, i].T for j in range(3)], 0) for i in range(5)], 0)
    torch.testing.assert_close(dc.votes(u), manual.permute(3, 0, 1, 2))
    v, c = dc(u)
    assert v.shape == (2, 3, 6) and c.shape == (2, 5, 3)
    with pytest.raises(ValueError, match=r"u must be \(B, 5, 4\)"):
        dc(torch.randn(2, 4, 4))


def test_capsnet_forward_paper_sizes():
    net = models.CapsNet()
    assert net.digit.in_caps == 32 * 6 * 6 == 1152
    n = models.count_parameters(net)
    # Sabour et al.: conv 20,992 + primary 5,308,672 + digit 1,474,560 + decoder 1,411,344 (8.2 M)
    assert n == 20992 + 5308672 + 1474560 + (160 * 512 + 512 + 512 * 1024 + 1024 + 1024 * 784 + 784)
    out = net(torch.rand(2, 1, 28, 28))
    assert out.lengths.shape == (2, 10) and out.reconstruction.shape == (2, 1, 28, 28)
    assert out.couplings.shape == (2, 1152, 10)


def test_capsnet_masks_decoder_with_label():
    net = models.CapsNet(conv_channels=8, primary_types=2, decoder=(16,))
    x = torch.rand(3, 1, 28, 28)
    y = torch.tensor([1, 2, 3])
    out = net(x, y)
    torch.testing.assert_close(out.reconstruction, net.decode(out.poses, y))
    loss = models.capsnet_loss(out, x, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"x must be \(B, 1, 28, 28\)"):
        net(torch.rand(3, 1, 32, 32))


def test_count_parameters_nonzero_with_prune():
    lin = torch.nn.Linear(10, 10)
    torch.nn.utils.prune.l1_unstructured(lin, "weight", amount=0.5)
    assert models.count_parameters(lin) == 110
    assert models.count_parameters(lin, nonzero=True) == 50 + int((lin.bias != 0).sum())


def test_dense_caps_routes_in_float32_under_autocast():
    dc = layers.DenseCaps(6, 4, 3, 5)
    u = torch.randn(2, 6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v, c = dc(u)
    assert v.dtype == torch.float32 and c.dtype == torch.float32
    v32, _ = dc(u)
    torch.testing.assert_close(v, v32, rtol=0.05, atol=0.01)


def test_dense_caps_votes_use_pruning_mask():
    import torch.nn.utils.prune as prune
    dc = layers.DenseCaps(6, 4, 3, 5)
    prune.l1_unstructured(dc, "W", amount=0.5)
    with torch.no_grad():
        dc.W_orig.add_(1.0)  # W is stale until a forward pass; votes must not be
    u = torch.randn(2, 6, 4)
    expected = torch.einsum("ijdk,bik->bijd", dc.W_orig * dc.W_mask, u)
    torch.testing.assert_close(dc.votes(u), expected)


def test_profiles_settings_imports_chapter_module():
    from capslib.book import profiles
    s = profiles.settings("02_dynamic_routing", "full")
    assert s.conv_channels == 256 and s.primary_types == 32 and s.batch_size == 128
    with pytest.raises(KeyError, match="no sizes"):
        profiles.settings("99_missing")
