"""Hardening, ninth pass: a red team's findings on the numerics, the model files and the server.
Each test failed before its fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn.formats.packing import LayerWeights, pack
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import Activation, RNNSpec


# ------------------------------------------ float32 tanh and sigmoid within their ranges
def _sweep(lo: float, hi: float, n: int = 4096) -> np.ndarray:
    """n float32 values from lo to hi, both float32 neighbours of each end included."""
    v = np.linspace(lo, hi, n).astype(np.float32)
    return np.unique(np.concatenate([v, np.nextafter(v, np.float32(0)), -v]))


@pytest.mark.parametrize("clip", [None, 100.0], ids=["fused", "clipped"])
def test_float32_tanh_never_leaves_minus_one_to_one(clip):
    """An RNN whose pre-activation is x itself (W = 1, R = 0, no bias): y = tanh(x). Past
    |x| ~ 7.9 the rational tanh read 1.000000238 (up to 9, its clamp). ``clip`` (ONNX's, far
    above every value here) sends the cell through the scalar activation instead of the fused
    vector update."""
    spec = RNNSpec("rnn", 1, 16, bias=False, clip=clip)
    x = _sweep(7.0, 9.5)
    w = LayerWeights(np.ones((16, 1), np.float32), np.zeros((16, 16), np.float32),
                     np.zeros(16, np.float32), np.zeros(16, np.float32))  # fmt: skip
    y = leanrnn.Model(pack(spec, [[w]])).session.run(x.reshape(1, -1, 1))[0][0]
    assert np.abs(y).max() <= 1.0, float(np.abs(y).max() - 1)
    np.testing.assert_allclose(y, np.tanh(x.astype(np.float64))[:, None].repeat(16, 1),
                               rtol=0, atol=3e-7)  # fmt: skip


def test_float32_sigmoid_is_never_negative():
    """An LSTM whose input and cell gates saturate (i = 1, g = 1: c = 1) and whose output gate's
    pre-activation is x in [-18, -16]: h = sigmoid(x) tanh(1), a few 1e-8 and positive. The
    sigmoid (tanh(x/2)/2 + 1/2) read -1.19e-7 at x = -17.97 and h came out negative."""
    H = 16
    x = -_sweep(16.0, 18.0)
    x = x[x < 0]
    w_ih = np.zeros((4 * H, 1), np.float32)
    w_ih[3 * H :] = 1.0  # torch's gate order i, f, g, o: o's pre-activation is x
    b_ih = np.zeros(4 * H, np.float32)
    b_ih[:H] = b_ih[2 * H : 3 * H] = 30.0  # i and g saturate at 1
    sd = {"weight_ih_l0": w_ih, "weight_hh_l0": np.zeros((4 * H, H), np.float32),
          "bias_ih_l0": b_ih, "bias_hh_l0": np.zeros(4 * H, np.float32)}  # fmt: skip
    y, _ = leanrnn.from_state_dict(sd, cell="lstm")(x.reshape(1, -1, 1))
    want = np.tanh(1.0) / (1.0 + np.exp(-x.astype(np.float64)))
    assert (y >= 0).all(), float(y.min())
    np.testing.assert_allclose(y[0], want[:, None].repeat(H, 1), rtol=0, atol=1e-7)


# ------------------------------------------ NaN through relu and hard sigmoid
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_relu_rnn_carries_nan_to_the_samples_outputs_as_torch_does(bad):
    """A NaN in x[0] of sample 1 (or +inf, which a second layer turns into inf - inf): relu's
    ``x if x > 0 else 0`` read NaN as 0 and the sample's outputs came out finite (torch's RNN
    and the float64 oracle give NaN)."""
    m = leanrnn.RNN(4, 8, num_layers=2, nonlinearity="relu", seed=0)
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    x[0, 1, 2] = bad
    y, h = m(x)
    assert np.isnan(y[:, 1]).any(), y[:, 1]
    assert np.isfinite(y[:, [0, 2]]).all()
    with np.errstate(invalid="ignore"):  # inf - inf in the oracle too
        ry, rh, _ = reference_forward(m.spec, m.weights.unpack(), x)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ry))
    np.testing.assert_array_equal(np.isnan(h), np.isnan(rh))
    torch = pytest.importorskip("torch")
    t = torch.nn.RNN(4, 8, num_layers=2, nonlinearity="relu")
    t.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    ty, th = t(torch.from_numpy(x))
    np.testing.assert_array_equal(np.isnan(y), ty.isnan().numpy())


@pytest.mark.parametrize("name", ["relu", "hardsigmoid"])
def test_onnx_activations_pass_nan_as_the_oracle_does(name):
    """ONNX Relu and HardSigmoid as an RNN's activation: NaN read 0 (``v if v > 0 else 0``)."""
    spec = RNNSpec("rnn", 3, 16, activations=((Activation.make(name, 0.2, 0.5),),))
    layers = random_layers(spec, np.random.default_rng(1))
    x = np.random.default_rng(2).standard_normal((4, 2, 3)).astype(np.float32)
    x[1, 0, 0] = np.nan
    y, h, _ = leanrnn.Model(pack(spec, layers)).session.run(x)
    ry, rh, _ = reference_forward(spec, layers, x)
    assert np.isnan(ry[1:, 0]).all()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ry))
    np.testing.assert_allclose(y, ry, atol=1e-5)  # equal_nan: the finite ones agree


