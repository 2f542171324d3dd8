"""MultiMNIST (capslib.multimnist): the generator's promises, the two-label loss and the top-2 accuracy."""
import pytest
import torch

from capslib import data, models, multimnist


@pytest.fixture(scope="module")
def source():
    return data.embedded_mnist()["train"].subset(300)


def test_generated_pairs_have_two_classes_shifted_within_range_and_overlaid_with_a_max(source):
    s = multimnist.generate(source, 200, seed=3)
    assert s.x.shape == (200, 3, 36, 36) and s.y.shape == (200,)
    ab = multimnist.labels(s.y)
    assert bool((ab[:, 0] != ab[:, 1]).all())                       # different classes, always
    torch.testing.assert_close(s.x[:, 0], torch.maximum(s.x[:, 1], s.x[:, 2]))
    # every digit keeps its ink (a shift of at most 4 px never pushes it off the 36 px canvas)
    ink = s.x[:, 1:].sum(dim=(2, 3))
    assert float(ink.min()) > 10
    # each digit alone is one of the source's digits, moved by at most 4 px: its ink's bounding box lies in the
    # canvas and its mass equals a source digit's mass
    masses = source.x.sum(dim=(1, 2, 3))
    for k in range(2):
        m = s.x[:, 1 + k].sum(dim=(1, 2))
        assert bool((masses[None, :] - m[:, None]).abs().min(dim=1).values.lt(1e-3).all())
    # shifts are spread over the whole range: the centre of mass of the first digit moves by up to 4 px
    rows = torch.arange(36.0)
    com = (s.x[:, 1].sum(dim=2) * rows).sum(1) / s.x[:, 1].sum(dim=(1, 2))
    assert float(com.max() - com.min()) > 6
    # seeded
    torch.testing.assert_close(multimnist.generate(source, 200, seed=3).x, s.x)
    assert not torch.equal(multimnist.generate(source, 200, seed=4).x, s.x)


def test_generate_rejects_bad_arguments(source):
    with pytest.raises(ValueError, match="size"):
        multimnist.generate(source, 5, size=30)
    with pytest.raises(ValueError, match="shift"):
        multimnist.generate(source, 5, shift=-1)
    with pytest.raises(ValueError, match="n"):
        multimnist.generate(source, 0)
    one_class = data.Split(source.x[:4], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="two classes"):
        multimnist.generate(one_class, 5)


def test_margin_loss_with_two_present_classes_matches_the_single_label_loss_and_counts_both():
    torch.manual_seed(0)
    lengths = torch.rand(6, 10)
    y = torch.randint(0, 10, (6,))
    # with the same label twice it is the ordinary margin loss
    torch.testing.assert_close(models.margin_loss(lengths, torch.stack([y, y], 1)), models.margin_loss(lengths, y))
    perfect = torch.full((1, 10), 0.05)
    perfect[0, [2, 7]] = 0.95
    assert float(models.margin_loss(perfect, torch.tensor([[2, 7]]))) == 0.0
    assert float(models.margin_loss(perfect, torch.tensor([[2, 3]]))) > 0.0


def test_top2_accuracy_and_the_training_scores_count_both_labels():
    lengths = torch.tensor([[0.9, 0.8, 0.1] + [0.0] * 7, [0.9, 0.1, 0.8] + [0.0] * 7])
    y = torch.tensor([10 * 1 + 0, 10 * 0 + 1])            # image 1 right in either order, image 2 wrong
    pred = multimnist.top2_pairs(lengths)
    assert pred.tolist() == [1, 2]
    assert multimnist.both_right(lengths, y).tolist() == [True, False]
    assert multimnist.both_right(lengths, torch.tensor([10 * 0 + 1, 10 * 2 + 0])).tolist() == [True, True]
    torch.manual_seed(0)
    net = models.CapsNet(image_size=36, conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,))
    s = multimnist.generate(data.embedded_mnist()["train"].subset(100), 8, seed=0)
    loss, scores = multimnist.loss(net, s.x, s.y)
    assert loss.requires_grad and scores.shape == (8, 100)
    right = multimnist.top2_pairs(net.encode(s.x[:, :1])[0].norm(dim=-1)) == multimnist.top2_pairs(
        torch.nn.functional.one_hot(multimnist.labels(s.y), 10).sum(1).float())
    assert (scores.argmax(1) == s.y).tolist() == right.tolist()
    assert multimnist.accuracy(net, s) == pytest.approx(float(right.float().mean()))
    with pytest.raises(ValueError, match="MultiMNIST batch"):
        multimnist.overlay(s.x[:, :1])


