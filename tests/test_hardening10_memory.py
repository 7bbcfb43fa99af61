"""Hardening, tenth pass: memory limits that held for one plan but not for what ran (a red
team's probe of the planning claims). Each test failed before its fix: an arena over the
limit with no error, or memory outside every plan."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import Session
from leanrnn.errors import PlanError
from leanrnn.train import Trainer

MiB = 1 << 20
rng = np.random.default_rng(0)


def _x(T: int, N: int, C: int) -> np.ndarray:
    return rng.standard_normal((T, N, C)).astype(np.float32)


# ------------------------------------------------------------ resize("auto") on whole stacks
def test_auto_batch_of_a_bidirectional_stack_keeps_within_the_limit():
    """tune checked the limit at <= 16 steps, and a bidirectional stack (which holds the whole
    sequence) was then planned for all 4000: a 393 MB arena under an 8 MiB limit."""
    s = leanrnn.GRU(64, 64, bidirectional=True, seed=0).session
    s.resize("auto", 4000, memory_limit=8 * MiB, measure=lambda b, c: 1e-6)
    assert s.arena_bytes <= 8 * MiB
    with pytest.raises(PlanError, match="memory_limit"):  # not even batch 1 holds 4000 steps
        s.resize("auto", 4000, memory_limit=MiB, measure=lambda b, c: 1e-6)


# ------------------------------------------------------------- the limit kept by later runs
def test_a_memory_limit_holds_for_later_runs_of_other_shapes():
    """resize(8, 2000, memory_limit=L) picked a chunk for that shape; a run keeping only final
    states (a buffer more) or of batch 16 then re-planned past L with no error."""
    m = leanrnn.LSTM(64, 64, seed=0)
    s, limit = m.session, MiB
    s.resize(8, 2000, memory_limit=limit)
    x8, x16 = _x(2000, 8, 64), _x(2000, 16, 64)
    ref = Session(m.weights)  # no limit: the oracle
    _, h, c = s.run(x8, return_sequences=False)
    assert s.plan.total <= limit and s.arena_bytes <= limit
    _, h_ref, c_ref = ref.run(x8, return_sequences=False)
    np.testing.assert_allclose(h, h_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(c, c_ref, rtol=0, atol=1e-6)
    y, h, _ = s.run(x16)
    assert s.plan.total <= limit and s.arena_bytes <= limit
    np.testing.assert_allclose(y, ref.run(x16)[0], rtol=0, atol=1e-6)
    with pytest.raises(PlanError, match="even one step"):  # a batch that cannot fit: refused
        s.run(_x(2, 4096, 64))
    s.resize(8, 2000)  # a resize without a limit lifts it
    s.run(_x(2, 4096, 64))


def test_a_limit_releases_a_larger_arena_held_from_before():
    """The arena never shrank: after a whole-sequence run left 123 MB, resize(memory_limit=1
    MiB) returned a plan within the limit and kept holding the 123 MB."""
    s = leanrnn.GRU(128, 128, seed=0).session
    s.chunk = 2000
    s.run(_x(2000, 16, 128))
    assert s.arena_bytes > 8 * MiB
    s.resize(16, 2000, memory_limit=MiB)
    assert s.arena_bytes <= MiB


def test_a_short_run_under_a_limit_leaves_the_chunk_of_the_long_ones():
    """A re-plan under a kept limit searched chunks only up to that run's steps: one streamed
    step set the chunk to 1, and every later long run went a step at a time. A chunk set
    after the limit was overwritten at the next run."""
    m = leanrnn.LSTM(64, 64, seed=0)
    s = m.session
    s.resize(8, 2000, memory_limit=MiB)
    chunk = s.chunk
    assert 1 < chunk < 2000
    st = s.stream(8)
    st.feed(np.ones((8, 64), np.float32))
    x = _x(2000, 8, 64)
    y = s.run(x)[0]
    assert s.chunk == chunk and s.plan.total <= MiB
    np.testing.assert_allclose(y, Session(m.weights).run(x)[0], rtol=0, atol=1e-6)
    s.chunk = 16  # under the limit: the largest chunk from now on
    s.run(x)
    assert s.chunk == 16 and s._T == 16


def test_a_refused_pool_plan_leaves_the_other_members_running():
    """A member's plan too large for the machine was recorded as its need before the arena
    failed: every member's next plan asked for it too and failed."""
    pool = leanrnn.Pool()
    w = leanrnn.LSTM(64, 64, seed=0).weights
    a, b = Session(w, pool=pool), Session(w, pool=pool)
    x = _x(100, 8, 64)
    want = b.run(x)[0]
    a.chunk = 10**6
    with pytest.raises(PlanError):
        a.resize(4096, 10**6)
    np.testing.assert_array_equal(b.run(x)[0], want)
    b.resize(8, 100)


