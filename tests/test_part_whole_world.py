"""Chapter 4's small world (capslib.book.ch04.part_whole_world and its capsule layer)."""
import math

import pytest
import torch

from capslib.book import ch04


def test_world_parts_agree_only_through_the_true_wholes_rotations():
    u, y, frames = ch04.part_whole_world(50, parts=5, wholes=3, dim=4, noise=0.0, pose_scale=2.0, seed=0)
    assert u.shape == (50, 5, 4) and y.shape == (50,) and frames.shape == (3, 5, 4, 4)
    eye = torch.eye(4).expand(3, 5, 4, 4)
    torch.testing.assert_close(frames @ frames.transpose(-1, -2), eye, atol=1e-5, rtol=0)   # rotations
    # without noise, each whole's rotation maps every part back onto one pose for the true whole only
    back = torch.einsum("nipq,niq->nip", frames[y], u)
    torch.testing.assert_close(back, back[:, :1].expand_as(back), atol=1e-4, rtol=0)
    assert torch.allclose(back[:, 0].norm(dim=1), torch.full((50,), 2.0), atol=1e-4)
    wrong = torch.einsum("nipq,niq->nip", frames[(y + 1) % 3], u)
    assert (wrong - wrong[:, :1]).norm(dim=-1).mean() > 1.0
    # a test set of the same world reuses the frames; wrong shapes and sizes are refused
    _, _, same = ch04.part_whole_world(10, parts=5, wholes=3, dim=4, seed=1, frames=frames)
    assert same is frames
    with pytest.raises(ValueError, match="do not fit"):
        ch04.part_whole_world(10, parts=4, wholes=3, dim=4, frames=frames)
    with pytest.raises(ValueError, match="wholes >= 2"):
        ch04.part_whole_world(10, wholes=1)


def test_world_layer_trains_and_its_effect_is_measured():
    u, y, frames = ch04.part_whole_world(300, parts=6, wholes=3, dim=4, noise=0.3, pose_scale=4.0, seed=0)
    net = ch04.train_part_whole("detached", u, y, epochs=4, seed=0, lr=0.02)
    assert net.detach and net.iterations == 3 and net.votes(u).shape == (300, 6, 3, 4)
    e = ch04.part_whole_effect(net, u, y)
    assert e["accuracy_routed"] > 1 / 3 + 0.2          # well above chance on its own training data
    assert 0 < e["row_entropy_over_log_J"] <= 1 + 1e-6 and e["v_change_mean"] > 0
    assert ch04.train_part_whole("uniform", u, y, epochs=1, seed=0).iterations == 1
    share = ch04.part_whole_second_term(net, u[:50], y[:50])
    assert 0 <= share <= 1 and not math.isnan(share)
