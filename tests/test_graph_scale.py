"""Loading and planning a graph does work roughly linear in its size.

Checked without timing: the number of Python and C function calls (``sys.setprofile`` events)
made while importing, loading and planning a chain of n ops must grow about 4x when n does;
anything quadratic (a per-node scan of an ever-growing family or of every placed buffer) grows
it 10-16x at these sizes. The rewritten best-fit planner must place exactly as the plain
O(n^2) one does.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from leanrnn import GraphModel
from leanrnn.formats.onnx_import import read_onnx
from leanrnn.memory.arena import ALIGN, round_up
from leanrnn.memory.planner import Buffer, plan

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

pytestmark = pytest.mark.onnx

SMALL, LARGE = 500, 2000  # 4x the nodes
MAX_GROWTH = 6.0  # linear or n log n gives ~4-4.5x; the quadratic passes gave 10x and more


def _calls(fn) -> int:
    """Function calls (Python and C) made by ``fn()``."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return count


def _chain(op: str, n: int, **attrs) -> bytes:
    nodes = [helper.make_node(op, [f"t{i}"], [f"t{i + 1}"], **attrs) for i in range(n)]
    g = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize(
    "op, attrs",
    [
        ("Relu", {}),  # one in-place family the length of the chain
        ("Transpose", {"perm": [1, 0]}),  # n buffers of short lifetimes for the planner
    ],
    ids=["inplace-chain", "buffer-chain"],
)
def test_load_and_plan_work_grows_linearly(op, attrs):
    def work(n):
        data = _chain(op, n, **attrs)
        return _calls(lambda: GraphModel(read_onnx(data)).resize([(4, 8)]))

    small, large = work(SMALL), work(LARGE)
    assert large / small < MAX_GROWTH, (small, large)


def test_long_inplace_chain_still_runs_in_place():
    """The faster in-place analysis makes the same choice: a Relu chain is one buffer."""
    model = GraphModel(read_onnx(_chain("Relu", 300)))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(model(x), np.maximum(x, 0))
    model.resize([(8, 8)])
    assert model.session.plan.placements == ()  # the only family holds the output: fresh


def test_planner_work_grows_linearly():
    def bufs(n):  # each live for 3 steps, sizes varied so best fit has gaps to choose from
        return [Buffer(f"b{k}", 64 * (1 + k * 7 % 5), k, k + 2) for k in range(n)]

    small = _calls(lambda: plan(bufs(SMALL * 2)))
    large = _calls(lambda: plan(bufs(LARGE * 2)))
    assert large / small < MAX_GROWTH, (small, large)


def _naive_plan(buffers: list[Buffer], align: int = ALIGN) -> dict[str, int]:
    """Best fit by scanning every placed buffer: the O(n^2) statement of the placement rule."""
    placed: list[tuple[Buffer, int]] = []
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.first, b.name)):
        size = round_up(b.nbytes, align)
        busy = sorted(
            (off, off + round_up(p.nbytes, align))
            for p, off in placed
            if p.first <= b.last and b.first <= p.last
        )
        best, best_gap, cursor = None, None, 0
        for start, end in busy:
            if start - cursor >= size and (best_gap is None or start - cursor < best_gap):
                best, best_gap = cursor, start - cursor
            cursor = max(cursor, end)
        placed.append((b, cursor if best is None else best))
    return {b.name: off for b, off in placed}


@pytest.mark.parametrize("seed", range(20))
def test_planner_places_exactly_as_the_naive_best_fit(seed):
    rng = np.random.default_rng(seed)
    n, steps = int(rng.integers(1, 80)), int(rng.integers(1, 40))
    buffers = []
    for k in range(n):
        first = int(rng.integers(0, steps))
        last = first + int(rng.integers(0, 1 + steps // int(rng.integers(1, 5))))
        nbytes = int(rng.choice([0, 1, 63, 64, 100, 4096])) * int(rng.integers(1, 4))
        buffers.append(Buffer(f"b{k}", nbytes, first, last))
    p = plan(buffers)
    got = {pl.buffer.name: pl.offset for pl in p.placements}
    assert got == _naive_plan(buffers)
    assert p.total == max((got[b.name] + round_up(b.nbytes, ALIGN) for b in buffers), default=0)
