"""Session 43, from the list earlier sessions noticed and left alone: `inspect` refused an
ONNX file whose input declares no shape (other frameworks' exporters write them so);
`run --output /dev/stdout` wrote /dev/stdout.npz when stdout was a file (and had no way to
write the .npz to a pipe); `run` refused int64 lengths (np.save of a Python list) for a
model that declares int32, and int32 for one that declares int64."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import src_env
from leanrnn import cli

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

C, H = 3, 4


def _lstm_file(path, x_shape, lengths_type=TensorProto.INT32, batch_first=False):
    """One LSTM node fed by ``x`` (declared ``x_shape``; None: undeclared), through a
    Transpose from [N, T, C] when ``batch_first``, and by integer lengths ``L``."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.5, n)
             for n, s in (("W", (1, 4 * H, C)), ("R", (1, 4 * H, H)))]  # fmt: skip
    nodes = [helper.make_node("Cast", ["L"], ["L32"], to=TensorProto.INT32)]
    xin = "x"
    if batch_first:
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]))
        xin = "xt"
    nodes.append(helper.make_node("LSTM", [xin, "W", "R", "", "L32"], ["y"], hidden_size=H))
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
         helper.make_tensor_value_info("L", lengths_type, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), str(path))
    return str(path)


@pytest.mark.parametrize("batch_first", [False, True])
def test_inspect_plans_an_rnn_input_without_a_declared_shape(tmp_path, capsys, batch_first):
    path = _lstm_file(tmp_path / "m.onnx", None, batch_first=batch_first)
    assert cli.main(["inspect", path, "--batch", "2", "--steps", "7", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # the shape X has (through the Transpose), its C from the weights; lengths [N]
    want = [2, 7, C] if batch_first else [7, 2, C]
    assert info["arena"]["input_shapes"] == {"x": want, "L": [2]}
    assert info["arena"]["total_bytes"] > 0


def test_inspect_describes_a_graph_it_cannot_plan(tmp_path, capsys):
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "B"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "B")],
    )  # fmt: skip
    path = str(tmp_path / "mm.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), path)
    assert cli.main(["inspect", path]) == 0  # it was "leanrnn: error: ... cannot plan it"
    out = capsys.readouterr().out
    assert "parameters:   6" in out and "arena not planned: input 'a' has no declared" in out


@pytest.mark.parametrize("declared,given", [(TensorProto.INT32, np.int64),
                                            (TensorProto.INT64, np.int32)])  # fmt: skip
def test_run_takes_lengths_in_either_integer_width(tmp_path, declared, given):
    ort = pytest.importorskip("onnxruntime")
    path = _lstm_file(tmp_path / "m.onnx", ["T", "N", C], lengths_type=declared)
    x = np.random.default_rng(1).standard_normal((5, 2, C)).astype(np.float32)
    lengths = np.array([5, 3])
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "l.npy", lengths.astype(given))
    out = str(tmp_path / "y.npz")
    assert cli.main(["run", path, "--input", str(tmp_path / "x.npy"),
                     "--lengths", str(tmp_path / "l.npy"), "--output", out]) == 0  # fmt: skip
    want = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}[declared]
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (ref,) = sess.run(None, {"x": x, "L": lengths.astype(want)})
    with np.load(out) as z:
        np.testing.assert_allclose(z["y"], ref, rtol=1e-5, atol=1e-6)


def test_run_refuses_lengths_that_do_not_fit_the_declared_width(tmp_path, capsys):
    from helpers import fails_in_one_line

    path = _lstm_file(tmp_path / "m.onnx", ["T", "N", C])
    np.save(tmp_path / "x.npy", np.zeros((5, 2, C), np.float32))
    np.save(tmp_path / "l.npy", np.array([5, 2**40]))
    fails_in_one_line(capsys, ["run", path, "--input", str(tmp_path / "x.npy"),
                               "--lengths", str(tmp_path / "l.npy")], "int64", "int32")  # fmt: skip


@pytest.mark.parametrize("target", ["-", "/dev/stdout"])
def test_run_writes_the_npz_to_standard_output(tmp_path, target):
    import leanrnn

    m = leanrnn.LSTM(C, H, seed=0)
    path = str(tmp_path / "m.lrnn")
    leanrnn.save(m, path)
    x = np.random.default_rng(2).standard_normal((4, 2, C)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    with open(tmp_path / "out.bin", "wb") as sink:  # stdout a file: /dev/stdout is one too
        p = subprocess.run([sys.executable, "-m", "leanrnn", "run", path, "--input",
                            str(tmp_path / "x.npy"), "--output", target],
                           stdout=sink, stderr=subprocess.PIPE, env=src_env(), timeout=120,
                           cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    with np.load(io.BytesIO((tmp_path / "out.bin").read_bytes())) as z:
        np.testing.assert_array_equal(z["y"], m(x)[0])
    assert not (tmp_path / "-.npz").exists()
    piped = subprocess.run([sys.executable, "-m", "leanrnn", "run", path, "--input",
                            str(tmp_path / "x.npy"), "--output", "-"],
                           capture_output=True, env=src_env(), timeout=120)  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    with np.load(io.BytesIO(piped.stdout)) as z:
        np.testing.assert_array_equal(z["h_n"], m(x)[1][0])


def test_run_output_dash_refuses_a_terminal(tmp_path, capsys, monkeypatch):
    import leanrnn
    from helpers import fails_in_one_line

    path = str(tmp_path / "m.lrnn")
    leanrnn.save(leanrnn.GRU(C, H, seed=0), path)
    np.save(tmp_path / "x.npy", np.zeros((2, 1, C), np.float32))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    fails_in_one_line(capsys, ["run", path, "--input", str(tmp_path / "x.npy"), "--output", "-"],
                      "standard output is a terminal")  # fmt: skip
