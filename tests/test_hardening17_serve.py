"""Session 43, from the list earlier sessions noticed and left alone: JSON `true`/`false`
among an FP32 input's numbers was taken as 1.0/0.0 (numpy's asarray of [0.5, true]), where
Triton refuses a boolean in a numeric tensor."""

from __future__ import annotations

import numpy as np
import pytest

from leanrnn.serve.errors import InvalidRequest
from leanrnn.serve.protocol import ModelInfo, Tensor, from_list

INFO = ModelInfo("m", "FP32", np.dtype(np.float32), {"x": Tensor("x", (-1, 2))},
                 {"y": Tensor("y", (-1, 3))}, 1.0, 8, "lstm")  # fmt: skip


@pytest.mark.parametrize("data", [[0.5, True], [[0.5, 1.0], [False, 2.0]], [[1, 2], [3, True]],
                                  [[[0.5, 1.5]], [[2.5, True]]]])  # fmt: skip
def test_json_booleans_are_not_numbers(data):
    shape = np.asarray(data, dtype=np.float64).shape
    with pytest.raises(InvalidRequest, match="list of numbers"):
        from_list(INFO, "x", shape, data)


def test_json_numbers_still_parse():
    data = [[0.5, 1], [2, -3.25]]
    np.testing.assert_array_equal(from_list(INFO, "x", (2, 2), data),
                                  np.array(data, np.float32))  # fmt: skip
