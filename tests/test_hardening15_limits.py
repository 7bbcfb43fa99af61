"""Session 41, from a red-team pass on memory limits, chunking and streaming (every accepted
limit gave the unlimited run's bits): a graph reading only an RNN's final state was held to
the limit by the Y it never computes; a narrow head's one-panel scratch was rows x 64 floats
(21x a 3-wide output, most of a tagger's arena); the Trainer's refusal named a "least memory"
figure above the least; a chunk a limit chose stayed after the limit was lifted and overrode
one the user set; a graph's limit just too small was reported as the RNN node's share."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import leanrnn  # noqa: E402
from leanrnn.engine.products import TAIL_BLOCK_BYTES  # noqa: E402
from leanrnn.errors import PlanError  # noqa: E402
from leanrnn.train import Trainer  # noqa: E402
from tolerances import atol  # noqa: E402

C, H = 4, 6
RNG = np.random.default_rng(41)
W = (RNG.standard_normal((1, 4 * H, C)) * 0.5).astype(np.float32)
R = (RNG.standard_normal((1, 4 * H, H)) * 0.5).astype(np.float32)


def _graph(tmp_path, head: int, final_state: bool) -> str:
    """x [T, N, C] -> LSTM -> (Y, squeezed: [T, N, H]) or (Y_h[0]: [N, H]) -> MatMul [H, head].
    A final-state graph names Y and reads nothing of it, as torch's exporter writes one."""
    rnn_out = ["y", "yh"] if final_state else ["y"]
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R"], rnn_out, hidden_size=H),
        helper.make_node("Squeeze", ["yh" if final_state else "y", "axes"], ["s"]),
        helper.make_node("MatMul", ["s", "B"], ["out"]),
    ]
    inits = {"W": W, "R": R, "axes": np.array([0 if final_state else 1], np.int64),
             "B": RNG.standard_normal((H, head)).astype(np.float32)}  # fmt: skip
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    path = tmp_path / f"m{head}{final_state}.onnx"
    onnx.save(m, str(path))
    return str(path)


def _ort(path, x):
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_final_state_graph_is_not_held_to_the_y_it_never_computes(tmp_path):
    path = _graph(tmp_path, 2, final_state=True)
    T, N = 3000, 3
    x = RNG.standard_normal((T, N, C)).astype(np.float32)
    g = leanrnn.load(path)
    total = g.describe(N, T)["arena"]["total_bytes"]
    assert total < T * N * H * 4  # (Y alone would be 216 KB)
    g.resize({"x": x.shape}, memory_limit=total)  # (refused: Y needs 216000 bytes)
    np.testing.assert_allclose(g.run({"x": x})[0], _ort(path, x), atol=atol(np.float32), rtol=0)


@pytest.mark.parametrize("head", [3, 64, 100])
@pytest.mark.parametrize("T, N", [(7, 2), (1500, 3), (3, 700)])
def test_a_head_s_last_panel_runs_in_row_blocks(tmp_path, head, T, N):
    path = _graph(tmp_path, head, final_state=False)
    x = RNG.standard_normal((T, N, C)).astype(np.float32)
    g = leanrnn.load(path)
    want = _ort(path, x)
    for threads in (1, 2):
        g.threads = threads
        np.testing.assert_allclose(g.run({"x": x})[0], want, atol=atol(np.float32), rtol=0)
    # the graph's arena: Y, and at most a block of the last panel's tail beside it (it was
    # T*N x 64 floats: 21x a 3-wide output)
    arena = g.describe(N, T)["arena"]["graph_arena_bytes"]
    assert arena <= T * N * H * 4 + TAIL_BLOCK_BYTES + 4096


def test_the_trainer_s_least_memory_figure_is_the_least():
    m = leanrnn.RNN(3, 5, num_layers=2, seed=0)
    N, T = 3, 600
    with pytest.raises(PlanError, match=r"needs (\d+) bytes") as e:
        Trainer(m, memory_limit=1000).plan(N, T)
    least = int(e.value.args[0].split(" needs ")[1].split()[0])
    Trainer(m, memory_limit=least).plan(N, T)  # the figure named is accepted ...
    with pytest.raises(PlanError):  # ... and is the least (it named one 1.9x above)
        Trainer(m, memory_limit=least - 1).plan(N, T)


def test_a_chunk_a_limit_chose_goes_with_the_limit():
    m = leanrnn.LSTM(16, 16, num_layers=2, seed=0)
    s = leanrnn.Session(m.weights)
    s.resize(8, 400, memory_limit=12000)
    assert s.chunk is not None and s.chunk < 20
    s.resize(8, 400)  # the limit lifted: auto chunk again (it kept 3 steps: 3.4x slower)
    assert s.chunk is None
    asked = leanrnn.Session(m.weights, chunk=50)
    asked.resize(8, 400, memory_limit=10**8)  # a generous limit keeps the chunk asked for
    assert asked.chunk == 50 and asked.plan.total < 10**6  # (it planned 400 steps: 10 MB)
    asked.resize(8, 400)
    assert asked.chunk == 50
    x = RNG.standard_normal((400, 8, 16)).astype(np.float32)
    np.testing.assert_array_equal(asked.run(x)[0], m(x)[0])


def test_a_graph_limit_too_small_for_its_rnn_names_the_callers_limit(tmp_path):
    path = _graph(tmp_path, 3, final_state=False)
    g = leanrnn.load(path)
    T, N = 200, 3
    need = g.describe(N, T)["arena"]["graph_arena_bytes"]
    with pytest.raises(PlanError, match=rf"memory_limit={need + 10} leaves RNN node 'LSTM") as e:
        g.resize({"x": (T, N, C)}, memory_limit=need + 10)
    assert "raise the limit" in str(e.value)


def test_planned_is_the_plan_resize_makes():
    """planned() (describe, a graph's RNN accounting) took neither the asked chunk as the
    limit's cap nor, without a limit, the asked chunk back: 1.0 MB planned where resize made
    0.13, and 11 KB where it made 0.13 MB."""
    m = leanrnn.LSTM(16, 16, num_layers=2, seed=0)
    s = leanrnn.Session(m.weights, chunk=50)
    for limit in (10**8, None, 12000, None):
        want = s.planned(8, 400, memory_limit=limit).total
        assert s.resize(8, 400, memory_limit=limit).total == want, limit
