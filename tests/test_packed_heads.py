"""MatMul / Gemm with a constant right-hand matrix run on the engine's packed GEMM tiles (the
classifier head of a sequence model): compared with onnxruntime on the same file, over column
counts on and off the 64-wide panel, Gemm's transB / alpha / beta / C, float32 and threads."""

from __future__ import annotations

import numpy as np
import pytest

from tolerances import ATOL_MATMUL, RTOL_MATMUL

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import leanrnn  # noqa: E402
from leanrnn import GraphModel  # noqa: E402
from leanrnn.formats.onnx_import import read_onnx  # noqa: E402

pytestmark = pytest.mark.onnx
C, H = 24, 40


def _model(op: str, M: int, rng, trans_b: int = 0, alpha: float = 1.0, beta: float = 1.0):
    """x [T, N, C] -> LSTM(H) -> Y [T, N, H] (squeezed) -> MatMul with B [H, M], or
    Reshape [T*N, H] -> Gemm(B, C bias)."""
    W = (rng.standard_normal((1, 4 * H, C)) * 0.3).astype(np.float32)
    R = (rng.standard_normal((1, 4 * H, H)) * 0.3).astype(np.float32)
    B = rng.standard_normal((M, H) if trans_b else (H, M)).astype(np.float32)
    bias = rng.standard_normal(M).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((W, "W"), (R, "R"), (B, "B"))]
    inits += [numpy_helper.from_array(np.array([1], np.int64), "ax"),
              numpy_helper.from_array(np.array([-1, H], np.int64), "shape"),
              numpy_helper.from_array(bias, "bias")]  # fmt: skip
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=H),
        helper.make_node("Squeeze", ["Y", "ax"], ["S"]),
    ]
    if op == "MatMul":
        nodes.append(helper.make_node("MatMul", ["S", "B"], ["out"]))
    elif op == "MatMul+Add":  # torch's Linear as exported: Add(bias, MatMul(x, B))
        nodes.append(helper.make_node("MatMul", ["S", "B"], ["P"]))
        nodes.append(helper.make_node("Add", ["bias", "P"], ["out"]))
    else:
        nodes.append(helper.make_node("Reshape", ["S", "shape"], ["S2"]))
        gemm = helper.make_node(
            "Gemm", ["S2", "B", "bias"], ["out"], transB=trans_b, alpha=alpha, beta=beta
        )
        nodes.append(gemm)
    g = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, C])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("M", [64, 70, 1, 200])
@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_head_matches_onnxruntime(op, M, threads):
    rng = np.random.default_rng(M)
    blob = _model(op, M, rng, trans_b=int(op == "Gemm" and M % 2 == 0), alpha=0.5, beta=2.0)
    x = rng.standard_normal((30, 50, C)).astype(np.float32)  # 1500 rows: big enough to thread
    expected = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    model = GraphModel(read_onnx(blob), threads=threads)
    assert next(n for n in model.graph.nodes if n.op == op).name in model._matmuls  # packed
    got = model(x)
    assert got.shape == expected[0].shape
    np.testing.assert_allclose(
        got, expected[0], rtol=RTOL_MATMUL[np.float32], atol=ATOL_MATMUL[np.float32]
    )
    again = model(x[:7])  # another shape re-plans, still right
    want = got.reshape(30, 50, M)[:7].reshape(again.shape)
    np.testing.assert_allclose(again, want, rtol=0, atol=ATOL_MATMUL[np.float32])


