"""The validation helpers every setting and request field goes through: what each accepts,
and that each refusal names the field in its own wording (tests elsewhere match on it)."""

import math

import numpy as np
import pytest

from spaceserve.checks import (
    check_bool,
    check_int,
    require_choice,
    require_int,
    require_ints,
    require_number,
)


def test_int_settings_and_request_fields_read_their_own_way() -> None:
    assert require_int("max_held", 3) == 3 and require_int("ranks", np.int64(2)) == 2
    assert require_int("cache", 0, 0) == 0 and require_int("x", None, optional=True) is None
    for bad in (0, True, 1.0, "2", None):
        with pytest.raises(ValueError, match=r"^max_held=.* must be an int >= 1$"):
            require_int("max_held", bad)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=1 must be an int >= 2$"):
        require_int("tensor_parallel_size", 1, 2)
    with pytest.raises(ValueError, match=r"^seed must be an int, got bool$"):
        check_int("seed", True, 0)
    assert require_ints("lens", (4, 8)) == (4, 8)
    with pytest.raises(ValueError, match=r"^lens=\(4, 0\) must be a non-empty tuple"):
        require_ints("lens", (4, 0))


def test_bools_numbers_and_choices() -> None:
    assert check_bool("ignore_eos", False) is False
    with pytest.raises(ValueError, match=r"^ignore_eos must be a bool, got int$"):
        check_bool("ignore_eos", 1)
    assert require_number("window_s", math.inf) == math.inf
    assert require_number("launch_budget_s", 0, zero_ok=True) == 0.0
    assert require_number("deadline_s", None, optional=True) is None
    for bad in (0, -1.0, True, None, "1"):
        with pytest.raises(ValueError, match=r"^deadline_s=.* must be a number > 0$"):
            require_number("deadline_s", bad)
    with pytest.raises(ValueError, match=r"^decode_weight=-0.5 must be a number >= 0$"):
        require_number("decode_weight", -0.5, zero_ok=True)
    assert require_choice("policy", "fifo", ("twsrft", "fifo")) == "fifo"
    with pytest.raises(ValueError, match=r"^policy='lifo' is not one of twsrft, fifo$"):
        require_choice("policy", "lifo", ("twsrft", "fifo"))
