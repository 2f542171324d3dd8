import os

import pytest
import torch

os.environ.setdefault("CAPSBOOK_PROFILE", "ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