# ------------------------------------------ model and input files
def _bz2_npz(path, arrays: dict) -> None:
    """An .npz whose members are bzip2-compressed (np.savez writes stored or deflated only):
    zipfile inflates each read's bzip2 input in full, so such a member's declared size bounds
    nothing (a 1 KB file took 2 GiB)."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as z:
        for k, v in arrays.items():
            buf = io.BytesIO()
            np.save(buf, v)
            z.writestr(f"{k}.npy", buf.getvalue())


def test_npz_members_compressed_other_than_deflate_are_refused_unread(tmp_path, capsys):
    from helpers import fails_in_one_line
    from leanrnn.errors import ModelFormatError
    from leanrnn.score import DataError, score

    m = leanrnn.LSTM(3, 4, seed=0)
    _bz2_npz(tmp_path / "m.npz", m.state_dict())
    with pytest.raises(ModelFormatError, match="compressed with method 12; expected stored or"):
        leanrnn.load(str(tmp_path / "m.npz"))  # before: loaded (and a bomb inflated in full)
    leanrnn.save(m, str(tmp_path / "m.lrnn"))
    x = np.zeros((2, 1, 3), np.float32)
    _bz2_npz(tmp_path / "x.npz", {"x": x})
    fails_in_one_line(capsys, ["run", str(tmp_path / "m.lrnn"), "--input",
                               str(tmp_path / "x.npz")], "method 12")  # fmt: skip
    _bz2_npz(tmp_path / "s.npz", {"x": x.transpose(1, 0, 2).copy()})
    with pytest.raises(DataError, match="method 12"):
        score(str(tmp_path / "m.lrnn"), str(tmp_path / "s.npz"), str(tmp_path / "out.npz"))


@pytest.mark.parametrize("kind", ["sparse_coo", "qint8", "float8", "meta", "nested"])
def test_torch_tensor_kinds_numpy_cannot_view_are_refused_by_name(kind, tmp_path, capsys):
    """weights_only unpickles these; reading them raised torch's NotImplementedError /
    TypeError / RuntimeError (a traceback from the CLI)."""
    from helpers import fails_in_one_line
    from leanrnn.errors import WeightsError

    torch = pytest.importorskip("torch")
    sd = dict(torch.nn.LSTM(4, 8).state_dict())
    w = sd["weight_ih_l0"]
    sd["weight_ih_l0"] = {
        "sparse_coo": lambda: w.to_sparse(),
        "qint8": lambda: torch.quantize_per_tensor(w, 0.1, 0, torch.qint8),
        "float8": lambda: w.to(torch.float8_e4m3fn),
        "meta": lambda: torch.empty(32, 4, device="meta"),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)]),
    }[kind]()
    p = str(tmp_path / "m.pt")
    torch.save(sd, p)
    with pytest.raises(WeightsError, match=r"entry 'weight_ih_l0' is a .* tensor; expected dense"):
        leanrnn.load(p)
    fails_in_one_line(capsys, ["inspect", p], "weight_ih_l0")


def test_torch_entries_sharing_one_storage_many_times_are_refused(tmp_path):
    """A 200-layer LSTM whose every weight views one storage: a 1 MiB file packed 810 MiB.
    Weights tied between two modules (views of one storage twice) still load."""
    from leanrnn.errors import ModelFormatError

    torch = pytest.importorskip("torch")
    H, L = 64, 200
    w = torch.randn(4 * H, H)  # 64 KiB, every layer's W and R
    b = torch.zeros(4 * H)
    sd = {f"{k}_l{i}": (w if k.startswith("weight") else b) for i in range(L)
          for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}  # fmt: skip
    torch.save(sd, tmp_path / "shared.pt")
    with pytest.raises(ModelFormatError, match="tensors sharing storage"):
        leanrnn.load(str(tmp_path / "shared.pt"))
    tied = {k: sd[k] for k in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")}
    torch.save(tied, tmp_path / "tied.pt")  # W and R one storage: twice, as tied weights
    y, _ = leanrnn.load(str(tmp_path / "tied.pt"))(np.ones((2, 1, H), np.float32))
    assert np.isfinite(y).all()
    # another module registered under 6 names (one 2 MiB storage viewed 6 times) is not packed
    lstm = torch.nn.LSTM(H, H)
    full = {f"rnn.{k}": v for k, v in lstm.state_dict().items()}
    shared = torch.randn(512, 1024)
    full.update({f"block{i}.weight": shared for i in range(6)})
    torch.save(full, tmp_path / "albert.pt")
    x = np.ones((2, 1, H), np.float32)
    got = leanrnn.load(str(tmp_path / "albert.pt"), prefix="rnn.")(x)[0]
    np.testing.assert_allclose(got, lstm(torch.from_numpy(x))[0].detach().numpy(), atol=1e-5)


@pytest.fixture
def oh():
    """onnx.helper (the ONNX tests skip without onnx)."""
    return pytest.importorskip("onnx").helper


def _onnx(path, nodes, inputs, inits=(), opset=17) -> str:
    """Save a graph of ``nodes`` with float inputs ``[(name, shape)]`` and output y."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as oh

    ins = [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    g = oh.make_graph(nodes, "g", ins, [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                      initializer=list(inits))  # fmt: skip
    onnx.save(oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)]), path)
    return str(path)


