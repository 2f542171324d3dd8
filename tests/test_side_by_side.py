"""capslib.tools.side_by_side on a CPU, with two stand-in peers shaped like the public implementations it
imports (their module names, constructors, outputs and ``.cuda()`` calls): every case timed, the ratios to the
peer computed, no target judged in a rehearsal, and the interpreter left as it was found."""
import json
import sys
import textwrap

import pytest
import torch

from capslib.tools import side_by_side as sbs

CAPSNET = '''
    import torch
    from torch import nn
    import torchvision  # noqa: F401  (the real peer imports it for its data loaders)


    class CapsuleNet(nn.Module):
        def __init__(self, input_size, classes, routings):
            super().__init__()
            self.input_size, self.lin = input_size, nn.Linear(784, classes * 4)
            self.dec = nn.Linear(classes * 4, 784)

        def forward(self, x, y=None):
            u = self.lin(x.flatten(1)).view(len(x), -1, 4) + torch.zeros(1).cuda()
            lengths = u.norm(dim=-1).sigmoid()
            rec = self.dec((u * y[:, :, None]).flatten(1)).sigmoid()
            return lengths, rec.view(-1, *self.input_size)


    def caps_loss(y_true, y_pred, x, x_recon, lam_recon):
        margin = (y_true * (0.9 - y_pred).clamp(min=0) ** 2).sum(1).mean()
        return margin + lam_recon * ((x_recon - x) ** 2).mean()
'''
EM = '''
    import torch
    from torch import nn


    class CapsNet(nn.Module):
        def __init__(self, A=32, B=32, C=32, D=32, E=10, K=3, P=4, iters=3):
            super().__init__()
            self.offset = torch.cuda.FloatTensor(1).fill_(0.0)
            self.lin = nn.Linear(784, E)

        def forward(self, x):
            return (self.lin(x.flatten(1)) + self.offset.to(x.device)).sigmoid()
'''


def _peers(tmp_path):
    (tmp_path / "CapsNet-Pytorch").mkdir()
    (tmp_path / "CapsNet-Pytorch" / "capsulenet.py").write_text(textwrap.dedent(CAPSNET))
    (tmp_path / "Matrix-Capsules-EM-PyTorch" / "model").mkdir(parents=True)
    (tmp_path / "Matrix-Capsules-EM-PyTorch" / "model" / "__init__.py").write_text("from .capsules import *\n")
    (tmp_path / "Matrix-Capsules-EM-PyTorch" / "model" / "capsules.py").write_text(textwrap.dedent(EM))
    return tmp_path


def test_a_rehearsal_times_every_case_against_its_peer_and_puts_the_interpreter_back(tmp_path):
    peers = _peers(tmp_path)
    cuda_before, path_before = torch.Tensor.cuda, list(sys.path)
    report = sbs.measure(peers, rounds=1, device=torch.device("cpu"))
    assert set(report["groups"]) == {"capsnet", "em"} and report["device"].startswith("cpu")
    for group, g in report["groups"].items():
        cases = g["cases"]
        assert set(cases) == {"peer", "eager", "fast"}
        assert all(c["images_per_s"] > 0 and c["lowest"] <= c["images_per_s"] <= c["highest"] for c in cases.values())
        assert cases["eager"]["times_peer"] == pytest.approx(cases["eager"]["images_per_s"] / cases["peer"]["images_per_s"])
        assert cases["fast"]["path"] == "graphed" and cases["eager"]["path"] == "eager"   # the stand-in graph on CPU
        assert g["target_times_peer"] == sbs.TARGETS[group] and g["target_met"] is None  # never judged off a GPU
        assert cases["peer"]["parameters"] > 0 and cases["eager"]["parameters"] == cases["fast"]["parameters"]
    assert torch.Tensor.cuda is cuda_before and sys.path == path_before
    assert "capsulenet" not in sys.modules and "model.capsules" not in sys.modules
    json.dumps(report)   # the report is plain JSON


def test_missing_peers_are_named_with_the_command_that_brings_them(tmp_path, capsys):
    (tmp_path / "CapsNet-Pytorch").mkdir()
    with pytest.raises(SystemExit):
        sbs.main(["--peers", str(tmp_path), "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert "Matrix-Capsules-EM-PyTorch" in err and "make peers" in err and "CapsNet-Pytorch," not in err
