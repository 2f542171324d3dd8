"""The comparisons the hidden tests call in the grading process, through numpy (issue 35, item 1)."""
import numpy as np
import pytest
import torch

from capslib.tools.grading_fresh import allclose_numpy, assert_close_numpy, equal_numpy, grade

CASES = [
    (torch.ones(3), torch.ones(3), {}),
    (torch.ones(3), torch.ones(3) + 1e-6, {}),                       # inside float32's default tolerance
    (torch.ones(3), torch.ones(3) + 1e-3, {}),                       # outside it
    (torch.ones(3), torch.ones(3) + 1e-3, {"rtol": 1e-2, "atol": 0.0}),
    (torch.ones(3, dtype=torch.float64), torch.ones(3) , {}),        # dtypes differ
    (torch.ones(3, dtype=torch.float64), torch.ones(3), {"check_dtype": False}),
    (torch.ones(3), torch.ones(4), {}),                              # shapes differ
    (torch.ones(2, 3), torch.ones(3, 2), {}),
    (torch.tensor([float("nan")]), torch.tensor([float("nan")]), {}),
    (torch.tensor([float("nan")]), torch.tensor([float("nan")]), {"equal_nan": True}),
    (torch.tensor([float("inf")]), torch.tensor([float("inf")]), {}),
    (torch.tensor([1, 2]), torch.tensor([1, 3]), {}),                # integers compare exactly
    (torch.tensor([1, 2]), torch.tensor([1, 2]), {}),
    (torch.tensor([True, False]), torch.tensor([True, False]), {}),
    (torch.tensor([True, False]), torch.tensor([True, True]), {}),
    ((torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.zeros(1)), {}),
    ((torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.ones(1)), {}),
    ([torch.ones(2)], [torch.ones(2), torch.ones(2)], {}),
    ({"a": torch.ones(1)}, {"a": torch.ones(1)}, {}),
    ({"a": torch.ones(1)}, {"b": torch.ones(1)}, {}),
    (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16) * 1.01, {}),
    (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16) * 1.03, {}),
    (1.0, 1.0 + 1e-9, {}),
    (torch.ones(1), 1.0, {}),                                        # a tensor against a number
]


def _raises(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
    except (AssertionError, ValueError, TypeError):
        return True
    return False


@pytest.mark.parametrize("k", range(len(CASES)))
def test_assert_close_through_numpy_decides_as_torch_does(k):
    actual, expected, kwargs = CASES[k]
    assert _raises(assert_close_numpy, actual, expected, **kwargs) == _raises(torch.testing.assert_close, actual,
                                                                              expected, **kwargs)


def test_allclose_and_equal_through_numpy_decide_as_torch_does():
    pairs = [(torch.ones(3), torch.ones(3) + 1e-9), (torch.ones(3), torch.ones(3) + 1e-3),
             (torch.tensor([float("nan")]), torch.tensor([float("nan")])), (torch.ones(2, 1), torch.ones(2, 3))]
    for a, b in pairs:
        assert allclose_numpy(a, b) == torch.allclose(a, b)
        assert equal_numpy(a, b) == torch.equal(a, b)
    assert allclose_numpy(torch.ones(1), torch.ones(1) + 1e-3, atol=1e-2)
    assert not equal_numpy(torch.ones(1), torch.zeros(1))


def test_a_tensor_subclass_is_never_compared():
    class AlwaysEqual(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.equal, torch.allclose):
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    fake = torch.zeros(3).as_subclass(AlwaysEqual)
    assert torch.equal(fake, torch.ones(3))                              # what torch itself would say
    for fn in (assert_close_numpy, equal_numpy, allclose_numpy):
        with pytest.raises(AssertionError, match="subclass of torch.Tensor"):
            fn(fake, torch.ones(3))
    with pytest.raises(AssertionError, match="subclass of numpy.ndarray"):
        assert_close_numpy(np.ones(2).view(np.matrix), np.ones(2))
    with pytest.raises(ValueError, match="Both 'rtol' and 'atol'"):
        assert_close_numpy(torch.ones(1), torch.ones(1), rtol=1e-3)


def test_the_grading_process_compares_through_numpy():
    test = ("from otter.test_files import test_case\nimport torch\n"
            "@test_case(points=1)\ndef test_helpers(my_double):\n"
            "    assert torch.testing.assert_close.__name__ == 'assert_close_numpy'\n"
            "    assert torch.equal.__name__ == 'equal_numpy' and torch.allclose.__name__ == 'allclose_numpy'\n"
            "    torch.testing.assert_close(my_double(torch.ones(2)), torch.full((2,), 2.0))\n")
    cells = ["import torch\ndef my_double(x):\n"
             "    torch.testing.assert_close = lambda *a, **k: None\n    return x * 3\n"]
    out = grade(cells, {"q1": test}, ["capslib.rem.quantize"], "a secret")
    (case,) = out["q1"]["cases"]
    # the patch made inside the graded function is undone before the test compares: 3 is not 2
    assert not case["passed"] and "Not equal to tolerance" in case["message"], case
    honest = grade(["import torch\ndef my_double(x):\n    return x * 2\n"], {"q1": test}, ["capslib.rem.quantize"],
                   "a secret")
    assert honest["q1"]["cases"][0]["passed"], honest
