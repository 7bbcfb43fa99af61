"""The official ONNX backend node tests for LSTM, GRU and RNN, run against leanrnn's backend.

Expected outputs come from ONNX's own test cases (computed by its reference code when the cases
are collected), not from leanrnn: nothing here is copied from the code under test.
"""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")
onnx_backend_test = pytest.importorskip("onnx.backend.test")

from leanrnn.onnx_backend import LeanRNNBackend  # noqa: E402

pytestmark = pytest.mark.onnx

# Every node test of the three recurrent operators ("test_simple_rnn_*" is RNN's naming).
PATTERN = r"^test_(lstm|gru|rnn|simple_rnn)_.*_cpu$"

_backend_test = onnx_backend_test.BackendTest(LeanRNNBackend, __name__)
_backend_test.include(PATTERN)
globals().update(_backend_test.test_cases)


def test_the_suite_has_every_rnn_node_test():
    """Guard against an include pattern that silently matches nothing (or misses an operator)."""
    import re

    from onnx.backend.test.loader import load_model_tests

    names = {t.name for t in load_model_tests(kind="node")}
    ours = {n for n in names if re.match(r"^test_(lstm|gru|rnn|simple_rnn)_", n)}
    assert {n.split("_")[1] for n in ours} >= {"lstm", "gru", "rnn", "simple"}
    node_case = _backend_test.test_cases["OnnxBackendNodeModelTest"]
    run = {n for n in dir(node_case) if re.match(PATTERN, n)}
    assert run == {f"{n}_cpu" for n in ours}
    assert len(run) >= 18