def test_onnx_rnn_nodes_sharing_weights_share_one_packing(tmp_path, oh):
    """Nodes naming one W and R (an unrolled decoder, weights tied across a stack) each packed
    their own copy: a 2 MiB file of 500 such nodes took 1 GiB. Here 200 LSTM nodes in a chain
    on one W and R (64 MiB packed apart) load in a few MiB and compute the chain."""
    import tracemalloc

    from onnx import numpy_helper

    H = C = 128
    n = 200
    rng = np.random.default_rng(0)
    W, R = (numpy_helper.from_array((rng.standard_normal((1, 4 * H, C)) * 0.05)
                                    .astype(np.float32), name) for name in "WR")  # fmt: skip
    nodes, prev = [], "x"
    for i in range(n):
        out = "y" if i == n - 1 else f"s{i}"
        nodes += [oh.make_node("LSTM", [prev, "W", "R"], [f"Y{i}"], hidden_size=H),
                  oh.make_node("Squeeze", [f"Y{i}", "one"], [out])]  # fmt: skip
        prev = out
    one = numpy_helper.from_array(np.array([1], np.int64), "one")
    p = _onnx(tmp_path / "chain.onnx", nodes, [("x", ["T", "N", C])], [W, R, one])
    single = _onnx(tmp_path / "one.onnx", [*nodes[:2], oh.make_node("Identity", ["s0"], ["y"])],
                   [("x", ["T", "N", C])], [W, R, one])  # fmt: skip
    tracemalloc.start()
    chain = leanrnn.load(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak  # one packing (~0.5 MiB) and the graph, not 200 packings
    assert len({id(w) for w in chain.graph.packed.values()}) == 1
    x = rng.standard_normal((3, 1, C)).astype(np.float32)
    step, want = leanrnn.load(single), x
    for _ in range(n):
        want = step(want)
    np.testing.assert_allclose(chain(x), want, atol=1e-5)


def test_packed_rnn_weights_are_bounded_by_the_weights_the_file_holds(tmp_path, oh,
                                                                      monkeypatch):  # fmt: skip
    """What is packed may be PACK_RATIO times the distinct weights (padding) plus slack; with
    the slack taken away and a ratio of 1, an H=20 LSTM (padded to 32 units) is refused."""
    from onnx import numpy_helper

    from leanrnn.engine.graph import passes
    from leanrnn.errors import ModelFormatError

    H = C = 20
    rng = np.random.default_rng(0)
    W, R = (numpy_helper.from_array(rng.standard_normal((1, 4 * H, C)).astype(np.float32), k)
            for k in "WR")  # fmt: skip
    p = _onnx(tmp_path / "pad.onnx", [oh.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=H)],
              [("x", ["T", "N", C])], [W, R])  # fmt: skip
    assert leanrnn.load(p) is not None
    monkeypatch.setattr(passes, "FOLD_SLACK_BYTES", 0)
    monkeypatch.setattr(passes, "PACK_RATIO", 1)
    with pytest.raises(ModelFormatError, match="brings the packed RNN weights to"):
        leanrnn.load(p)


