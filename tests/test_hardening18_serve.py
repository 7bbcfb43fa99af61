"""Session 44, from the list earlier sessions noticed and left alone: a request of 0 steps was
refused ("input 'x' has 0 steps"), so a client had no way to end a stream without a step to
send (its slot held until the idle timeout, against --max-streams), nor to restore a snapshot
(h0/c0 at sequence_start) and read it back before its first step."""

from __future__ import annotations

import time

import numpy as np
import pytest

ATOL = 2e-5


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    import leanrnn
    from helpers import served

    pytest.importorskip("tritonclient.http")
    pytest.importorskip("tritonclient.grpc")
    d = tmp_path_factory.mktemp("zero")
    with served(d, "m", leanrnn.LSTM(3, 5, num_layers=2, seed=4), "--max-streams", "1") as s:
        yield s


def _client(server, protocol):
    import tritonclient.grpc as tg
    import tritonclient.http as th

    mod = th if protocol == "http" else tg
    return mod, mod.InferenceServerClient(server[protocol])


def _infer(mod, c, feeds: dict, outputs=("y", "h_n", "c_n"), **kw):
    ins = []
    for name, v in feeds.items():
        i = mod.InferInput(name, list(v.shape), "FP32")
        i.set_data_from_numpy(v)
        ins.append(i)
    outs = [mod.InferRequestedOutput(n) for n in outputs]
    return c.infer("m", ins, outputs=outs, **kw)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_zero_step_end_frees_the_slot_and_answers_the_state(one_slot, protocol):
    mod, c = _client(one_slot, protocol)
    model = one_slot["model"]
    x = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    sid = 4100 + (protocol == "grpc")
    ys = [_infer(mod, c, {"x": x[:4]}, sequence_id=sid, sequence_start=True).as_numpy("y")]
    ys.append(_infer(mod, c, {"x": x[4:]}, sequence_id=sid).as_numpy("y"))
    end = _infer(mod, c, {"x": x[:0]}, sequence_id=sid, sequence_end=True)
    y_ref, (h_ref, c_ref) = model(x[:, None])
    np.testing.assert_allclose(np.concatenate(ys), y_ref[:, 0], rtol=0, atol=ATOL)
    assert end.as_numpy("y").shape == (0, 5)
    np.testing.assert_allclose(end.as_numpy("h_n"), h_ref[:, 0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(end.as_numpy("c_n"), c_ref[:, 0], rtol=0, atol=ATOL)
    # the one slot (--max-streams 1) is free at once: a new sequence starts without a 429
    other = _infer(mod, c, {"x": x[:1]}, sequence_id=sid + 10, sequence_start=True,
                   sequence_end=True)  # fmt: skip
    np.testing.assert_allclose(other.as_numpy("y"), y_ref[:1, 0], rtol=0, atol=ATOL)
    # and the ended id is not live
    with pytest.raises(Exception, match="not live"):
        _infer(mod, c, {"x": x[:1]}, sequence_id=sid)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_zero_step_start_restores_a_snapshot_to_read_and_continue(one_slot, protocol):
    mod, c = _client(one_slot, protocol)
    model = one_slot["model"]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    h0 = rng.standard_normal((2, 5)).astype(np.float32)
    c0 = rng.standard_normal((2, 5)).astype(np.float32)
    sid = f"snap-{protocol}"
    back = _infer(mod, c, {"x": x[:0], "h0": h0, "c0": c0}, sequence_id=sid, sequence_start=True)
    np.testing.assert_array_equal(back.as_numpy("h_n"), h0)
    np.testing.assert_array_equal(back.as_numpy("c_n"), c0)
    r = _infer(mod, c, {"x": x}, sequence_id=sid, sequence_end=True)
    y_ref, (h_ref, _) = model(x[:, None], (h0[:, None], c0[:, None]))
    np.testing.assert_allclose(r.as_numpy("y"), y_ref[:, 0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(r.as_numpy("h_n"), h_ref[:, 0], rtol=0, atol=ATOL)


def test_zero_step_requests_beside_running_streams_leave_them_exact():
    """In one engine turn with other streams' steps: the 0-step request has no row (its
    state is not advanced, nor another stream's), and a turn of only such requests runs no
    engine call (it divided the call's time by its 0 steps)."""
    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.scheduler import Lane, Scheduler

    m = leanrnn.GRU(4, 6, num_layers=2, seed=3)
    lane = Lane("m", m, Pool(), threads=1, max_streams=8, max_batch=8, max_chunk=4,
                idle_timeout=30.0)  # fmt: skip
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((7, 4)).astype(np.float32) for _ in range(3)]
    done = []
    with Scheduler({"m": lane}, max_wait=0.0) as s:
        # stream 0 starts with 3 steps; then, submitted together, its 0-step request (the
        # state after 3 steps), stream 1's and 2's whole sequences, and stream 0's rest
        first = s.submit("m", 10, True, False, xs[0][:3], want_state=True, on_done=done.append)
        deadline = time.monotonic() + 10
        while not first.finished and time.monotonic() < deadline:
            time.sleep(0.005)
        mid = s.submit("m", 10, False, False, xs[0][:0], want_state=True, on_done=done.append)
        others = [s.submit("m", 11 + k, True, True, xs[1 + k], want_state=True,
                           on_done=done.append) for k in range(2)]  # fmt: skip
        rest = s.submit("m", 10, False, True, xs[0][3:], want_state=True, on_done=done.append)
        alone = s.submit("m", 20, True, True, xs[0][:0], want_state=True, on_done=done.append)
        while len(done) < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert len(done) == 6 and all(r.error is None for r in done)
    y3, h3 = m(xs[0][:3, None])
    np.testing.assert_allclose(mid.h_out, h3[:, 0], rtol=0, atol=1e-6)
    assert mid.y.shape == (0, 6)
    y, h = m(xs[0][:, None])
    np.testing.assert_allclose(np.concatenate([first.y, rest.y]), y[:, 0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rest.h_out, h[:, 0], rtol=0, atol=1e-6)
    for k, r in enumerate(others):
        yk, hk = m(xs[1 + k][:, None])
        np.testing.assert_allclose(r.y, yk[:, 0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(r.h_out, hk[:, 0], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(alone.h_out, np.zeros((2, 6), np.float32))
    assert lane.seqs == {}  # every slot given back


# ---------------------------------------------------------------------------------------------
# Prometheus's error counter had no model label (kind and protocol only): with several models
# served, one model's failing clients could not be told apart on a dashboard.


def _errors(server) -> dict[tuple, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://{server['http']}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("leanrnn_serve_errors_total{"):
            labels, value = line[len("leanrnn_serve_errors_total{") :].rsplit("} ", 1)
            pairs = dict(p.split("=", 1) for p in labels.split(","))
            out[tuple(pairs[k].strip('"') for k in ("kind", "protocol", "model"))] = float(value)
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_errors_are_counted_per_model_and_never_per_made_up_name(one_slot, protocol):
    mod, c = _client(one_slot, protocol)
    x = np.zeros((1, 3), np.float32)
    before = _errors(one_slot)
    with pytest.raises(Exception, match="not live"):
        _infer(mod, c, {"x": x}, sequence_id=f"never-started-{protocol}")
    with pytest.raises(Exception, match="unknown model"):
        i = mod.InferInput("x", [1, 3], "FP32")
        i.set_data_from_numpy(x)
        c.infer("no-such-model", [i])
    after = _errors(one_slot)
    assert after[("sequence", protocol, "m")] == before[("sequence", protocol, "m")] + 1
    assert after[("not_found", protocol, "")] == before[("not_found", protocol, "")] + 1
    assert not any(k[2] == "no-such-model" for k in after)
    # and the refusal's log line names the model, as the metric's label does
    import json

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(ln) for ln in one_slot["logs"] if ln.startswith("{")]
        refused = [e for e in lines if e.get("event") == "refused"
                   and f"never-started-{protocol}" in e.get("error", "")]  # fmt: skip
        if refused:
            break
        time.sleep(0.05)
    assert refused and refused[-1].get("model") == "m", refused


# ---------------------------------------------------------------------------------------------
# The memory check of a model's state slots and call buffers was per model: three models of
# 0.6x the machine each started without a word (45 GB of zeroed pages on a 24 GiB machine),
# to die as streams filled them.


def test_the_lanes_memory_is_checked_together(monkeypatch):
    import leanrnn
    from leanrnn.errors import PlanError
    from leanrnn.serve import scheduler
    from leanrnn.serve.server import ServeConfig, build

    m = leanrnn.LSTM(4, 32, seed=0)
    cfg = ServeConfig(max_batch=4, max_chunk=4, max_streams=256)
    one = scheduler.Lane("probe", m, scheduler.Pool(), threads=1, max_streams=256, max_batch=4,
                         max_chunk=4, idle_timeout=60.0).fixed_bytes  # fmt: skip
    monkeypatch.setattr(scheduler, "machine_memory", lambda: int(one * 2.5))
    core, sched, _ = build(cfg, {"a": m, "b": m})  # two fit
    assert set(sched.lanes) == {"a", "b"}
    with pytest.raises(PlanError, match=r"model 'c'.*beside the .* bytes of the models before it"):
        build(cfg, {"a": m, "b": m, "c": m})  # each alone fits; the three do not


# ---------------------------------------------------------------------------------------------
# serve's state-dict flags went to every model: a checkpoint's --prefix refused each .lrnn
# served beside it, and a float16 state dict's --dtype float32 converted a float64 .lrnn to
# float32, silently (its metadata said FP32).


def test_state_dict_flags_go_to_the_state_dicts_only(tmp_path):
    import tritonclient.http as th

    import leanrnn
    from helpers import launch_server, stop_server

    f64 = leanrnn.LSTM(3, 4, seed=1).astype(np.float64)
    f64.save(tmp_path / "f64.lrnn")
    g = leanrnn.GRU(3, 5, seed=2)
    np.savez(tmp_path / "ck.npz", **{f"enc.rnn.{k}": v.astype(np.float16)
                                     for k, v in g.state_dict().items()})  # fmt: skip
    proc, http_url, _, logs = launch_server([
        f"a={tmp_path / 'f64.lrnn'}", f"b={tmp_path / 'ck.npz'}", "--prefix", "enc.rnn.",
        "--dtype", "float32", "--max-batch", "2"])  # fmt: skip
    try:
        c = th.InferenceServerClient(http_url)
        assert c.get_model_metadata("a")["inputs"][0]["datatype"] == "FP64"
        assert c.get_model_metadata("b")["inputs"][0]["datatype"] == "FP32"
        x = np.random.default_rng(0).standard_normal((4, 3))
        i = th.InferInput("x", [4, 3], "FP64")
        i.set_data_from_numpy(x)
        y = c.infer("a", [i]).as_numpy("y")
        np.testing.assert_allclose(y, f64(x[:, None])[0][:, 0], rtol=0, atol=1e-12)
    finally:
        assert stop_server(proc) == 0, "".join(logs)
    said = "".join(logs)
    assert "--prefix --dtype applied to the state dicts among the models; a served as" in said


# ---------------------------------------------------------------------------------------------
# serve refused every graph, an ONNX export of a torch.nn.LSTM too (the most common ONNX
# LSTM there is), advising a conversion no tool made: it now serves the stack such a graph is
# (GraphModel.as_stack), and still refuses a graph that computes more, saying what.


def test_an_onnx_export_of_a_stack_is_served_and_a_graph_with_a_head_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    import tritonclient.grpc as tg

    from helpers import launch_server, stop_server, torch_export

    torch.manual_seed(3)
    lstm = torch.nn.LSTM(3, 6, num_layers=2).eval()
    x = torch.randn(9, 1, 3)
    path = torch_export(lstm, (x,), tmp_path / "lstm.onnx", dynamo=False,
                        dynamic={"input": {0: "T", 1: "N"}}, names=(["input"], ["y", "h", "c"]))  # fmt: skip
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = s.run(None, {"input": x.numpy()})
    proc, _, grpc_url, logs = launch_server([f"lstm={path}", "--max-batch", "4"])
    try:
        c = tg.InferenceServerClient(grpc_url)
        ys = []
        for k, (a, b) in enumerate([(0, 4), (4, 5), (5, 9)]):
            i = tg.InferInput("x", [b - a, 3], "FP32")
            i.set_data_from_numpy(x.numpy()[a:b, 0])
            r = c.infer("lstm", [i], sequence_id=77, sequence_start=k == 0,
                        sequence_end=b == 9)  # fmt: skip
            ys.append(r.as_numpy("y"))
        np.testing.assert_allclose(np.concatenate(ys), want[0][:, 0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.as_numpy("h_n"), want[1][:, 0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.as_numpy("c_n"), want[2][:, 0], rtol=0, atol=1e-5)
    finally:
        assert stop_server(proc) == 0, "".join(logs)

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = torch.nn.GRU(3, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    import leanrnn
    from leanrnn.errors import SpecError
    from leanrnn.serve.scheduler import stack_of

    head = torch_export(Tagger().eval(), (x,), tmp_path / "tagger.onnx", dynamo=False)
    with pytest.raises(SpecError, match=r"computes more than a recurrent stack.*(MatMul|Gemm)"):
        stack_of("tagger", leanrnn.load(head))


# ---------------------------------------------------------------------------------------------
# A red-team pass on the 0-step requests: a turn of them only left the active-streams gauge
# at the live count before it (it was updated with an engine call's metrics), counted as a
# Triton execution, and a stateless one took a slot (a flood of them turned new sequences
# away at --max-streams).


def _wait(pred, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pred()


def test_zero_step_turns_keep_the_gauge_and_the_executions_true():
    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.metrics import Metrics
    from leanrnn.serve.scheduler import Lane, Scheduler

    m = leanrnn.LSTM(3, 4, seed=5)
    lane = Lane("m", m, Pool(), threads=1, max_streams=2, max_batch=2, max_chunk=4,
                idle_timeout=30.0)  # fmt: skip
    metrics = Metrics(("m",))

    def active():
        return metrics.registry.get_sample_value("leanrnn_serve_active_streams", {"model": "m"})

    x = np.ones((2, 3), np.float32)
    with Scheduler({"m": lane}, max_wait=0.0, metrics=metrics) as s:
        first = s.submit("m", 1, True, False, x)
        _wait(lambda: first.finished)
        executions = lane.completing
        assert active() == 1
        end = s.submit("m", 1, False, True, x[:0], want_state=True)
        _wait(lambda: end.finished)
        _wait(lambda: active() == 0)  # (it stayed 1 until the next engine call)
        assert lane.completing == executions  # (a turn without an engine call is none)
        np.testing.assert_allclose(end.h_out, m(x[:, None])[1][0][:, 0], rtol=0, atol=1e-6)
        # both slots held: a stateless 0-step request is still answered (it needs none)
        held = [s.submit("m", k, True, False, x) for k in (7, 8)]
        _wait(lambda: all(r.finished for r in held))
        h0 = np.full((1, 4), 0.5, np.float32)
        c0 = np.full((1, 4), -0.5, np.float32)
        alone = s.submit("m", ("", 123), True, True, x[:0], h0, c0, want_state=True)
        assert alone.finished and alone.error is None and alone.y.shape == (0, 4)
        np.testing.assert_array_equal(alone.h_out, h0)
        np.testing.assert_array_equal(alone.c_out, c0)
        assert len(lane.seqs) == 2 and active() == 2