@pytest.mark.parametrize("M", [64, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_head_bias_is_fused_into_the_packed_product(M, threads):
    """Add(bias, MatMul(x, B)) runs as one packed product adding the bias in its tiles (no
    Add node, no [rows, M] product stored apart), and equals onnxruntime's."""
    rng = np.random.default_rng(M + 1)
    blob = _model("MatMul+Add", M, rng)
    x = rng.standard_normal((30, 50, C)).astype(np.float32)
    expected = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    model = GraphModel(read_onnx(blob), threads=threads)
    assert [n.op for n in model.graph.nodes if n.op in ("MatMul", "Add")] == ["MatMul"]
    assert next(n for n in model.graph.nodes if n.op == "MatMul").name in model._matmuls
    got = model(x)
    np.testing.assert_allclose(
        got, expected[0], rtol=RTOL_MATMUL[np.float32], atol=ATOL_MATMUL[np.float32]
    )


def test_heads_on_inputs_stay_on_numpy():
    """A right-hand side that is a graph input (not a constant) is not packed."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["out"])], "mm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [8, 5])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )  # fmt: skip
    blob = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    model = GraphModel(read_onnx(blob))
    assert model._matmuls == {}
    a, b = np.ones((3, 8), np.float32), np.arange(40, dtype=np.float32).reshape(8, 5)
    np.testing.assert_array_equal(model(a, b), a @ b)  # small integers: exact in float32
    assert leanrnn.get_num_threads() >= 1


def _launches(monkeypatch) -> list:
    """The product launches (matmul jobs) packed_product makes from now on."""
    from leanrnn.engine import products

    seen: list = []
    real = products.runner.run

    def run(job, args, parts):
        if job == "matmul":  # not the graph's LSTM
            seen.append(job)
        return real(job, args, parts)

    monkeypatch.setattr(products.runner, "run", run)
    return seen


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M", [70, 1000])
def test_a_padded_tail_takes_the_whole_product_in_one_launch(M, threads, monkeypatch):
    """packed_product with a tail [R, >= U*64] (few rows: engine.products.padded_tail_fits):
    on several threads one launch for every panel into it, then copied out; on one thread its
    first R*64 elements as the usual one-panel tail, two launches. Either way the bits of the
    one-panel tail's two launches, and numpy's product within float32 rounding."""
    from leanrnn.engine.products import (
        PANEL,
        PackedMatmul,
        packed_product,
        padded_tail_fits,
        padded_tail_width,
    )
    from leanrnn.kernels import abi
    from leanrnn.threads import PACKED_MATMUL_PARALLEL_MACS

    rng = np.random.default_rng(M)
    K, R = 512, 96
    assert R * K * M >= 2 * PACKED_MATMUL_PARALLEL_MACS  # so that threads share it
    a = rng.standard_normal((R, K)).astype(np.float32)
    B = rng.standard_normal((K, M)).astype(np.float32)
    bias = rng.standard_normal(M).astype(np.float32)
    pm = PackedMatmul.of(B, bias)
    U = pm.W.shape[0]
    assert padded_tail_fits(pm, R, 4)
    sync = np.zeros(abi.sync_size(threads), np.int64)
    before = leanrnn.get_num_threads()
    leanrnn.set_num_threads(threads)
    try:
        narrow, want = np.empty((R, PANEL), np.float32), np.empty((R, M), np.float32)
        packed_product(pm, a, want, narrow, threads, sync)
        wide = np.full((R, padded_tail_width(U)), np.nan, np.float32)
        got = np.full((R, M), np.nan, np.float32)
        launches = _launches(monkeypatch)
        packed_product(pm, a, got, wide, threads, sync)
    finally:
        leanrnn.set_num_threads(before)
    assert len(launches) == (1 if threads > 1 else 2)
    np.testing.assert_array_equal(got, want)
    ref = a.astype(np.float64) @ B + bias
    np.testing.assert_allclose(got, ref, rtol=RTOL_MATMUL[np.float32], atol=1e-3)


def test_a_head_of_few_rows_plans_a_padded_tail(monkeypatch):
    """The graph's packed MatMul plans the padded tail for few rows (a product threads share)
    and the one-panel one for many or for tiny products (engine.graph.ops._matmul_scratch),
    and runs right with each: one launch on the padded tail, two on the other — or, for
    more rows than a block of the one-panel tail holds (tail_rows), one for the whole panels
    and one per block of rows for the last."""
    from leanrnn.engine.products import PANEL, padded_tail_width, tail_rows

    rng = np.random.default_rng(3)
    blob = _model("MatMul", 70, rng)
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    model = GraphModel(read_onnx(blob), threads=2)
    launches = _launches(monkeypatch)
    block = tail_rows(10**6, 4)
    for T, N, shape, n in ((10, 50, (500, padded_tail_width(2)), 1),
                           (20, 50, (1000, PANEL), 2), (300, 50, (block, PANEL), 1 + -(-15000 // block)),
                           (2, 3, (6, PANEL), 2)):  # fmt: skip
        x = rng.standard_normal((T, N, C)).astype(np.float32)
        launches.clear()
        got = model(x)
        assert len(launches) == n, (T, N, launches)
        tails = {k: v for k, v in model.session._views.items() if k.endswith("#tail")}
        assert [v.shape for v in tails.values()] == [shape], tails.keys()
        want = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(
            got, want, rtol=RTOL_MATMUL[np.float32], atol=ATOL_MATMUL[np.float32]
        )