def test_split_with_num_outputs_zero_is_a_format_error(tmp_path, oh):
    """``num_outputs=0`` divided by zero: a bare ZeroDivisionError, from load (a constant
    input) or the first run (a graph input)."""
    from leanrnn.errors import LeanRNNError

    p = _onnx(tmp_path / "s.onnx", [oh.make_node("Split", ["x"], ["y"], axis=0, num_outputs=0)],
              [("x", [2, 3])], opset=18)  # fmt: skip
    with pytest.raises(LeanRNNError, match="num_outputs=0 with 1 outputs named"):
        leanrnn.load(p)(np.ones((2, 3), np.float32))


def test_a_node_naming_more_outputs_than_its_op_makes_is_refused(tmp_path, capsys, oh):
    """Relu -> [a, b]: b passed the load's checks as defined, never got a shape, and the
    first run (and inspect) failed with a bare KeyError('b')."""
    from helpers import fails_in_one_line
    from leanrnn.errors import ModelFormatError

    p = _onnx(tmp_path / "extra.onnx", [oh.make_node("Relu", ["x"], ["a", "b"]),
                                         oh.make_node("Add", ["a", "b"], ["y"])],
              [("x", ["T", "N", 4])])  # fmt: skip
    with pytest.raises(ModelFormatError, match=r"names 2 outputs; the op makes 1 here"):
        leanrnn.load(p)(np.ones((3, 2, 4), np.float32))
    fails_in_one_line(capsys, ["inspect", p], "['b'] would never be computed")


