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


@pytest.mark.parametrize("dims", [("a", "b"), ("s31", "s81"), ("batch", "seq")])
@pytest.mark.parametrize("embedded", [False, True])
def test_describe_plans_a_batch_first_graph_for_the_sizes_asked(tmp_path, dims, embedded):
    """A batch-first module exported for a layout-0 node has x [N, T, C] and a Transpose
    before the node: its unnamed dims were read as [T, N] (N=100, T=1 planned for N=1, T=100:
    2.9x the arena), and a dim named "b" took the batch whatever its place."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    C, H = 2, 3
    inits = [numpy_helper.from_array(rng.standard_normal((1, 4 * H, k)).astype(np.float32), n)
             for n, k in (("W", C), ("R", H))]  # fmt: skip
    nodes = [helper.make_node("Transpose", ["e" if embedded else "x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("LSTM", ["xt", "W", "R"], ["y"], hidden_size=H)]  # fmt: skip
    if embedded:  # ids [N, T] -> an embedding table's rows
        nodes.insert(0, helper.make_node("Gather", ["emb", "x"], ["e"], axis=0))
        inits.append(numpy_helper.from_array(rng.standard_normal((7, C)).astype(np.float32), "emb"))
        x = helper.make_tensor_value_info("x", TensorProto.INT64, list(dims))
    else:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, C])
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          inits)  # fmt: skip
    path = str(tmp_path / "bf.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), path)
    got = leanrnn.load(path).describe(2, 100)["arena"]["input_shapes"]["x"]
    assert list(got) == ([2, 100] if embedded else [2, 100, C])


def test_a_state_dict_prefix_with_a_newline_is_found(tmp_path):
    """The key pattern's '.' did not match a newline: "no *weight_ih_l0 entry" while the keys
    listed included 'enc\\n.weight_ih_l0'."""
    torch = pytest.importorskip("torch")
    m = torch.nn.LSTM(3, 4)
    torch.save({f"enc\n.{k}": v for k, v in m.state_dict().items()}, tmp_path / "m.pt")
    got = leanrnn.load(str(tmp_path / "m.pt"))
    x = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32)
    with torch.no_grad():
        want = m(torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(got(x)[0], want, atol=1e-6, rtol=0)