def test_pair_shift_moves_each_digit_on_its_own_and_rebuilds_the_overlay():
    source = data.load("embedded")["train"]
    centred = multimnist.generate(source, 64, seed=0, shift=0)
    moved = multimnist.PairShift(multimnist.SHIFT, seed=5)(centred.x)
    assert moved.shape == centred.x.shape
    assert torch.equal(moved[:, 0], torch.maximum(moved[:, 1], moved[:, 2]))
    # the canvas leaves room for the largest shift: no ink is lost
    torch.testing.assert_close(moved[:, 1:].sum(dim=(2, 3)), centred.x[:, 1:].sum(dim=(2, 3)))
    # each digit gets its own offsets: the two digits' centres of mass do not move together
    grid = torch.arange(multimnist.SIZE, dtype=moved.dtype)

    def centre(img):
        return (img.sum(dim=-1) * grid).sum(-1) / img.sum(dim=(-2, -1))
    d_first = centre(moved[:, 1]) - centre(centred.x[:, 1])
    d_second = centre(moved[:, 2]) - centre(centred.x[:, 2])
    assert not torch.allclose(d_first, d_second) and float(d_first.abs().max()) <= multimnist.SHIFT + 1e-4
    # seeded: a new instance with the same seed repeats; the next batch of one instance is drawn anew
    assert torch.equal(multimnist.PairShift(multimnist.SHIFT, seed=5)(centred.x), moved)
    shifter = multimnist.PairShift(multimnist.SHIFT, seed=5)
    assert not torch.equal(shifter(centred.x), shifter(centred.x))
    assert torch.equal(multimnist.PairShift(0)(centred.x), centred.x)
    with pytest.raises(ValueError, match="shift"):
        multimnist.PairShift(-1)
    with pytest.raises(ValueError, match="MultiMNIST batch"):
        multimnist.PairShift(2)(source.x[:4])


class _Decoder(torch.nn.Module):
    """A stand-in network for one batch of ``pairs``: its decoder draws, for each class, that class's own
    digit (``pick="own"``) or the other digit of the pair (``pick="other"``)."""

    def __init__(self, pairs, pick):
        super().__init__()
        self.first = multimnist.labels(pairs.y)[:, 0]
        self.digits, self.pick = pairs.x[:, 1:3], pick

    def encode(self, x):
        return torch.zeros(len(x), 10, 2), None

    def decode(self, v, label):
        first = (label == self.first) == (self.pick == "own")
        return torch.where(first[:, None, None], self.digits[:, 0], self.digits[:, 1])[:, None]


def test_segmentation_counts_reconstructions_nearer_their_own_digit():
    source = data.load("embedded")["test"]
    pairs = multimnist.generate(source, 40, seed=1)
    scores = {}
    for pick in ("own", "other"):
        scores[pick] = multimnist.segmentation(_Decoder(pairs, pick), pairs, batch_size=len(pairs))
    assert scores == {"own": 1.0, "other": 0.0}


def test_reconstruction_error_is_zero_for_exact_drawings_and_one_for_empty_ones():
    from capslib.book import ch02
    source = data.load("embedded")["test"]
    pairs = multimnist.generate(source, 40, seed=1)
    exact = _Decoder(pairs, "own")
    assert ch02.reconstruction_error(exact, pairs, batch_size=len(pairs)) == 0.0

    class Empty(_Decoder):
        def decode(self, v, label):
            return torch.zeros_like(super().decode(v, label))

    assert ch02.reconstruction_error(Empty(pairs, "own"), pairs, batch_size=len(pairs)) == pytest.approx(1.0)
    # the other digit drawn instead: the error is the two digits' squared difference over the own digit's energy
    own, other, energy = multimnist.reconstruction_distances(_Decoder(pairs, "other"), pairs, batch_size=len(pairs))
    a, b = pairs.x[:, 1].flatten(1), pairs.x[:, 2].flatten(1)
    assert torch.allclose(own, torch.cat([((b - a) ** 2).sum(1), ((a - b) ** 2).sum(1)]))
    assert torch.equal(other, torch.zeros_like(other))
    assert torch.allclose(energy, torch.cat([(a ** 2).sum(1), (b ** 2).sum(1)]))
    blank = multimnist.generate(source, 4, seed=2)
    blank.x[:, 2] = 0
    with pytest.raises(ValueError, match="no ink"):
        ch02.reconstruction_error(_Decoder(blank, "own"), blank, batch_size=len(blank))


def test_half_scale_digits_keep_their_ink_and_fit_the_half_scale_canvas(source):
    """Chapter 2's ci MultiMNIST: digits averaged down by 2 (each pixel the mean of a 2x2 block), pairs of them on
    an 18x18 canvas with shifts of up to 2 px, the paper's geometry at half scale."""
    from capslib.book import ch02
    half = ch02.downsample(source, 2)
    assert half.x.shape == (len(source), 1, 14, 14) and torch.equal(half.y, source.y)
    # every 2x2 block's mean: the total ink is a quarter of the original's, and one pixel checks the block
    torch.testing.assert_close(half.x.sum(dim=(1, 2, 3)), source.x.sum(dim=(1, 2, 3)) / 4)
    torch.testing.assert_close(half.x[:, 0, 5, 6], source.x[:, 0, 10:12, 12:14].mean(dim=(1, 2)))
    assert ch02.downsample(source, 1) is source
    s = multimnist.generate(half, 50, seed=1, shift=2, size=18)
    assert s.x.shape == (50, 3, 18, 18)
    # no ink is lost off the canvas: each placed digit holds the ink of one downsampled digit
    masses = half.x.sum(dim=(1, 2, 3))
    for k in range(2):
        m = s.x[:, 1 + k].sum(dim=(1, 2))
        assert bool((masses[None, :] - m[:, None]).abs().min(dim=1).values.lt(1e-4).all())
    for bad in (0, 3, 1.5, True):
        with pytest.raises(ValueError, match="factor"):
            ch02.downsample(source, bad)