def test_describing_a_graph_evaluates_no_large_shape_computed_tensor(tmp_path, oh):
    """inspect's describe planned by resizing, which filled ConstantOfShape(Shape(x) * k):
    a 170-byte file took 808 MiB to be described. Now it is estimated, not made."""
    import tracemalloc

    from onnx import TensorProto

    p = _onnx(
        tmp_path / "cos.onnx",
        [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Mul", ["s", "k"], ["s2"]),
         oh.make_node("ConstantOfShape", ["s2"], ["z"],
                      value=oh.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
         oh.make_node("Add", ["z", "z"], ["y"])],
        [("x", ["T", "N", 4])], [oh.make_tensor("k", TensorProto.INT64, [3], [1, 1, 1 << 19])],
    )  # fmt: skip
    model = leanrnn.load(p)
    tracemalloc.start()
    info = model.describe(1, 4)  # z: [4, 1, 2**21] float32, 32 MiB
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert info["arena"]["shape_constant_bytes"] >= 2 * 4 * (1 << 21) * 4  # z and y = z + z
    assert peak < 4 << 20, peak
    y = model(np.ones((1, 1, 4), np.float32))  # a run still makes it
    assert y.shape == (1, 1, 1 << 21) and (y == 2).all()


def test_describe_estimates_what_a_resize_makes(tmp_path, oh):
    """describe's figures (GraphSession.estimate, nothing made) are those of a real resize."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    W = numpy_helper.from_array(rng.standard_normal((1, 64, 8)).astype(np.float32), "W")
    R = numpy_helper.from_array(rng.standard_normal((1, 64, 16)).astype(np.float32), "R")
    p = _onnx(tmp_path / "g.onnx", [oh.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=16),
                                    oh.make_node("Relu", ["Y"], ["y"])],
              [("x", ["T", "N", 8])], [W, R])  # fmt: skip
    info = leanrnn.load(p).describe(3, 7)["arena"]
    made = leanrnn.load(p)
    made.resize({"x": (7, 3, 8)})
    sess = made.session
    assert info["graph_arena_bytes"] == sess.arena_bytes > 0
    assert info["rnn_arena_bytes"] == sess.rnn_arena_bytes > 0
    assert info["shape_constant_bytes"] == sess.resize_constant_bytes


def test_a_header_beyond_the_bound_is_not_written(tmp_path, monkeypatch):
    """The reader refuses headers past MAX_HEADER_BYTES: save refuses to write one (it saved,
    and then did not load)."""
    from leanrnn.errors import ModelFormatError
    from leanrnn.formats import native

    monkeypatch.setattr(native, "MAX_HEADER_BYTES", 200)
    with pytest.raises(ModelFormatError, match=r"a \.lrnn file.s may be at most 200"):
        leanrnn.LSTM(3, 4, num_layers=3, seed=0).save(str(tmp_path / "m.lrnn"))
    assert not list(tmp_path.iterdir())


def test_a_header_beyond_the_bound_is_refused_before_it_is_parsed(tmp_path):
    """A 23 MiB header of empty JSON objects peaked at 665 MiB (~30x) under the 64 MiB bound."""
    import struct

    from leanrnn.errors import ModelFormatError
    from leanrnn.formats.native import MAX_HEADER_BYTES

    body = b'{"x":[' + b"{}," * (MAX_HEADER_BYTES // 3) + b"{}]}"
    (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(ModelFormatError, match=r"refusing more than .* bytes of JSON"):
        leanrnn.load(str(tmp_path / "h.safetensors"))


# ------------------------------------------ the command line
def test_run_output_is_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """np.savez wrote straight onto --output: a full disk (here, a write that fails half way)
    left a truncated zip where the previous output was, and the error named no file."""
    from helpers import fails_in_one_line

    leanrnn.LSTM(4, 8, seed=0).save(str(tmp_path / "m.lrnn"))
    np.save(tmp_path / "x.npy", np.zeros((3, 2, 4), np.float32))
    (tmp_path / "out.npz").write_bytes(b"PREVIOUS")

    def savez(path, **arrays):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a zip")
        raise OSError(27, "File too large")

    monkeypatch.setattr(np, "savez", savez)
    fails_in_one_line(capsys, ["run", str(tmp_path / "m.lrnn"), "--input", str(tmp_path / "x.npy"),
                               "--output", str(tmp_path / "out.npz")],
                      "cannot write", "out.npz", "File too large")  # fmt: skip
    assert (tmp_path / "out.npz").read_bytes() == b"PREVIOUS"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.lrnn", "out.npz", "x.npy"]


def test_outputs_named_near_the_file_name_limit_are_written(tmp_path, capsys):
    """The temporary name was the output's plus '.tmpPID.N': past 255 bytes (Errno 36, naming
    a file the user never chose) for a name the file system takes."""
    from leanrnn import cli

    leanrnn.LSTM(4, 8, seed=0).save(str(tmp_path / "m.lrnn"))
    long = tmp_path / ("a" * 250 + ".lrnn")
    assert cli.main(["convert", str(tmp_path / "m.lrnn"), str(long)]) == 0
    assert leanrnn.load(str(long)).spec == leanrnn.load(str(tmp_path / "m.lrnn")).spec
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_plan_refuses_chunk_beside_memory_limit(capsys):
    """--memory-limit picked the chunk (or the segment) and --chunk was dropped in silence."""
    from helpers import fails_in_one_line

    fails_in_one_line(capsys, ["plan", "lstm:64", "--steps", "100", "--chunk", "5",
                               "--memory-limit", "1M"], "--chunk 5 and --memory-limit")  # fmt: skip
    fails_in_one_line(capsys, ["plan", "lstm:64", "--train", "--chunk", "7", "--memory-limit",
                               "30K"], "picks the segment")  # fmt: skip


def test_reduced_precision_of_a_float64_model_is_advised_in_cli_words(tmp_path, capsys):
    from helpers import fails_in_one_line

    leanrnn.GRU(4, 8, seed=0, dtype=np.float64).save(str(tmp_path / "g64.lrnn"))
    fails_in_one_line(capsys, ["convert", str(tmp_path / "g64.lrnn"), str(tmp_path / "o.lrnn"),
                               "--precision", "int8"], "--dtype float32")  # fmt: skip


@pytest.mark.parametrize("argv", [["--cells", "rnn"], ["--engines", "nope"],
                                  ["--precision", "bogus"]])  # fmt: skip
def test_bench_option_errors_are_one_line_like_every_commands(argv, capsys):
    """bench printed 'leanrnn bench: ...' through SystemExit; every other command's errors are
    'leanrnn: error: ...' (the README's promise)."""
    from helpers import fails_in_one_line

    fails_in_one_line(capsys, ["bench", *argv], argv[1])


# ------------------------------------------ interrupted and re-entered runs
def test_an_interrupted_replan_leaves_the_session_to_plan_again(monkeypatch):
    """A KeyboardInterrupt inside a re-plan left the key naming the new shape over the old
    views: every later run of that shape skipped the re-plan (wrong results; past the buffers
    at T=2000, a segfault)."""
    from leanrnn.engine.session import Session

    m = leanrnn.LSTM(4, 16, seed=0)
    rng = np.random.default_rng(0)
    m(rng.standard_normal((6, 3, 4)).astype(np.float32))  # planned for T=6
    x = rng.standard_normal((40, 3, 4)).astype(np.float32)
    real, calls = Session._make_views, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Session, "_make_views", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m(x)
    y, _ = m(x)
    want, _ = leanrnn.LSTM(4, 16, seed=0)(x)
    np.testing.assert_array_equal(y, want)


def _reenter(monkeypatch, cls, outer, inner, x):
    """Run ``outer(x)`` with ``inner(x)`` run from inside it (as a signal handler would, on the
    same thread, from within ``cls._execute``); the inner run's error, and outer's result."""
    import threading

    from leanrnn.errors import LeanRNNError

    real, got = cls._execute, []

    def execute(self, *args, **kwargs):
        if not got:
            got.append(None)
            try:
                inner(x)
            except LeanRNNError as e:
                got[0] = e
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "_execute", execute)
    out = []
    t = threading.Thread(target=lambda: out.append(outer(x)), daemon=True)
    t.start()
    t.join(30)  # a graph's plain lock deadlocked here
    assert out, "the re-entered run hung"
    return got[0], out[0]