def test_describe_leaves_the_session_and_its_limit_as_they_were():
    m = leanrnn.LSTM(64, 64, seed=0)
    m.session.resize(8, 2000, memory_limit=MiB)
    plan = m.session.plan
    m.describe(64, 5000)
    assert m.session.plan is plan and m.session._limit is not None


def test_limit_errors_name_a_need_that_then_fits():
    """The PlanError of a final-states-only resize named the need without that run's output
    buffer: a limit of the named bytes was refused again with the same message."""
    s = leanrnn.LSTM(64, 256, seed=0).session
    with pytest.raises(PlanError, match="even one step needs") as e:
        s.resize(64, 500, memory_limit=1000, return_sequences=False)
    need = int(str(e.value).split("needs ")[1].split()[0])
    s.resize(64, 500, memory_limit=need, return_sequences=False)
    assert s.plan.total <= need


# ---------------------------------------------------------------------------- pools
def test_a_pool_holds_one_arena_not_one_per_member():
    """When the pool's arena grew, each member kept its views of the one before alive until it
    next ran: four members held ~4x the pool's bytes."""
    pool = leanrnn.Pool()
    w = leanrnn.LSTM(64, 64, seed=0).weights
    members = [Session(w, chunk=100 * (i + 1), pool=pool) for i in range(4)]
    dead = []
    for i, s in enumerate(members):
        if pool.arena is not None:
            dead.append(weakref.ref(pool.arena))
        s.run(_x(100 * (i + 1), 8, 64))  # each plan larger: the arena is replaced
    gc.collect()
    assert dead and all(r() is None for r in dead), "an old arena is still held"
    ref = Session(w)
    for i, s in enumerate(members):  # and every member still runs right
        x = _x(50 * (i + 1), 8, 64)
        np.testing.assert_array_equal(s.run(x)[0], ref.run(x)[0])


def test_a_pool_shrinks_to_its_members_plans_under_a_limit():
    pool = leanrnn.Pool()
    w = leanrnn.GRU(64, 64, seed=0).weights
    a = Session(w, pool=pool)
    a.chunk = 3000
    a.run(_x(3000, 8, 64))
    big = pool.nbytes
    a.resize(8, 3000, memory_limit=MiB)  # the only member: the pool follows its plan
    assert pool.nbytes <= MiB < big


def test_streams_of_a_pooled_session_let_go_of_a_replaced_arena():
    pool = leanrnn.Pool()
    w = leanrnn.LSTM(32, 32, seed=0).weights
    a, b = Session(w, pool=pool), Session(w, pool=pool)
    st = a.stream(1)
    for _ in range(3):
        st.feed(np.ones((1, 32), np.float32))
    old = weakref.ref(pool.arena)
    b.run(_x(500, 16, 32))  # grows the pool: a's stream's bound step viewed the old arena
    gc.collect()
    assert old() is None
    ref = leanrnn.Model(a.weights).session.stream(1)
    for _ in range(3):
        ref.feed(np.ones((1, 32), np.float32))
    np.testing.assert_array_equal(st.feed(np.ones((1, 32), np.float32)),
                                  ref.feed(np.ones((1, 32), np.float32)))  # fmt: skip


