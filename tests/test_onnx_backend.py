"""The official ONNX backend node tests for LSTM, GRU and RNN, run against leanrnn's backend.

Expected outputs come from ONNX's own test cases (computed by ONNX's reference code when the
cases are collected), not from leanrnn: nothing here is copied from the code under test.
"""

from __future__ import annotations

import re
import unittest
import warnings

import pytest

pytest.importorskip("onnx")
onnx_backend_test = pytest.importorskip("onnx.backend.test")

from leanrnn.onnx_backend import LeanRNNBackend  # noqa: E402

pytestmark = pytest.mark.onnx

# Every node test of the three recurrent operators ("test_simple_rnn_*" is RNN's naming).
PATTERN = r"^test_(lstm|gru|rnn|simple_rnn)_.*_cpu$"


def _rnn_node_tests() -> type[unittest.TestCase]:
    """Only the matching tests, as one TestCase (a module-level reference to the suite's own
    class would make pytest collect ~4000 more tests, all skipped)."""
    with warnings.catch_warnings():  # collecting ONNX's cases warns about unrelated ops
        warnings.simplefilter("ignore")
        suite = onnx_backend_test.BackendTest(LeanRNNBackend, __name__).include(PATTERN)
    node = suite.test_cases["OnnxBackendNodeModelTest"]
    tests = {n: getattr(node, n) for n in dir(node) if re.match(PATTERN, n)}
    return type("OnnxBackendRNNNodeTest", (unittest.TestCase,), tests)


OnnxBackendRNNNodeTest = _rnn_node_tests()


def test_the_suite_has_every_rnn_node_test():
    """Guard against an include pattern that silently matches nothing or misses an operator."""
    from onnx.backend.test.loader import load_model_tests

    ours = {
        t.name
        for t in load_model_tests(kind="node")
        if re.match(r"^test_(lstm|gru|rnn|simple_rnn)_", t.name)
    }
    assert {n.split("_")[1] for n in ours} >= {"lstm", "gru", "rnn", "simple"}
    run = {n for n in dir(OnnxBackendRNNNodeTest) if n.startswith("test_")}
    assert run == {f"{n}_cpu" for n in ours}
    assert len(run) >= 18


def test_backend_metadata():
    assert LeanRNNBackend.supports_device("CPU")
    assert not LeanRNNBackend.supports_device("CUDA")
