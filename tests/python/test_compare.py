"""The harness checked from outside: every branch of its comparison
(python/cpsim/compare.py) gets a value wrong in the way only that branch can
see, at the place a careless comparison skips (the last element, one side's
NaN or inf), and must reject it; the same value right must pass. No ranks, no
build: the comparison alone."""
import math

import pytest
import torch

from cpsim.compare import RUNS, difference, rms


def _want_float():
    return torch.arange(1.0, 13.0, dtype=torch.float64).reshape(3, 4)


def test_a_bitwise_output_differing_in_its_last_element_only_is_rejected():
    want = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    got = want.clone()
    got[-1, -1] += 1
    why = difference("x", got, want, 0.0)
    assert "1 wrong elements, first at [2, 3]" in why, why
    assert difference("x", want.clone(), want, 0.0) == ""


def test_a_float_value_where_integers_are_expected_is_not_truncated_to_match():
    want = torch.tensor([[2, 5]], dtype=torch.int64)
    assert difference("targets", torch.tensor([[2.7, 5.0]]), want, 0.0), "2.7 passed as 2"
    assert difference("targets", torch.tensor([[2.0, 5.0]]), want, 0.0) == ""
    assert difference("targets", want.to(torch.int32), want, 0.0) == ""  # another integer width agrees


@pytest.mark.parametrize("side", ["got", "want"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_on_one_side_only_is_rejected_at_any_tolerance(side, value):
    want = _want_float()
    got = want.clone()
    (got if side == "got" else want)[-1, -1] = value
    for tolerance in (0.0, 1e-3, 1e300):
        why = difference("x", got, want, tolerance)
        assert "on one side only" in why and "[2, 3]" in why, (tolerance, why)


def test_the_same_non_finite_value_on_both_sides_agrees():
    want = _want_float()
    want[0, 0], want[1, 1] = math.nan, math.inf
    assert difference("x", want.clone(), want, 0.0) == ""
    assert difference("x", want.clone(), want, 1e-6) == ""
    got = want.clone()
    got[1, 1] = -math.inf  # inf against -inf differs
    assert difference("x", got, want, 1e-6)


def test_the_tolerance_branch_rejects_just_over_and_accepts_just_under():
    want = _want_float()
    noise = torch.zeros_like(want)
    noise[-1, -1] = 1.0
    scale = rms(want) * math.sqrt(want.numel())  # the RMSE of a single error e is e / sqrt(n)
    over = want + noise * scale * 1.01e-3
    under = want + noise * scale * 0.99e-3
    assert "relative RMSE" in difference("x", over, want, 1e-3)
    assert difference("x", under, want, 1e-3) == ""
    assert "[2, 3]" in difference("x", over, want, 1e-3)


def test_a_nan_tolerance_or_an_all_zero_expected_value_never_passes_a_difference():
    want = torch.zeros(4, dtype=torch.float64)
    got = want.clone()
    got[-1] = 1e-3
    assert difference("x", got, want, 1e-2), "a difference over an all-zero expected value passed"
    assert difference("x", got, want, 1e-2, floor=1.0) == ""  # unless a floor gives it a scale
    assert difference("x", _want_float() + 1, _want_float(), math.nan), "a NaN tolerance passed"


def test_the_summed_terms_scale_and_the_floor_are_what_the_error_is_held_to():
    want = torch.full((4,), 1e-3, dtype=torch.float64)
    got = want.clone()
    got[-1] += 1e-4
    terms = torch.full((4,), 1.0, dtype=torch.float64)  # a sum of large terms that cancel
    assert difference("x", got, want, 1e-3), "held to its own small scale it fails"
    assert difference("x", got, want, 1e-3, scale=terms) == ""
    assert "summed terms" in difference("x", got + 1.0, want, 1e-3, scale=terms)


def test_a_shape_or_a_dtype_that_differs_is_rejected():
    want = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert "shape [3, 2]" in difference("x", want.reshape(3, 2), want, 0.0)
    assert difference("x", torch.zeros(2, 3, dtype=torch.bool), want, 0.0)
    assert "dtype" in difference("x", torch.zeros(2, 3, dtype=torch.int64), want.double(), 0.0)
    assert "not a tensor" in difference("x", object(), want, 0.0)


def test_a_scalar_that_differs_names_both_values():
    # A 0-d tensor's first index is [] (it was reported "sharded None, unsharded None").
    why = difference("grad_norm", torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64),
                     1e-6, sides=RUNS)
    assert why.endswith("first differs at []: sharded 2.5, unsharded 1.0"), why