# ---------------------------------------------------------------------------- training
def test_training_limit_counts_the_copy_of_a_non_contiguous_x():
    """A time-major view of batch-first data (not C-contiguous) is copied into the arena: that
    copy (T*N*C) was outside the segment search, 8.8x over a 2 MiB limit."""
    m = leanrnn.GRU(128, 64, seed=0)
    xb = rng.standard_normal((16, 2000, 128)).astype(np.float32)
    tr = Trainer(m, memory_limit=2 * MiB)
    with pytest.raises(PlanError, match="not C-contiguous"):
        tr.forward(xb.transpose(1, 0, 2))
    tr.memory_limit = 24 * MiB  # room for the copy: the arena stays within it
    tr.forward(xb.transpose(1, 0, 2))
    assert tr._arena.nbytes <= 24 * MiB
    assert Trainer(m, memory_limit=24 * MiB).plan(16, 2000, staged=True)["total_bytes"] <= 24 * MiB


def _dropout_trainer(seed=3, **kw):
    return Trainer(leanrnn.LSTM(32, 48, num_layers=3, seed=0), dropout=0.25, seed=seed, **kw)


def test_drawn_dropout_masks_are_planned_and_the_same_masks_as_before():
    """The masks were float arrays of T*N*D*K per layer (and a float64 array of uniforms)
    drawn outside the arena every step: outside every plan and memory limit. Drawn into the
    arena now, as bytes: the same masks from the same generator state, so the same outputs and
    gradients (the float masks of the old drawing, passed in, are the oracle)."""
    T, N = 200, 8
    x = _x(T, N, 32)
    dy = rng.standard_normal((T, N, 48)).astype(np.float32)
    tr = _dropout_trainer()
    gen = np.random.Generator(np.random.PCG64())
    gen.bit_generator.state = tr.rng.bit_generator.state
    old = [((gen.random((T * N, 48)) >= 0.25) / 0.75).astype(np.float32) for _ in range(2)]
    tape = tr.forward(x)
    tr.zero_grad()
    tr.backward(tape, dy)
    twin = _dropout_trainer()
    tape2 = twin.forward(x, masks=old)
    twin.zero_grad()
    twin.backward(tape2, dy)
    np.testing.assert_array_equal(tape.y, tape2.y)
    np.testing.assert_array_equal(tr.grad.buffer, twin.grad.buffer)
    # planned: a steady-state forward allocates what it returns, as one without dropout does,
    # and nothing the size of a mask (a float32 mask is 4x T*N*D*K, the old uniforms 8x)
    plain = Trainer(leanrnn.LSTM(32, 48, num_layers=3, seed=0))
    peaks = []
    for t in (plain, tr):
        t.forward(x)
        tracemalloc.start()
        try:
            t.forward(x)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] < peaks[0] + T * N * 48, peaks


def test_a_training_plan_holds_the_masks_it_draws_and_only_those():
    """Drawn masks are planned (a byte per value, to the end of the step); masks handed in
    (leanrnn.torch's, drawn by torch) are not, nor are they in eval mode."""
    T, N = 1000, 16
    tr = _dropout_trainer(memory_limit=64 * MiB)
    drawn = {pl.buffer.name: pl.buffer.nbytes for pl in tr.plan(N, T)["plan"].placements}
    assert drawn["mask.0"] == drawn["mask.1"] == T * N * 48 and "mask.2" not in drawn
    given = tr.plan(N, T, masks=True)["plan"].placements
    assert not any(pl.buffer.name.startswith(("mask.", "u")) for pl in given)
    tr.training = False
    assert not any(pl.buffer.name.startswith("mask.") for pl in tr.plan(N, T)["plan"].placements)


def test_a_training_limit_releases_a_larger_arena_held_from_before():
    m = leanrnn.LSTM(32, 64, seed=0)
    tr = Trainer(m)
    tr.forward(_x(2000, 16, 32))
    assert tr._arena.nbytes > 4 * MiB
    tr.memory_limit = 4 * MiB
    tr.forward(_x(2000, 16, 32))
    assert tr._arena.nbytes <= 4 * MiB


