"""Hardening, seventh pass: the library API where it disagreed with the CLI or with itself. Each
test failed before its fix: a model's own ``save`` took any name, library ``convert`` wrote over
its source, a float byte count (4e6) was refused as a memory limit, and ``inspect --json`` of a
graph named sizes the file had overridden."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

import leanrnn
from leanrnn import cli
from leanrnn.errors import ModelFormatError, SpecError

C, H = 4, 5


def _rnn_onnx(path, x_shape) -> str:
    """One ONNX RNN node, y = RNN(x), whose input x is declared with ``x_shape``."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    W, R = ((rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((1, H, C), (1, H, H)))
    node = helper.make_node("RNN", ["x", "W", "R"], ["y"], name="rnn", hidden_size=H)
    g = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(path))
    return str(path)


@pytest.fixture(params=["stack", "graph"])
def model(request, tmp_path):
    if request.param == "stack":
        return leanrnn.LSTM(C, H, seed=0)
    return leanrnn.load(_rnn_onnx(tmp_path / "g.onnx", ["T", "N", C]))


# ------------------------------------------------ 1: a model's own save names its format
def test_model_save_refuses_a_name_other_than_lrnn(model, tmp_path):
    # before: model.save("m.onnx") wrote a native file that ONNX tools then failed to read
    # (only leanrnn.save checked the name)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("m.onnx", "m.npz", "m", "m.lrnn.bak"):
        with pytest.raises(ModelFormatError, match=r"^\[save\] .*must end in \.lrnn"):
            model.save(str(out / name))
    assert not any(out.iterdir())
    model.save(out / "m.LRNN")  # the suffix in any case, as leanrnn.save takes it
    assert [p.name for p in out.iterdir()] == ["m.LRNN"]
    assert type(leanrnn.load(out / "m.LRNN")) is type(model)


def test_convert_checks_the_output_name_before_the_load(tmp_path):
    # (passed before too: pins the check's place now that it lives in native.out_path) it runs
    # before the possibly long load: a source that is no model file at all gets the name error
    with pytest.raises(ModelFormatError, match=r"^\[convert\] .*must end in \.lrnn"):
        leanrnn.convert(str(tmp_path / "missing.onnx"), str(tmp_path / "o.onnx"))


# ------------------------------------------------ 2: library convert onto its own source
def test_convert_onto_its_own_source_is_refused(tmp_path):
    # before: leanrnn.convert(v, v) (or through a hard or symbolic link) replaced the source;
    # only the CLI refused it
    v = tmp_path / "v.lrnn"
    leanrnn.save(leanrnn.GRU(C, H, seed=1), v)
    os.link(v, tmp_path / "hard.lrnn")
    os.symlink(v, tmp_path / "soft.lrnn")
    before = v.read_bytes()
    for dst in ("v.lrnn", "hard.lrnn", "soft.lrnn"):
        with pytest.raises(ModelFormatError, match=r"^\[convert\] output .* input file itself"):
            leanrnn.convert(v, tmp_path / dst, precision="int8")
    with pytest.raises(ModelFormatError, match="input file itself"):  # from the link's side too
        leanrnn.convert(tmp_path / "soft.lrnn", str(v))
    assert v.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.lrnn", "soft.lrnn", "v.lrnn"]
    assert leanrnn.convert(v, tmp_path / "q.lrnn", precision="int8") == str(tmp_path / "q.lrnn")


