"""Session 38: graph ops' checks at planning, each as onnxruntime reads the op. Each test failed
before."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _onnx_graphs import load, model, node, run_ort  # noqa: E402
from leanrnn.errors import LeanRNNError  # noqa: E402

pytestmark = pytest.mark.onnx


def test_einsum_output_term_with_a_label_twice_is_refused_at_planning(tmp_path):
    """A diagonal *made* ("ij->ii"): planned, then numpy's ValueError at run (onnxruntime
    refuses the model). An ellipsis that no input has stays valid, as in both of them."""
    feeds = {"a": np.arange(9, dtype=np.float32).reshape(3, 3)}
    m = model([node("Einsum", ["a"], equation="ij->ii")], feeds, opset=12,
              out_dtypes=[np.float32])  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own error types)
        run_ort(m, feeds)
    with pytest.raises(LeanRNNError, match="the output term names a label twice"):
        load(m, tmp_path).run(feeds)
    m = model([node("Einsum", ["a"], equation="ij->...ij")], feeds, opset=12)
    np.testing.assert_array_equal(load(m, tmp_path).run(feeds)[0], run_ort(m, feeds)[0])
