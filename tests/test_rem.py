"""Unit tests of chapter 6: capslib.rem (quantizer, parse-tree dictionaries, quantized routing,
saliency maps, the fully connected CapsNet), capslib.pruning (masks, LOBSTER, SNIP) and the
chapter's experiment and parse-tree graphs in capslib.book.ch06."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capslib
from capslib import models, pruning, rem
from capslib.book import ch06


# ------------------------------------------------------------------ quantize (Eq. 13)

def test_quantize_edges_and_midpoints():
    c = torch.tensor([0.0, 0.04, 0.06, 0.1, 0.5, 0.94, 0.96, 1.0])
    assert rem.quantize(c, 11).tolist() == [0, 0, 1, 1, 5, 9, 10, 10]
    assert rem.quantize(c, 2).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # 0.5 ties to even
    out = rem.quantize(c, 11)
    assert out.dtype == torch.long and out.shape == c.shape


def test_quantize_clamps_out_of_range():
    assert rem.quantize(torch.tensor([-0.3, 1.7]), 5).tolist() == [0, 4]


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 64), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_quantize_range_and_error(levels, shape):
    c = torch.rand(*shape, dtype=torch.float64)
    q = rem.quantize(c, levels)
    assert q.min() >= 0 and q.max() < levels
    err = (rem.dequantize(q, levels, torch.float64) - c).abs().max()
    assert err <= 0.5 / (levels - 1) + 1e-12


@pytest.mark.parametrize("bad,err,msg", [
    ([0.1], TypeError, "c must be a torch.Tensor"),
    (torch.tensor([1, 0]), TypeError, "floating-point"),
])
def test_quantize_bad_input(bad, err, msg):
    with pytest.raises(err, match=msg):
        rem.quantize(bad)


def test_quantize_bad_levels():
    with pytest.raises(ValueError, match="levels must be >= 2"):
        rem.quantize(torch.rand(3), levels=1)


# ------------------------------------------------------------------ entropy (Eq. 14-15) and keys

def test_identical_trees_have_zero_entropy():
    codes = torch.tensor([[1, 2, 3]] * 6)
    pred = torch.tensor([0, 0, 0, 1, 1, 1])
    per_class, mean = rem.parse_tree_entropy(codes, pred, 3)
    assert per_class.tolist() == [0.0, 0.0, 0.0] and float(mean) == 0.0
    assert rem.count_parse_trees(codes, pred, 3).tolist() == [1, 1, 0]


def test_two_equally_frequent_trees_give_one_bit():
    codes = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]])
    pred = torch.zeros(4, dtype=torch.long)
    per_class, mean = rem.parse_tree_entropy(codes, pred, 2)
    torch.testing.assert_close(per_class, torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(mean, torch.tensor(0.5, dtype=torch.float64))
    assert rem.count_parse_trees(codes, pred, 2).tolist() == [2, 0]


def test_same_key_in_two_classes_counts_separately():
    codes = torch.tensor([[3, 3], [3, 3], [4, 4], [3, 3]])
    pred = torch.tensor([0, 1, 1, 1])
    per_class, _ = rem.parse_tree_entropy(codes, pred, 2)
    p = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(per_class, torch.stack([torch.tensor(0.0, dtype=torch.float64),
                                                       -(p * p.log2()).sum()]))
    assert rem.count_parse_trees(codes, pred, 2).tolist() == [1, 2]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(2, 4), st.integers(1, 5))
def test_entropy_matches_counter_and_bounds(n, i, levels, classes):
    g = torch.Generator().manual_seed(n * 31 + i)
    codes = torch.randint(0, levels, (n, i), generator=g)
    pred = torch.randint(0, classes, (n,), generator=g)
    per_class, mean = rem.parse_tree_entropy(codes, pred, classes)
    keys = rem.count_parse_trees(codes, pred, classes)
    from collections import Counter
    for j in range(classes):
        rows = [tuple(r) for r, p in zip(codes.tolist(), pred.tolist()) if p == j]
        cnt = Counter(rows)
        h = -sum(c / len(rows) * math.log2(c / len(rows)) for c in cnt.values()) if rows else 0.0
        assert abs(per_class[j].item() - h) < 1e-9
        assert keys[j].item() == len(cnt)
        assert per_class[j] <= math.log2(max(keys[j].item(), 1)) + 1e-9   # H <= log2(#keys)
    assert abs(mean.item() - per_class.mean().item()) < 1e-12


def test_dictionary_strings_and_counts():
    codes = torch.tensor([[10, 0, 1], [10, 0, 1], [1, 1, 1]])
    pred = torch.tensor([2, 2, 2])
    d = rem.parse_tree_dictionary(codes, pred, 3)
    assert d[0] == {} and d[2] == {"a01": 2, "111": 1}


@pytest.mark.parametrize("codes,pred,msg", [
    (torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), r"codes must be \(N, I\)"),
    (torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), "integer quantization indices"),
    (torch.zeros(3, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long), "N = codes.shape"),
    (torch.zeros(3, 2, dtype=torch.long), torch.tensor([0, 1, 5]), r"\[0, 4\)"),
])
def test_entropy_bad_input(codes, pred, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        rem.parse_tree_entropy(codes, pred, 4)


# ------------------------------------------------------------------ quantized routing

def test_quantized_routing_uses_quantized_last_couplings():
    u_hat = torch.randn(3, 7, 4, 5, dtype=torch.float64)
    _, c = capslib.dynamic_routing(u_hat, 3)
    v_q, c_q = rem.QuantizedRouting(11)(u_hat, 3)
    torch.testing.assert_close(c_q, rem.quantize(c, 11).double() / 10)
    torch.testing.assert_close(v_q, capslib.squash(torch.einsum("bij,bijd->bjd", c_q, u_hat)))


def test_quantized_routing_as_routing_fn_and_level_sweep_agree():
    torch.manual_seed(0)
    net = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(), num_classes=3)
    x = torch.rand(6, 1, 28, 28)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    split = capslib.data.Split(x, y)
    sweep = rem.level_sweep(net, split, (5, 11))
    net.digit.routing_fn = rem.QuantizedRouting(11)
    with torch.no_grad():
        v, c_q = net.encode(x)
    pred = v.norm(dim=-1).argmax(1)
    assert torch.equal(pred, sweep[11]["predicted"])
    codes = rem.quantize(c_q, 11).gather(2, pred.view(-1, 1, 1).expand(-1, c_q.shape[1], 1)).squeeze(2)
    assert torch.equal(codes, sweep[11]["codes"])


# ------------------------------------------------------------------ pruning

def _net():
    torch.manual_seed(0)
    return models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(32,), num_classes=3)


def test_prunable_skips_decoder_and_masks_work():
    net = _net()
    params = pruning.prunable(net)
    names = {type(m).__name__ for m, _ in params}
    assert names == {"Conv2d", "DenseCaps"} and len(params) == 3
    pruning.apply_global_magnitude(params, 0.5)
    assert abs(pruning.sparsity(params) - 0.5) < 0.01
    assert all(hasattr(m, n + "_mask") for m, n in params)
    before = pruning.sparsity(params)
    pruning.apply_global_magnitude(params, 0.2)   # never revives pruned weights
    assert pruning.sparsity(params) == before
    assert models.count_parameters(net.digit, nonzero=True) < net.digit.W_orig.numel()


def test_level_sweep_sees_loaded_pruned_weights():
    net = _net()
    params = pruning.prunable(net)
    pruning.apply_global_magnitude(params, 0.6)
    with torch.no_grad():
        net.digit.W_orig.mul_(3.0)                 # changed after the last forward
    fresh = _net()
    pruning.attach_masks(pruning.prunable(fresh))
    fresh.load_state_dict({k: v.clone() for k, v in net.state_dict().items()})
    x = torch.rand(5, 1, 28, 28)
    _, u_hat, _ = rem.last_couplings(fresh, x)
    with torch.no_grad():
        u = net.primary(torch.relu(net.conv(x)))
    expected = torch.einsum("ijdk,bik->bijd", net.digit.W_orig * net.digit.W_mask, u)
    torch.testing.assert_close(u_hat, expected)


def test_lobster_step_shrinks_insensitive_weights_only():
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 1.0]]))
    lin.weight.grad = torch.tensor([[0.0, 2.0]])
    pruning.lobster_step([(lin, "weight")], lam=0.1)
    torch.testing.assert_close(lin.weight.detach(), torch.tensor([[0.9, 1.0]]))


def test_threshold_search_respects_validation_loss():
    net = _net()
    x, y = torch.rand(20, 1, 28, 28), torch.randint(0, 3, (20,))
    val = capslib.data.Split(x, y)
    params = pruning.prunable(net)
    base = pruning.margin_loss_on(net, val)
    s = pruning.threshold_search(net, params, val, tolerance=0.0, steps=5)
    assert 0.0 <= s < 1.0
    assert pruning.margin_loss_on(net, val) <= base + 1e-6


def test_snip_masks_keep_requested_fraction():
    net = _net()
    params = pruning.prunable(net)
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 3, (8,))
    masks = ch06.snip_masks(net, params, rem.margin_loss_fn, x, y, 0.7)
    kept = sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
    assert abs(kept - 0.3) < 0.01
    with pytest.raises(ValueError, match="fraction"):
        ch06.snip_masks(net, params, rem.margin_loss_fn, x, y, 1.0)


# ------------------------------------------------------------------ saliency (Eq. 16), FC CapsNet

def test_saliency_maps_shape_and_hand_formula():
    net = _net()
    x = torch.rand(2, 1, 28, 28)
    E, pred = rem.saliency_maps(net, x, 11)
    assert E.shape == (2, 28, 28) and pred.shape == (2,)
    u, u_hat, c = rem.last_couplings(net, x)
    cq = rem.quantize(c, 11).float() / 10
    grid = (u.norm(dim=-1) * cq[torch.arange(2), :, pred]).view(2, 2, 6, 6).mean(1)
    up = torch.nn.functional.interpolate(grid[:, None], size=(28, 28), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(E, up)


def test_fc_capsnet_shapes_parse_tree_and_lazy_export():
    assert models.FCCapsNet is rem.FCCapsNet
    torch.manual_seed(0)
    net = rem.FCCapsNet(conv_channels=4, primary_caps=5, hidden_caps=4, hidden_layers=2, caps_dim=3, num_classes=3)
    out = net(torch.rand(2, 1, 28, 28))
    assert out.lengths.shape == (2, 3)
    assert [c.shape for c in out.couplings] == [(2, 5, 4), (2, 4, 4), (2, 4, 3)]
    G = ch06.parse_tree_graph(out, 1)
    assert G.number_of_nodes() == 5 + 4 + 4 + 3
    in_tree = sum(d["in_tree"] for _, d in G.nodes(data=True))
    assert in_tree == int(rem.tree_size(out)[1])
    for a, b, d in G.edges(data=True):
        assert d["weight"] > 1.0 / net.sizes[b[0]]
    with pytest.raises(ValueError, match=r"x must be \(B, 1, 28, 28\)"):
        net(torch.rand(2, 1, 30, 30))


# ------------------------------------------------------------------ the chapter's experiment

def test_compare_methods_trains_four_networks_with_keyed_checkpoints_and_resumes(tmp_path, monkeypatch):
    import types

    from capslib import train

    monkeypatch.setattr(train, "DATA_DIR", tmp_path)
    capslib.book.setup(seed=0, quiet=True)
    S = types.SimpleNamespace(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, iterations=2,
                              epochs=2, pretrain_epochs=1, batch_size=16, lr=1e-3, lr_decay=None,
                              lobster_lambda=1e-2, lobster_decay=0.9, lobster_tolerance=0.5, search_steps=3,
                              imp_final_sparsity=0.5, snip_batch=16, levels_sweep=(5, 11))
    g = torch.Generator().manual_seed(0)

    def split(n):
        return capslib.data.Split(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))

    tr, val, test = split(32), split(16), split(16)
    run = ch06.compare_methods(3, S, tr, val, test, track=True, progress=False)
    assert run["seed"] == 3 and tuple(run["nets"]) == ch06.METHODS
    assert run["params"]["vanilla (+Q)"] is None
    h = run["history"]
    assert len(h["vanilla (+Q)"]["loss"]) == 2 and len(h["REM (LOBSTER)"]["loss"]) == 1 and len(h["SNIP"]["loss"]) == 2
    assert len(h["vanilla (+Q)"]["levels"]) == 2          # the tracker saw the shared start and the rest
    assert h["MP"]["sparsity"][-1] == pytest.approx(0.5, abs=0.01)
    assert pruning.sparsity(run["params"]["SNIP"]) == pytest.approx(pruning.sparsity(run["params"]["REM (LOBSTER)"]), abs=0.01)
    names = sorted(p.name for p in tmp_path.rglob("*.pt"))
    assert names == sorted(f"06_rem_{n}_s3.pt" for n in ("start", "vanilla", "rem", "imp", "snip"))
    again = ch06.compare_methods(3, S, tr, val, test, track=True, progress=False)   # every run loads its checkpoint
    for m in ch06.METHODS:
        for a, b in zip(run["nets"][m].state_dict().values(), again["nets"][m].state_dict().values()):
            torch.testing.assert_close(a, b)
    other = ch06.compare_methods(4, S, tr, val, test, progress=False)                # another seed: other weights
    assert not torch.equal(other["nets"]["vanilla (+Q)"].digit.W, run["nets"]["vanilla (+Q)"].digit.W)


# ------------------------------------------------------------------ LOBSTER's gate, the matched ablation, Miller-Madow

def test_lobster_sensitivity_forms():
    g = torch.tensor([[-0.004, 0.001], [0.002, 0.0]])
    torch.testing.assert_close(pruning.lobster_sensitivity(g, "raw"), g.abs())
    torch.testing.assert_close(pruning.lobster_sensitivity(g, None), g.abs())
    torch.testing.assert_close(pruning.lobster_sensitivity(g, "max"), torch.tensor([[1.0, 0.25], [0.5, 0.0]]))
    assert pruning.lobster_sensitivity(g, "none").abs().sum() == 0
    assert pruning.lobster_sensitivity(torch.zeros(3), "max").tolist() == [0.0, 0.0, 0.0]   # no division by zero
    with pytest.raises(ValueError, match="kind must be one of"):
        pruning.lobster_sensitivity(g, "quantile")


def _one_layer(weight, grad):
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    lin.weight.grad = grad.clone()
    return [(lin, "weight")]


def test_lobster_step_raw_is_weight_decay_for_small_gradients_and_max_gates():
    w = torch.tensor([[1.0, 2.0, -3.0, 4.0]])
    g = torch.tensor([[1e-3, 2e-3, 4e-3, 0.0]])               # gradients as small as on the ci CapsNet
    params = _one_layer(w, g)
    share = pruning.lobster_step(params, lam=0.1)                  # default: the formula as printed
    torch.testing.assert_close(params[0][0].weight.detach(), w - 0.1 * w * (1 - g.abs()))
    assert share == {"raw": 0.0, "applied": 0.0, "mean_gate": pytest.approx(1 - 7e-3 / 4)}  # no gate below 0.99
    params = _one_layer(w, g)
    share = pruning.lobster_step(params, lam=0.1, sensitivity="max")
    gate = torch.tensor([[0.75, 0.5, 0.0, 1.0]])                # 1 - |g| / max|g|
    torch.testing.assert_close(params[0][0].weight.detach(), w - 0.1 * w * gate)
    assert share["raw"] == 0.0 and share["applied"] == pytest.approx(0.75)
    assert share["mean_gate"] == pytest.approx((0.75 + 0.5 + 0.0 + 1.0) / 4)
    params = _one_layer(w, g)
    pruning.lobster_step(params, lam=0.1, sensitivity="none")
    torch.testing.assert_close(params[0][0].weight.detach(), 0.9 * w)


def test_lobster_step_counts_only_live_weights():
    w = torch.tensor([[1.0, 2.0, -3.0, 4.0]])
    params = _one_layer(w, torch.tensor([[1e-3, 2e-3, 4e-3, 0.0]]))
    pruning.set_mask(*params[0], torch.tensor([[1.0, 1.0, 0.0, 1.0]]))   # the weight with the largest gradient is pruned
    params[0][0].weight_orig.grad = torch.tensor([[1e-3, 2e-3, 4e-3, 0.0]])
    share = pruning.lobster_step(params, lam=0.1, sensitivity="max")
    assert share["applied"] == pytest.approx(2 / 3)                  # gates 0.75, 0.5 (live) and 1.0
    assert share["mean_gate"] == pytest.approx((0.75 + 0.5 + 1.0) / 3)


def test_matched_pruner_follows_the_targets_and_records_gates():
    torch.manual_seed(0)
    lin = torch.nn.Linear(20, 10, bias=False)
    params = [(lin, "weight")]
    pr = ch06.MatchedPruner(params, [0.3, 0.6], lam=0.05, decay=0.5, sensitivity="none")
    history = {}
    for epoch in range(3):
        lin.weight_orig.grad = torch.randn(10, 20) * 1e-3
        pr.before_step(lin, None)
        pr.on_epoch_end(epoch, lin, history)
    assert history["sparsity"] == pytest.approx([0.3, 0.6, 0.6])
    assert len(history["gate_active"]) == 3 and all(g["applied"] == 0.0 for g in history["gate_active"])
    assert pr.lam == pytest.approx(0.05 * 0.5 ** 3)
    none = ch06.MatchedPruner([(torch.nn.Linear(4, 4, bias=False), "weight")], [0.5], lam=0.0)
    before = none.params[0][0].weight_orig.detach().clone()
    none.params[0][0].weight_orig.grad = torch.ones(4, 4)
    none.before_step(None, None)                                       # lam = 0: no shrinkage, nothing recorded
    torch.testing.assert_close(none.params[0][0].weight_orig.detach(), before)
    assert none._gates == []


def test_miller_madow_adds_the_bias_correction_and_ceiling():
    codes = torch.tensor([[0, 1], [0, 1], [1, 1], [2, 0], [2, 0]])
    pred = torch.tensor([0, 0, 0, 1, 1])
    plug, _ = rem.parse_tree_entropy(codes, pred, 3)
    mm, mean = rem.miller_madow_entropy(codes, pred, 3)
    expected = plug + torch.tensor([(2 - 1) / (2 * 3 * math.log(2)), 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(mm, expected)
    torch.testing.assert_close(mean, expected.mean())
    torch.testing.assert_close(rem.entropy_ceiling(pred, 3),
                               torch.tensor([math.log2(3), 1.0, 0.0], dtype=torch.float64))
    assert (plug <= rem.entropy_ceiling(pred, 3) + 1e-12).all()


def test_tree_threshold_compares_quantized_couplings_with_the_quantized_uniform_level():
    # raw couplings: the paper's 1/|Omega|; quantized into K = 11 levels: the level 1/16 rounds to (0.1)
    assert rem.tree_threshold(16) == pytest.approx(1 / 16)
    assert rem.tree_threshold(16, levels=11) == pytest.approx(0.1)
    assert rem.tree_threshold(10, levels=11) == pytest.approx(0.1)
    assert rem.tree_threshold(4, levels=11) == pytest.approx(0.2)     # round(2.5) = 2 (ties to even)
    assert rem.tree_threshold(16, 0.3, levels=11) == 0.3
    with pytest.raises(ValueError, match="levels"):
        rem.tree_threshold(16, levels=1)
    # an undecided capsule quantized to 0.1 joins a tree by the raw threshold 1/16 but not by the quantized one
    c = torch.tensor([[[0.1] * 16]])                                   # (B=1, N_l=1, N_{l+1}=16), all at 0.1
    lengths = torch.zeros(1, 16)
    lengths[0, 3] = 1.0
    out = rem.FCOutput(lengths, [torch.zeros(1, 1, 2), torch.zeros(1, 16, 2)], [c])
    assert int(rem.tree_size(out)[0]) == 2
    assert int(rem.tree_size(out, levels=11)[0]) == 1
    G = ch06.parse_tree_graph(out, 0, levels=11)
    assert sum(d["in_tree"] for _, d in G.nodes(data=True)) == 1


def test_entropy_at_matched_accuracy_reads_each_path_where_both_are_equally_accurate():
    vanilla = [(0.80, 0.0), (0.90, 0.1), (0.94, 1.5), (0.95, 2.9)]     # (accuracy, entropy) after each epoch
    pruned = [(0.80, 0.0), (0.90, 0.1), (0.92, 0.7), (0.94, 1.3)]
    assert ch06.entropy_at_accuracy(vanilla, 0.92) == pytest.approx(0.1 + 0.5 * 1.4)
    assert ch06.entropy_at_accuracy(vanilla, 0.95) == pytest.approx(2.9)
    assert ch06.entropy_at_accuracy(vanilla, 0.99) is None and ch06.entropy_at_accuracy(vanilla, 0.5) is None
    # a path that dips: the latest bracketing epochs count
    assert ch06.entropy_at_accuracy([(0.9, 1.0), (0.8, 0.0), (0.95, 3.0)], 0.85) == pytest.approx(1.0)
    m = ch06.matched_accuracy(vanilla, pruned)
    assert m["accuracy"] == 0.94 and m["reference"] == pytest.approx(1.5) and m["other"] == pytest.approx(1.3)
    assert m["difference"] == pytest.approx(-0.2)
    # the same epoch would say -1.6: the pruned network is simply less trained
    assert pruned[-1][1] - vanilla[-1][1] == pytest.approx(-1.6)
    assert ch06.matched_accuracy([(0.9, 1.0)], [(0.95, 2.0), (0.97, 2.5)])["difference"] is None
    with pytest.raises(ValueError, match="non-empty"):
        ch06.matched_accuracy([], vanilla)


def test_a_profile_where_no_path_reaches_a_common_accuracy_reads_as_such_and_does_not_stop_the_page():
    # at `full` a pruned network can end below the unpruned one's first epoch: no matched reading
    summary, words = ch06.matched_reading({0: None, 1: None, 2: None})
    assert summary is None and "none of the 3 seeds" in words
    summary, words = ch06.matched_reading({0: -0.2, 1: None, 2: 0.1})
    assert summary.n == 2 and summary.seeds == (0, 2) and summary.mean == pytest.approx(-0.05)
    assert "over the 2 of 3 seeds" in words and "below zero in 1 of them" in words
    assert f"{summary.half:.2f}" in words
    summary, words = ch06.matched_reading({0: None, 4: -0.3})
    assert summary.n == 1 and "seed 4 alone" in words and "no interval" in words and "below zero" in words
    summary, words = ch06.matched_reading({0: -0.2, 1: -0.1})
    assert "over the 2 seeds" in words and " of 2 seeds" not in words


def test_class_weights_are_the_weights_as_they_act_and_weight_blocks_counts_them():
    from types import SimpleNamespace
    from capslib import pruning
    S = SimpleNamespace(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, iterations=2)
    net = ch06.make_capsnet(S, 0)
    W = net.digit.W
    mask = torch.ones_like(W)
    mask[0] = 0                                          # every block of input capsule 0
    mask[1, 0] = 0                                       # one block of input capsule 1
    pruning.set_mask(net.digit, "W", mask)
    got = ch06.class_weights(net)
    assert not got.requires_grad and torch.equal(got, net.digit.W_orig.detach() * mask)
    blocks = ch06.weight_blocks(net)
    I, J = W.shape[:2]
    assert blocks["silenced_capsules"] == 1 and blocks["zero_blocks"] == pytest.approx((J + 1) / (I * J))


def test_part_whole_network_is_a_capsnet_for_rem_and_pruning():
    """Chapter 4's part-whole network, which chapter 6 prunes: same seed, same weights, and the global
    random state untouched; its couplings and quantized sweep come from the same routed layer that
    pruning masks (a weight pruned there changes the votes)."""
    from capslib.book.ch04 import PartWholeCaps
    from capslib.datasets import Split

    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    a, b = PartWholeCaps(5, 3, 4, seed=7), PartWholeCaps(5, 3, 4, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.digit.W, b.digit.W) and not torch.equal(a.digit.W, PartWholeCaps(5, 3, 4, seed=8).digit.W)
    u = torch.randn(6, 5, 4)
    v, c = a(u)
    assert v.shape == (6, 3, 4) and c.shape == (6, 5, 3)
    assert torch.allclose(v.norm(dim=-1), rem.predict_lengths(a, u))
    assert torch.allclose(a(u, 1)[1], torch.full((6, 5, 3), 1 / 3))     # one iteration: uniform couplings
    _, u_hat, c = rem.last_couplings(a, u)
    assert u_hat.shape == (6, 5, 3, 4) and torch.allclose(c.sum(-1), torch.ones(6, 5))
    params = pruning.prunable(a)
    assert params == [(a.digit, "W")]
    mask = torch.ones_like(a.digit.W)
    mask[0, 1] = 0
    pruning.set_mask(a.digit, "W", mask)
    assert torch.count_nonzero(rem.last_couplings(a, u)[1][:, 0, 1]) == 0
    sweep = rem.level_sweep(a, Split(u, torch.zeros(6, dtype=torch.long)), levels=(5,))
    assert sweep[5]["codes"].shape == (6, 5)


def test_world_compare_branches_from_one_start_at_matched_sparsity():
    from types import SimpleNamespace

    from capslib.book import ch06

    S = SimpleNamespace(**ch06.WORLD)
    S.world_train, S.world_val, S.world_test, S.world_epochs, S.world_pretrain_epochs = 256, 128, 128, 3, 1
    S.lobster_decay = 0.99
    splits = ch06.world_splits(S)
    assert [len(splits[k]) for k in ("train", "val", "test")] == [256, 128, 128]
    out = ch06.world_compare(0, S, splits)
    assert set(out) == set(ch06.WORLD_METHODS)
    assert out["vanilla"]["sparsity"] == 0.0
    rem_sp = out[ch06.WORLD_METHODS[1]]["sparsity"]
    for m in ch06.WORLD_METHODS[2:]:
        assert abs(out[m]["sparsity"] - rem_sp) < 0.01, (m, out[m]["sparsity"], rem_sp)
    for m, r in out.items():
        assert 0.0 <= r["row_entropy"] <= 1.0 and set(S.world_levels) <= set(r)
        ceiling = math.log2(max(torch.bincount(splits["test"].y).tolist()))
        assert all(0.0 <= r[K]["entropy"] <= ceiling + 1e-9 for K in S.world_levels), (m, r)
    assert out == ch06.world_compare(0, S, splits)          # the seed fixes everything


def test_bootstrap_entropy_is_the_plug_in_entropy_of_each_resample():
    g = torch.Generator().manual_seed(5)
    N, I, J = 60, 7, 4
    codes = torch.randint(0, 3, (N, I), generator=g)
    codes[:20] = codes[0]                                    # one frequent key, the rest mostly rare
    pred = torch.randint(0, J, (N,), generator=g)
    pred[:3] = 3
    index = torch.randint(0, N, (25, N), generator=g)
    boot = rem.bootstrap_entropy(codes, pred, J, index)
    assert boot.shape == (25,) and boot.dtype == torch.float64
    want = torch.stack([rem.parse_tree_entropy(codes[ix], pred[ix], J)[1] for ix in index])
    torch.testing.assert_close(boot, want)
    # the identity resample is the estimate itself; one key everywhere is 0 bits in every resample
    torch.testing.assert_close(rem.bootstrap_entropy(codes, pred, J, torch.arange(N)[None]),
                               rem.parse_tree_entropy(codes, pred, J)[1].reshape(1))
    same = rem.bootstrap_entropy(torch.zeros(N, I, dtype=torch.long), pred, J, index)
    assert float(same.abs().max()) == 0.0
    with pytest.raises(ValueError, match="index"):
        rem.bootstrap_entropy(codes, pred, J, torch.arange(N))
    with pytest.raises(ValueError, match="row numbers"):
        rem.bootstrap_entropy(codes, pred, J, torch.full((2, N), N))