# ---------------------------------------------------------------- graphs with RNN nodes
def _onnx_lstm(path, C: int, H: int, direction: str):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    D = 2 if direction == "bidirectional" else 1
    r = np.random.default_rng(1)
    inits = [numpy_helper.from_array((r.standard_normal(s) * 0.2).astype(np.float32), n)
             for n, s in (("W", (D, 4 * H, C)), ("R", (D, 4 * H, H)), ("B", (D, 8 * H)))]  # fmt: skip
    outs = ["y"] if direction == "bidirectional" else ["", "h"]  # forward: final state only
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], outs, hidden_size=H,
                            direction=direction)  # fmt: skip
    g = helper.make_graph([node], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C])],
                          [helper.make_tensor_value_info(outs[-1], TensorProto.FLOAT, None)],
                          inits)  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return str(path)


def test_a_graph_memory_limit_holds_its_rnn_nodes_arena_too(tmp_path):
    """GraphModel.resize(memory_limit=) held only the graph's own arena: a bidirectional LSTM
    node's arena took the total to 2x the limit, with no error."""
    bi = leanrnn.load(_onnx_lstm(tmp_path / "bi.onnx", 32, 64, "bidirectional"))
    with pytest.raises(PlanError, match="whole sequence"):
        bi.resize({"x": (3000, 8, 32)}, memory_limit=20 * MiB)
    fw_path = _onnx_lstm(tmp_path / "fw.onnx", 32, 64, "forward")
    fw = leanrnn.load(fw_path)
    x = _x(3000, 8, 32)
    want = fw.run({"x": x})[0]  # no limit: the oracle
    limit = fw.session.arena_bytes + fw.session.rnn_arena_bytes // 2  # the RNN node must chunk
    fw.resize({"x": x.shape}, memory_limit=limit)
    s = fw.session
    assert s.arena_bytes + s.rnn_arena_bytes <= limit
    np.testing.assert_allclose(fw.run({"x": x})[0], want, rtol=0, atol=1e-6)
    assert s.arena_bytes + s.rnn_arena_bytes <= limit
    x2 = _x(5000, 8, 32)  # another shape: planned within the same limit
    np.testing.assert_allclose(fw.run({"x": x2})[0], leanrnn.load(fw_path).run({"x": x2})[0],
                               rtol=0, atol=1e-6)  # fmt: skip
    assert s.arena_bytes + s.rnn_arena_bytes <= limit


def test_a_graph_limit_lets_go_of_a_larger_graph_arena(tmp_path):
    """The graph kept any held arena at or under the limit while its RNN nodes took the rest
    of the limit: up to twice the limit together."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    # a graph arena of its own: Relu(x) and Sigmoid(x) live until their Concat, the output
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["x"], ["b"]),
             helper.make_node("Concat", ["a", "b"], ["y"], axis=1)]  # fmt: skip
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])  # fmt: skip
    mp = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    mp.ir_version = 8
    (tmp_path / "relu.onnx").write_bytes(mp.SerializeToString())
    gm = leanrnn.load(str(tmp_path / "relu.onnx"))
    gm.run({"x": np.ones((100_000, 8), np.float32)})
    big = gm.session.arena_bytes
    gm.resize({"x": (1000, 8)}, memory_limit=big // 10)
    assert gm.session.arena_bytes <= big // 10


def test_a_graph_limit_refuses_rnn_nodes_whose_weights_are_packed_per_run(tmp_path):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    H, C = 8, 4
    node = helper.make_node("LSTM", ["x", "W", "R"], ["", "h"], hidden_size=H)
    vi = helper.make_tensor_value_info
    g = helper.make_graph([node], "g",
                          [vi("x", TensorProto.FLOAT, [5, 1, C]), vi("W", TensorProto.FLOAT, [1, 4 * H, C]),
                           vi("R", TensorProto.FLOAT, [1, 4 * H, H])],
                          [vi("h", TensorProto.FLOAT, None)])  # fmt: skip
    mp = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    mp.ir_version = 8
    (tmp_path / "w_in.onnx").write_bytes(mp.SerializeToString())
    gm = leanrnn.load(str(tmp_path / "w_in.onnx"))
    with pytest.raises(PlanError, match="packed per run"):
        gm.resize({"x": (5, 1, C), "W": (1, 4 * H, C), "R": (1, 4 * H, H)}, memory_limit=64 * MiB)
