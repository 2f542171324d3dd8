"""Input checks shared by capslib: errors name the argument and the expected shape."""
from __future__ import annotations

from typing import Sequence

import torch


def check_tensor(
    name: str,
    value,
    dims: int | None = None,
    min_dim: int | None = None,
    floating: bool = False,
    shape_doc: str | None = None,
) -> None:
    """Raise a clear ``TypeError``/``ValueError`` when ``value`` is not the tensor we expect."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if dims is not None and value.dim() != dims:
        doc = shape_doc or f"a {dims}-D tensor"
        raise ValueError(f"{name} must be {doc}; got shape {tuple(value.shape)}")
    if min_dim is not None and value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s); got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {value.dtype}")


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")


def check_size(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: expected {what} = {expected}; got {actual}")


def shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