@pytest.mark.parametrize("pooled", [False, True], ids=["same model", "pool member"])
def test_a_run_reentered_on_its_own_thread_is_refused(monkeypatch, pooled):
    """The session's re-entrant lock let a signal handler's run in: it overwrote the arena of
    the run it interrupted (wrong results; through a shared Pool, a segfault)."""
    from leanrnn.engine.session import Session

    pool = leanrnn.Pool() if pooled else None
    a = Session(leanrnn.LSTM(4, 16, seed=0).weights, pool=pool)
    b = Session(leanrnn.LSTM(4, 16, seed=1).weights, pool=pool) if pooled else a
    x = np.random.default_rng(0).standard_normal((30, 2, 4)).astype(np.float32)
    err, (y, _, _) = _reenter(monkeypatch, Session, a.run, b.run, x)
    assert err is not None and "run again while its run is in progress" in str(err), err
    np.testing.assert_array_equal(y, leanrnn.LSTM(4, 16, seed=0)(x)[0])
    monkeypatch.undo()
    np.testing.assert_array_equal(b.run(x)[0],
                                  leanrnn.LSTM(4, 16, seed=1 if pooled else 0)(x)[0])  # fmt: skip


def test_a_graph_run_reentered_on_its_own_thread_is_refused_not_deadlocked(monkeypatch,
                                                                           tmp_path, oh):  # fmt: skip
    from leanrnn.engine.graph.session import GraphSession

    p = _onnx(tmp_path / "relu.onnx", [oh.make_node("Relu", ["x"], ["y"])], [("x", ["T", 3])])
    g = leanrnn.load(p)
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    err, y = _reenter(monkeypatch, GraphSession, g, g, x)
    assert err is not None and "GraphModel.run" in str(err), err
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_a_trainer_runs_one_forward_or_backward_at_a_time(monkeypatch):
    """No lock: another thread's forward overwrote the arena a backward was reading, and the
    gradients came out 5-87 off a scale of 272 without an error. Now the forward waits."""
    import threading

    from leanrnn.train import Trainer

    m = leanrnn.LSTM(4, 16, seed=0)
    x = np.random.default_rng(0).standard_normal((8, 3, 4)).astype(np.float32)
    want = Trainer(m.weights)
    want.backward(want.forward(x), np.ones((8, 3, 16), np.float32))
    tr = Trainer(m.weights)
    inside, go, order = threading.Event(), threading.Event(), []
    real = Trainer._backward_segments

    def slow(self, *args):
        inside.set()
        go.wait(10)
        order.append("backward")
        return real(self, *args)

    monkeypatch.setattr(Trainer, "_backward_segments", slow)
    tape = tr.forward(x)
    t = threading.Thread(target=lambda: tr.backward(tape, np.ones((8, 3, 16), np.float32)))
    t.start()
    assert inside.wait(10)
    other = threading.Thread(target=lambda: (tr.forward(x), order.append("forward")))
    other.start()
    other.join(0.3)
    assert other.is_alive() and order == []  # waiting for the backward's turn
    go.set()
    t.join(10)
    other.join(10)
    assert order == ["backward", "forward"]
    for g, w in zip(tr.gradients()[0][0].__dict__.values(),
                    want.gradients()[0][0].__dict__.values(), strict=True):  # fmt: skip
        if g is not None:
            np.testing.assert_array_equal(g, w)


