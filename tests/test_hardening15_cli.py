"""Session 41, from a red-team pass on the CLI (run, convert, inspect, compile): `run
--lengths` was replaced by a `lengths` array inside the --input .npz without a word; a
Fortran-order or big-endian .npy was refused with advice only Python can follow; `inspect`
printed a model file's names raw (a newline forged a report line, escape sequences reached
the terminal); `--dtype float32` was refused for a float32 ONNX file."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn import cli


@pytest.fixture()
def stack(tmp_path):
    m = leanrnn.LSTM(3, 5, seed=0)
    path = str(tmp_path / "m.lrnn")
    leanrnn.save(m, path)
    return m, path


def test_run_refuses_lengths_given_twice(stack, tmp_path, capsys):
    m, path = stack
    x = np.random.default_rng(0).standard_normal((4, 3, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, lengths=np.ones(3, np.int64))
    np.save(tmp_path / "l.npy", np.array([4, 2, 3]))
    code = cli.main(["run", path, "--input", str(tmp_path / "in.npz"),
                     "--lengths", str(tmp_path / "l.npy")])  # fmt: skip
    assert code == 1 and "--lengths and the --input .npz both give ['lengths']" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("form", ["fortran", "big-endian"])
def test_run_takes_any_npy_layout(stack, tmp_path, form):
    m, path = stack
    x = np.random.default_rng(1).standard_normal((4, 3, 3)).astype(np.float32)
    stored = np.asfortranarray(x) if form == "fortran" else x.astype(">f4")
    np.save(tmp_path / "x.npy", stored)
    assert cli.main(["run", path, "--input", str(tmp_path / "x.npy"),
                     "--output", str(tmp_path / "y.npz")]) == 0  # fmt: skip
    with np.load(tmp_path / "y.npz") as z:
        np.testing.assert_array_equal(z["y"], m(x)[0])


def test_inspect_quotes_names_that_are_not_printable(tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inn = "x\n  parameters:   999 (forged)"
    node = helper.make_node("LSTM", [inn, "W", "R"], ["y"], hidden_size=3,
                            name="n\x1b]0;title\x07\x1b[2J")  # fmt: skip
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(inn, TensorProto.FLOAT, ["T", "N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((1, 12, k)).astype(np.float32), n)
         for n, k in (("W", 2), ("R", 3))],
    )  # fmt: skip
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]),
              str(tmp_path / "e.onnx"))  # fmt: skip
    assert cli.main(["inspect", str(tmp_path / "e.onnx")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert not any(line.lstrip().startswith("parameters:   999") for line in out.splitlines())
    assert "'n\\x1b]0;title\\x07\\x1b[2J'" in out


def test_a_graph_loads_with_the_dtype_it_has(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    node = helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=3)
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((1, 12, k)).astype(np.float32), n)
         for n, k in (("W", 2), ("R", 3))],
    )  # fmt: skip
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), path)
    x = rng.standard_normal((4, 1, 2)).astype(np.float32)
    want = leanrnn.load(path).run({"x": x})[0]
    np.testing.assert_array_equal(leanrnn.load(path, dtype="float32").run({"x": x})[0], want)
    with pytest.raises(leanrnn.errors.ModelFormatError, match="dtype='float32'"):
        leanrnn.load(path, dtype="float64")  # (a graph does not convert: named, with its own)