def test_cli_convert_onto_its_own_source_is_still_one_line(tmp_path, capsys):
    # (passed before too) the CLI now leaves this check to leanrnn.convert
    v = tmp_path / "v.lrnn"
    leanrnn.save(leanrnn.GRU(C, H, seed=1), v)
    assert cli.main(["convert", str(v), str(v)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanrnn: error: [convert] output"), err
    assert "input file itself" in err[0]


# ------------------------------------------------ 3: byte counts written as floats
INTEGRAL = [4e6, float(2**30), np.float64(4e6), np.float32(2**22)]


@pytest.mark.parametrize("limit", INTEGRAL)
def test_session_resize_takes_an_integral_float_as_bytes(limit):
    # before: "[Session.resize] memory_limit=4000000.0; expected an int of bytes >= 1"
    m = leanrnn.LSTM(C, H, seed=0)
    got = m.session.resize(2, 50, memory_limit=limit)
    chunk = m.session.chunk
    want = leanrnn.LSTM(C, H, seed=0).session.resize(2, 50, memory_limit=int(limit))
    assert got.total == want.total and got.total <= int(limit)
    assert m.resize({"x": (50, 2, C)}, memory_limit=limit).total == want.total
    assert m.session.chunk == chunk


def test_graph_model_resize_takes_an_integral_float_as_bytes(tmp_path):
    g = leanrnn.load(_rnn_onnx(tmp_path / "g.onnx", ["T", "N", C]))
    assert g.resize({"x": (6, 2, C)}, memory_limit=4e6).total > 0


@pytest.mark.parametrize(
    "limit", [4.5, 0.0, -4e6, math.nan, math.inf, -math.inf, True, np.bool_(True), "4e6", 0, -1]
)
def test_memory_limit_still_refuses_what_is_not_a_byte_count(limit, tmp_path):
    m = leanrnn.LSTM(C, H, seed=0)
    for call in (lambda: m.session.resize(2, 5, memory_limit=limit),
                 lambda: m.resize({"x": (5, 2, C)}, memory_limit=limit)):  # fmt: skip
        with pytest.raises(SpecError, match=r"memory_limit=.*expected an int of bytes"):
            call()
    m.session.resize(2, 5, memory_limit=4 << 20)  # the session still plans after the refusal


@pytest.mark.parametrize("limit", [4.5, math.nan, True, "4e6", -1])
def test_graph_model_resize_refuses_what_is_not_a_byte_count(limit, tmp_path):
    # before: GraphModel.resize checked nothing (4.5 planned, "4e6" was a TypeError)
    g = leanrnn.load(_rnn_onnx(tmp_path / "g.onnx", ["T", "N", C]))
    with pytest.raises(SpecError, match=r"\[GraphModel.resize\] memory_limit="):
        g.resize({"x": (6, 2, C)}, memory_limit=limit)


def test_score_takes_an_integral_float_as_bytes(tmp_path):
    # the same knob as Session.resize's: `score(..., memory_limit=64e6)` was refused
    m = leanrnn.GRU(C, H, seed=0)
    x = np.random.default_rng(1).standard_normal((3, 4, C)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    s = leanrnn.score(m, tmp_path / "x.npy", tmp_path / "o.npz", memory_limit=64e6)
    assert s.memory_limit == 64_000_000 and s.sequences == 3
    want = m(np.ascontiguousarray(x.transpose(1, 0, 2)))[1]  # h_n [1, N, H]
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["h_n"][:, 0], want[0], rtol=0, atol=1e-5)
    with pytest.raises(leanrnn.errors.LeanRNNError, match=r"memory_limit=4.5"):
        leanrnn.score(m, tmp_path / "x.npy", tmp_path / "p.npz", memory_limit=4.5)


# ------------------------------------------------ 4: inspect --json names what was planned
@pytest.mark.parametrize(
    "declared, planned, batch, steps",
    [([3, 2, C], [3, 2, C], None, None), (["T", 2, C], [9, 2, C], None, 9),
     (["T", "N", C], [9, 7, C], 7, 9)],
)  # fmt: skip
def test_inspect_json_of_a_graph_names_the_planned_sizes(declared, planned, batch, steps,
                                                          tmp_path, capsys):  # fmt: skip
    # before: --json said "batch": 7, "steps": 9 although the text said (and the arena was
    # planned for) the file's fixed [3, 2, 4]; null: a size the file fixes, not --batch/--steps
    path = _rnn_onnx(tmp_path / "g.onnx", declared)
    argv = ["inspect", path, "--batch", "7", "--steps", "9"]
    assert cli.main([*argv, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["arena"]["input_shapes"] == {"x": planned}
    assert (info["batch"], info["steps"]) == (batch, steps)
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.split("planned arena for ")[1].splitlines()[0]
    if batch is not None and steps is not None:
        assert line.startswith("N=7, T=9:"), line
    else:
        ignored = [f for f, v in (("--batch 7", batch), ("--steps 9", steps)) if v is None]
        assert " and ".join(ignored) in line and "N=7" not in line, line
        assert str({"x": planned}) in line, line


def test_trainer_takes_an_integral_float_memory_limit():
    # before: "[Trainer] memory_limit=4000000.0; expected bytes >= 1"
    from leanrnn.train import Trainer

    t = Trainer(leanrnn.LSTM(C, H, seed=0), memory_limit=4e6)
    assert t.memory_limit == 4_000_000 and isinstance(t.memory_limit, int)
    with pytest.raises(SpecError, match=r"memory_limit=4\.5"):
        Trainer(leanrnn.LSTM(C, H, seed=0), memory_limit=4.5)