def test_an_interrupted_chunk_leaves_a_streams_state_as_it_was(monkeypatch):
    """The state was both h0 and h_n of the chunk's run, updated layer by layer and chunk by
    chunk: a KeyboardInterrupt part way left some layers advanced and others not."""
    from leanrnn.engine.session import Session

    m = leanrnn.LSTM(4, 16, num_layers=3, seed=0)
    rng = np.random.default_rng(0)
    s = m.stream(2)
    s.feed(rng.standard_normal((5, 2, 4)).astype(np.float32))
    before = s.state
    real, calls = Session._execute, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        real(self, *args, **kwargs)  # the chunk runs, writing its final states ...
        raise KeyboardInterrupt  # ... and is interrupted before feed returns

    monkeypatch.setattr(Session, "_execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.feed(rng.standard_normal((7, 2, 4)).astype(np.float32))
    assert calls
    for a, b in zip(s.state, before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert s.steps == 5


@pytest.mark.parametrize("what", ["session", "stream", "pool"])
def test_sessions_streams_and_pools_say_they_cannot_be_pickled(what):
    """pickle and copy said "cannot pickle '_thread.RLock' object"."""
    import copy
    import pickle

    m = leanrnn.GRU(3, 4, seed=0)
    obj = {"session": m.session, "stream": m.stream(1), "pool": leanrnn.Pool()}[what]
    for f in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied .* lock\); "):
            f(obj)
