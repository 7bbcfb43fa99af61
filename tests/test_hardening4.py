"""Hardening, fourth pass: reduced-precision models (bf16, int8, int8-dynamic) and their files,
copies of models, paths and checkpoints a new user hands over, and the CLI in a pipe. Each test
failed before its fix; each bad call gives a clear leanrnn error and leaves things usable."""

from __future__ import annotations

import copy
import os
import pickle

import numpy as np
import pytest

import leanrnn
from leanrnn import cli
from leanrnn.errors import DTypeError, LeanRNNError, ModelFormatError

PRECISIONS = ("bf16", "int8", "int8-dynamic")


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).standard_normal((4, 3, 5)).astype(np.float32)


# ------------------------------------------------ copies keep the one aligned weight buffer
def _one_buffer(pw) -> bool:
    """Every packed tensor a 64-byte-aligned view into ``pw.buffer`` (what the engine and the
    native writer rely on)."""
    return all(
        np.shares_memory(pw.buffer, v) and v.ctypes.data % 64 == 0
        for v in pw.tensors().values()
        if v.size
    )


_COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
}


@pytest.mark.parametrize("how", sorted(_COPIES))
@pytest.mark.parametrize("precision", ["float", *PRECISIONS])
def test_copied_weights_stay_one_aligned_buffer_and_save(how, precision, x, tmp_path):
    # before: each view was copied on its own, out of the buffer and unaligned, and saving the
    # copy failed with "tensor l0.d0.Wt would leave a hole at byte 0"
    m = leanrnn.GRU(5, 20, num_layers=2, seed=0)
    if precision != "float":
        m = leanrnn.quantize(m, precision)
    w = _COPIES[how](m.weights)
    # a shallow copy shares the bytes (serve swaps the spec of one), the others have their own
    assert w is not m.weights
    assert np.shares_memory(w.buffer, m.weights.buffer) == (how == "copy")
    assert _one_buffer(w) and w.precision == m.weights.precision
    np.testing.assert_array_equal(w.buffer, m.weights.buffer)
    back = leanrnn.load(leanrnn.GRU._from_packed(w).save(str(tmp_path / "c.lrnn")))
    np.testing.assert_array_equal(back(x)[0], m(x)[0])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_models_deepcopy_and_pickle(how, x):
    # before: TypeError: cannot pickle '_thread.RLock' object (the session's lock)
    m = leanrnn.quantize(leanrnn.LSTM(5, 16, batch_first=True, seed=0, threads=1), "int8")
    c = _COPIES[how](m)
    assert type(c) is leanrnn.LSTM and c.session is not m.session
    assert c.session.threads == 1 and c.spec == m.spec and c.weights.precision == "int8"
    np.testing.assert_array_equal(c(x)[0], m(x)[0])


# ------------------------------------------------ astype keeps the precision it was given
@pytest.mark.parametrize("precision", PRECISIONS)
def test_astype_float32_keeps_reduced_weights(precision, x, tmp_path):
    # before: astype(np.float32) (and load(..., dtype=np.float32)) silently dequantized the
    # panels into a float model: 2-4x the weight bytes, other kernels, other outputs
    q = leanrnn.quantize(leanrnn.LSTM(5, 16, seed=0, threads=1), precision)
    a = q.astype(np.float32)
    assert a.weights.precision == precision and a.session.threads == 1
    assert not np.shares_memory(a.weights.buffer, q.weights.buffer)
    np.testing.assert_array_equal(a(x)[0], q(x)[0])
    path = q.save(str(tmp_path / "q.lrnn"))
    assert leanrnn.load(path, dtype=np.float32).weights.precision == precision


@pytest.mark.parametrize("precision", PRECISIONS)
def test_astype_float64_of_reduced_weights_is_refused_by_name(precision, x, tmp_path):
    q = leanrnn.quantize(leanrnn.LSTM(5, 16, seed=0), precision)
    with pytest.raises(DTypeError, match=rf"{precision}.*float64.*state_dict"):
        q.astype(np.float64)
    path = q.save(str(tmp_path / "q.lrnn"))
    with pytest.raises(DTypeError, match=precision):
        leanrnn.load(path, dtype=np.float64)
    q(x)  # still runs


# ------------------------------------------------ paths: what comes in is named
@pytest.mark.parametrize("bad", [None, 3, 2.5, ["m.lrnn"]])
@pytest.mark.parametrize("op", ["load", "convert"])
def test_a_path_that_is_not_a_path_is_named(op, bad, tmp_path):
    # before: TypeError: expected str, bytes or os.PathLike object, not int
    call = {"load": lambda: leanrnn.load(bad),
            "convert": lambda: leanrnn.convert(bad, str(tmp_path / "o.lrnn"))}[op]  # fmt: skip
    with pytest.raises(ModelFormatError, match=rf"\[{op}\] .*{type(bad).__name__}.*path"):
        call()


def test_a_bytes_path_loads_like_a_str_path(tmp_path, x):
    # before: AttributeError: 'bytes' object has no attribute 'seek'
    m = leanrnn.GRU(5, 8, seed=0)
    path = m.save(str(tmp_path / "m.lrnn"))
    np.testing.assert_array_equal(leanrnn.load(path.encode())(x)[0], m(x)[0])
    leanrnn.convert(path.encode(), str(tmp_path / "o.lrnn").encode())
    assert leanrnn.load(str(tmp_path / "o.lrnn")).spec == m.spec


# ------------------------------------------------ the file's content decides, not its name
def test_a_torch_checkpoint_named_safetensors_loads(tmp_path, x):
    # before: torch.load picks its safetensors reader by the name: "SafetensorError: Error
    # while deserializing header: header too large" for a good checkpoint
    torch = pytest.importorskip("torch")
    module = torch.nn.GRU(5, 8)
    path = tmp_path / "gru.safetensors"
    torch.save(module.state_dict(), path)
    got = leanrnn.load(path)(x)[0]
    want = leanrnn.from_torch(module)(x)[0]
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------ the CLI in a pipe that closes early
@pytest.mark.parametrize("argv", [["inspect"], ["plan", "--batch", "2", "--steps", "3"]])
def test_output_into_a_closed_pipe_is_not_an_error(argv, monkeypatch, capsys, tmp_path):
    # `leanrnn inspect m.lrnn | head -1` once head has exited. Before: "leanrnn: error:
    # BrokenPipeError: [Errno 32] Broken pipe" (or, for output smaller than the buffer,
    # "Exception ignored ... BrokenPipeError" at exit)
    path = leanrnn.GRU(5, 8, seed=0).save(str(tmp_path / "m.lrnn"))
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr("sys.stdout", out)
    rc = cli.main([argv[0], path, *argv[1:]])
    out.close()  # what the interpreter does at exit: nothing left to fail
    assert capsys.readouterr().err == ""
    assert rc == cli.EXIT_BROKEN_PIPE


def test_bad_input_still_fails_after_a_closed_pipe(capsys, tmp_path):
    assert cli.main(["inspect", str(tmp_path / "none.lrnn")]) == 1
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------ leanrnn bench: options that select nothing
@pytest.mark.parametrize(
    "argv,words",
    [
        (["--precision", ","], ["--precision", "comma list"]),
        (["--engines", ","], ["--engines", "comma list"]),
        (["--cells", " , "], ["--cells", "comma list"]),
        (["--precision", "bf16", "--engines", "torch"], ["bf16", "torch", "leanrnn"]),
    ],
)
def test_bench_options_that_select_nothing_are_refused(argv, words, tmp_path, capsys):
    # before: an empty list meant the default suite, and bf16 with only torch ran no engine and
    # wrote an empty report over --out
    from leanrnn.bench.cli import options_from_args

    parser = cli.build_parser()
    # a usage error (argparse's exit 2), or the bench's own one-line error
    with pytest.raises((SystemExit, leanrnn.errors.LeanRNNError)) as e:
        options_from_args(parser.parse_args(["bench", *argv, "--out", str(tmp_path)]))
    msg = str(e.value) + capsys.readouterr().err
    assert getattr(e.value, "code", 1) != 0
    for w in words:
        assert w in msg, (w, msg)
    assert not any(tmp_path.iterdir())


# ------------------------------------------------ streams past the machine's memory
def test_a_stream_past_the_machines_memory_is_a_plan_error(x):
    # before: numpy's MemoryError "Unable to allocate 32.0 TiB" from the state arrays
    m = leanrnn.LSTM(5, 8, seed=0)
    with pytest.raises(LeanRNNError, match=r"\[Session.stream\].*batch=1099511627776"):
        m.stream(batch=1 << 40)
    m.stream(batch=2).feed(np.ascontiguousarray(x[:, :2]))


# ------------------------------------------------ int8-dynamic files: checked without copies
def _int8d_file(tmp_path, edit=None) -> str:
    m = leanrnn.quantize(leanrnn.LSTM(128, 128, num_layers=2, seed=0), "int8-dynamic")
    if edit:
        edit(m.weights.layers[1][0].Rt)
    return leanrnn.save(m, str(tmp_path / "q.lrnn"))


def test_int8_dynamic_load_checks_its_codes_in_place(tmp_path):
    # before: the check widened every panel to int16 and int32 first: a load's peak was
    # 2.5x the file beyond the weights themselves (and 3x the time of a float32 file)
    from helpers import traced_peak

    path = _int8d_file(tmp_path)
    size = os.path.getsize(path)
    with traced_peak() as mem:
        w = leanrnn.formats.native.load(path)
    assert w.precision == "int8-dynamic"
    assert mem.peak < 1.5 * size, (mem.peak, size)


@pytest.mark.parametrize("where", ["last group", "past it"])
def test_int8_dynamic_codes_past_a_panels_inputs_are_refused(tmp_path, where):
    """Codes for inputs K.. (the padding; K = 19 here: inputs 19 and 20.. of Rt) with
    corrections that match them: the kernels multiply the last group's padding by scratch
    bytes nobody writes, and the VNNI / AMX corrections would count codes never summed."""
    from leanrnn.formats.quantize import _dot_corrections, dot_codes

    m = leanrnn.quantize(leanrnn.GRU(5, 19, seed=0), "int8-dynamic")
    panel = m.weights.layers[0][0].Rt
    X4 = panel.shape[1] - 2
    by_input = panel[:, :X4].view(np.int8).reshape(panel.shape[0], X4, -1, 4)
    if where == "last group":
        by_input[1, 19 // 4, 2, 19 % 4] = 5  # input 19 of column 2 (group 4 holds 16..19)
    else:
        assert X4 > 5  # a whole group of padding exists
        by_input[0, 5, 0, 0] = -7  # input 20
    corr = _dot_corrections(dot_codes(panel)[0])
    panel[:, X4 + 1] = corr.view(np.uint8).reshape(panel.shape[0], -1)
    path = leanrnn.save(m, str(tmp_path / "q.lrnn"))
    with pytest.raises(ModelFormatError, match=r"layer 0 direction 0 Rt.*past its 19 inputs"):
        leanrnn.load(path)


def test_int8_dynamic_code_minus_128_is_refused_even_with_matching_corrections(tmp_path):
    from leanrnn.formats.quantize import _dot_corrections, dot_codes

    def edit(panel):
        X4 = panel.shape[1] - 2
        codes = panel[:, :X4].view(np.int8)
        codes[0, 0, 0] = -128  # the one code whose absolute value int8 cannot hold
        corr = _dot_corrections(dot_codes(panel)[0])  # consistent with the bad codes
        panel[:, X4 + 1] = corr.view(np.uint8).reshape(panel.shape[0], -1)

    with pytest.raises(ModelFormatError, match=r"layer 1 direction 0 Rt.*\+-127"):
        leanrnn.load(_int8d_file(tmp_path, edit))


# ------------------------------------------------ quantizing graphs: say what was made
def _onnx_lstm(tmp_path, weights_as_inputs: bool, name: str) -> str:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    C, H = 3, 4
    rng = np.random.default_rng(0)
    W = rng.standard_normal((1, 4 * H, C)).astype(np.float32)
    R = rng.standard_normal((1, 4 * H, H)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", C])]
    inits = []
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
               for k, v in (("W", W), ("R", R))]  # fmt: skip
    else:
        inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")]
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, name="lstm")
    y = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    m = helper.make_model(helper.make_graph([node], "g", inputs, y, inits),
                          opset_imports=[helper.make_opsetid("", 14)])  # fmt: skip
    m.ir_version = 8
    path = str(tmp_path / name)
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("precision", PRECISIONS)
def test_quantizing_a_graph_without_stored_rnn_weights_is_refused(precision, tmp_path, capsys):
    # before: quantize() returned the float graph and `convert --precision int8` wrote it,
    # "wrote w8.lrnn", a float32 model the user took for an int8 one
    path = _onnx_lstm(tmp_path, weights_as_inputs=True, name="w.onnx")
    with pytest.raises(DTypeError, match=rf"\[quantize\].*{precision}.*'lstm'.*graph inputs"):
        leanrnn.quantize(leanrnn.load(path), precision)
    out = str(tmp_path / "w8.lrnn")
    assert cli.main(["convert", path, out, "--precision", precision]) == 1
    assert "[convert]" in capsys.readouterr().err and not os.path.exists(out)


def test_inspect_of_a_converted_onnx_model_names_its_precision(tmp_path, capsys):
    # the README's `leanrnn convert model.onnx m.int8d.lrnn --precision int8-dynamic` then
    # `leanrnn inspect m.int8d.lrnn  # "weight precision: int8-dynamic (...)"`: graphs printed
    # no such line; and an output of unknown shape printed as "Y float32None"
    src = _onnx_lstm(tmp_path, weights_as_inputs=False, name="m.onnx")
    dst = str(tmp_path / "m.int8d.lrnn")
    assert cli.main(["convert", src, dst, "--precision", "int8-dynamic"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", dst]) == 0
    out = capsys.readouterr().out
    assert "weight precision: int8-dynamic (W and R panels: " in out, out
    assert "None" not in out and "Y float32[shape unknown]" in out, out


def test_a_graph_converted_with_reduce_range_runs_its_7_bit_codes(tmp_path, capsys):
    """`convert --precision int8-dynamic --reduce-range` of an ONNX graph: inspect names the
    7-bit codes (per node too), and the graph runs what the same Model quantized so runs."""
    from leanrnn.formats.quantize import weight_bits

    src = _onnx_lstm(tmp_path, weights_as_inputs=False, name="m.onnx")
    dst = str(tmp_path / "m.int8d7.lrnn")
    assert cli.main(["convert", src, dst, "--precision", "int8-dynamic", "--reduce-range"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", dst]) == 0
    out = capsys.readouterr().out
    assert "weight precision: int8-dynamic, 7-bit codes (W and R panels: " in out, out
    assert "int8-dynamic, 7-bit codes weights:" in out, out
    g = leanrnn.load(dst)
    (pw,) = g.graph.packed.values()
    assert weight_bits(pw) == 7
    want = leanrnn.quantize(leanrnn.Model(leanrnn.load(src).graph.packed["lstm"]),
                            "int8-dynamic", reduce_range=True)  # fmt: skip
    x = np.random.default_rng(3).standard_normal((6, 2, 3)).astype(np.float32)
    np.testing.assert_array_equal(g(x)[:, 0], want(x)[0])  # Y [T, directions, N, H]


def test_quantizing_a_float64_graph_gives_advice_a_graph_can_follow(tmp_path):
    # before: "convert the model to float32 first (model.astype(np.float32))": a GraphModel
    # has no astype
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    W, R = rng.standard_normal((1, 16, 3)), rng.standard_normal((1, 16, 4))
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=4, name="lstm")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [2, 1, 3])],
                          [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, None)],
                          [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")])  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "f64.onnx"))
    model = leanrnn.load(str(tmp_path / "f64.onnx"))
    with pytest.raises(DTypeError, match=r"'lstm'.*float64.*export the model in float32") as e:
        leanrnn.quantize(model, "int8")
    assert "astype" not in str(e.value)


# ------------------------------------------------ load options: checked, never ignored
@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("load_options")
    m = leanrnn.LSTM(5, 8, num_layers=2, seed=0)
    np.savez(d / "sd.npz", **m.state_dict())
    return {"lrnn": m.save(str(d / "m.lrnn")), "npz": str(d / "sd.npz"),
            "graph": _graph_file(d)}  # fmt: skip


def _graph_file(d) -> str:
    path = _onnx_lstm(d, weights_as_inputs=False, name="g.onnx")
    return leanrnn.load(path).save(str(d / "g.lrnn"))


@pytest.mark.parametrize("kind", ["lrnn", "npz", "graph"])
@pytest.mark.parametrize(
    "kw,words",
    [
        ({"threads": 0}, ["threads=0"]),
        ({"threads": 2.5}, ["threads=2.5"]),
        ({"verify": "no"}, ["verify='no'"]),
        ({"dtype": "foo"}, ["dtype='foo'", "float32"]),
        ({"dtype": np.int8}, ["int8", "float32"]),
    ],
)
def test_load_options_are_checked_for_every_kind_of_file(model_files, kind, kw, words):
    # before: threads=0 or 2.5 loaded a graph (failing at its first run, as [Session]),
    # dtype='foo' was numpy's TypeError, verify='no' meant True
    with pytest.raises(LeanRNNError) as e:
        leanrnn.load(model_files[kind], **kw)
    assert str(e.value).startswith("[load]"), e.value
    for w in words:
        assert w in str(e.value), (w, e.value)


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("lrnn", {"batch_first": True}),
        ("lrnn", {"cell": "gru"}),
        ("lrnn", {"prefix": "enc."}),
        ("lrnn", {"nonlinearity": "relu"}),
        ("graph", {"batch_first": True}),
        ("graph", {"dtype": np.float64}),
    ],
)
def test_state_dict_options_are_not_ignored_for_files_that_record_the_model(
    model_files, kind, kw, x
):
    # before: load("m.lrnn", batch_first=True) returned the time-major model, which then read
    # [N, T, C] input as [T, N, C]; a graph ignored dtype=np.float64
    with pytest.raises(ModelFormatError, match=rf"\[load\] {next(iter(kw))}=.*state dicts"):
        leanrnn.load(model_files[kind], **kw)
    # what agrees with the file is fine
    assert leanrnn.load(model_files["lrnn"], batch_first=False, cell="lstm").spec.num_layers == 2


@pytest.mark.parametrize(
    "kw,words", [({"cell": "foo"}, ["cell='foo'", "'lstm'"]), ({"prefix": 3}, ["prefix=3", "str"]),
                 ({"nonlinearity": "relu"}, ["'relu'", "LSTM", "only an RNN"])],
)  # fmt: skip
def test_state_dict_options_are_checked(model_files, kw, words):
    # before: KeyError 'foo'; TypeError from str.startswith; relu silently ignored for an LSTM
    with pytest.raises(LeanRNNError) as e:
        leanrnn.load(model_files["npz"], **kw)
    for w in words:
        assert w in str(e.value), (w, e.value)


# ------------------------------------------------ saving: the path is a path
@pytest.mark.parametrize("kind", ["stack", "graph"])
def test_save_to_what_is_not_a_file_path_is_refused_and_writes_nothing(
    kind, model_files, tmp_path, monkeypatch
):
    # before: save(None) wrote a file named 'None', save(3) one named '3', save(b'm.lrnn') one
    # named "b'm.lrnn'"; a missing directory was FileNotFoundError naming 'x.lrnn.tmp<pid>'
    monkeypatch.chdir(tmp_path)
    m = leanrnn.load(model_files["lrnn" if kind == "stack" else "graph"])
    for bad, words in [(None, ["NoneType", "path"]), (3, ["int", "path"]),
                       (str(tmp_path / "no" / "m.lrnn"), ["does not exist"]),
                       (str(tmp_path), ["is a directory"])]:  # fmt: skip
        with pytest.raises(ModelFormatError, match=r"\[save\]") as e:
            m.save(bad)
        for w in words:
            assert w in str(e.value), (w, e.value)
    assert sorted(os.listdir(tmp_path)) == []
    m.save(b"m.lrnn")
    assert os.listdir(tmp_path) == ["m.lrnn"]


# ------------------------------------------------ streams: slots and states by name
@pytest.mark.parametrize("i", [True, 1.0, [0, 1], "0", 2, -3])
def test_stream_reset_of_what_is_not_a_slot_is_a_shape_error(i):
    # before: True reset slot 1, 1.0 was numpy's IndexError, [0, 1] a TypeError
    st = leanrnn.GRU(5, 8, seed=0).stream(batch=2)
    with pytest.raises(leanrnn.errors.ShapeError, match=r"\[Stream.reset\].*expected an int"):
        st.reset(i)
    st.reset(-1)  # a slot counted from the end, as numpy indexes


@pytest.mark.parametrize("value", ["abc", np.zeros((1, 2, 8), np.float32), (1, 2, 3)])
def test_stream_state_of_what_is_not_a_state_is_a_shape_error(value, x):
    # before: "abc" and a bare array were ValueError: too many values to unpack
    st = leanrnn.LSTM(5, 8, seed=0).stream(batch=3)
    with pytest.raises(leanrnn.errors.ShapeError, match=r"\[Stream.state\].*\(h, c\)"):
        st.state = value
    st.state = st.state
    st.feed(x)


# ------------------------------------------------ two threads writing one path
def test_two_threads_saving_to_one_path_both_succeed(tmp_path):
    # before: both wrote the temp file '<path>.tmp<pid>'; the second rename found it gone
    # (FileNotFoundError), or moved a mix of the two models
    import threading

    models = [leanrnn.LSTM(5, 16, seed=0), leanrnn.GRU(5, 8, seed=1)]
    path = str(tmp_path / "m.lrnn")
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(m):
        barrier.wait()
        for _ in range(40):
            try:
                m.save(path)
            except Exception as e:
                errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    assert leanrnn.load(path).spec in (m.spec for m in models)
    assert os.listdir(tmp_path) == ["m.lrnn"]


def test_score_writers_take_a_temp_name_of_their_own():
    # the same class in leanrnn.score's writers: '.o.npz.tmp-<pid>' was one name for every
    # writer of that output in the process (two threads scoring into one file collided)
    from leanrnn.score.writers import temp_name

    assert temp_name("o.npz") != temp_name("o.npz")


# ------------------------------------------------ the model protocol: nothing dropped in silence
def test_model_run_with_more_inputs_than_it_takes_is_refused(x):
    # before: a fifth positional input was dropped by zip without a word
    m = leanrnn.LSTM(5, 8, seed=0)
    with pytest.raises(
        leanrnn.errors.ShapeError, match=r"\[LSTM.run\] 5 inputs; expected at most 4"
    ):
        m.run([x, None, None, None, x])
    assert len(m.run([x])) == 3


@pytest.mark.parametrize(
    "shapes", [5, {"x": (3, 2, 6)}, [(3, 2, 6)], {"x": (3, 2, 5), "y": (1,)}, {"x": None}]
)
def test_model_resize_checks_what_it_plans_for(shapes, x):
    # before: resize(5) was TypeError: 'int' object is not iterable; C=6 for a C=5 model and
    # an unknown input name planned without a word
    m = leanrnn.LSTM(5, 8, seed=0)
    with pytest.raises(leanrnn.errors.ShapeError, match=r"\[LSTM.resize\]"):
        m.resize(shapes)
    m.resize({"x": (4, 3, 5), "lengths": (3,)})
    m(x)


# ------------------------------------------------ leanrnn.score: arguments by name
@pytest.mark.parametrize(
    "kw,words",
    [
        ({"batch_size": 0}, ["batch_size=0"]),
        ({"batch_size": 2.5}, ["batch_size=2.5"]),
        ({"memory_limit": True}, ["memory_limit=True"]),
        ({"memory_limit": "1M"}, ["memory_limit='1M'"]),
        ({"bucket": "no"}, ["bucket='no'", "True or False"]),
        ({"allow_nonfinite": "yes"}, ["allow_nonfinite='yes'"]),
    ],
)
def test_score_arguments_are_checked_by_name(kw, words, tmp_path):
    # before: batch_size=0 meant "choose", 2.5 and True were truncated, memory_limit='1M' was
    # int()'s ValueError, bucket='no' meant True
    src = tmp_path / "x.npy"
    np.save(src, np.ones((2, 3, 5), np.float32))
    m = leanrnn.quantize(leanrnn.GRU(5, 8, seed=0), "int8-dynamic")
    with pytest.raises(LeanRNNError, match=r"\[score\]") as e:
        leanrnn.score(m, str(src), str(tmp_path / "o.npz"), **kw)
    for w in words:
        assert w in str(e.value), (w, e.value)
    assert sorted(os.listdir(tmp_path)) == ["x.npy"]


@pytest.mark.parametrize("which", ["dataset", "output"])
def test_score_paths_that_are_not_paths_are_named(which, tmp_path):
    # before: TypeError: expected str, bytes or os.PathLike object, not NoneType
    src = tmp_path / "x.npy"
    np.save(src, np.ones((2, 3, 5), np.float32))
    args = {"dataset": str(src), "output": str(tmp_path / "o.npz"), which: None}
    with pytest.raises(LeanRNNError, match=rf"\[score\] {which} is a NoneType"):
        leanrnn.score(leanrnn.GRU(5, 8, seed=0), args["dataset"], args["output"])


# ------------------------------------------------ LEANRNN_LOG: a typo is reported like the others
def test_an_unknown_log_topic_is_reported_like_every_bad_variable(monkeypatch):
    # before: LEANRNN_LOG=memroy logged nothing, without a word
    from leanrnn import config

    monkeypatch.setenv("LEANRNN_LOG", "memory,memroy")
    with pytest.raises(LeanRNNError, match=r"LEANRNN_LOG='memory,memroy'.*'memory'"):
        config.check_env(reread=True)
    monkeypatch.setenv("LEANRNN_LOG", "Memory")
    config.check_env(reread=True)
    with pytest.raises(LeanRNNError, match=r"\[set_log\] unknown topics \['memroy'\]"):
        config.set_log("memroy")


def test_a_state_dict_of_mixed_dtypes_is_not_rounded_in_silence(tmp_path):
    # before: one float64 tensor among float32 ones was rounded to float32 without a word
    sd = leanrnn.LSTM(5, 8, seed=0).state_dict()
    sd["weight_hh_l0"] = sd["weight_hh_l0"].astype(np.float64)
    with pytest.raises(DTypeError, match=r"\['weight_hh_l0'\] are float64.*dtype="):
        leanrnn.from_state_dict(sd)
    np.savez(tmp_path / "sd.npz", **sd)
    with pytest.raises(DTypeError, match="weight_hh_l0"):
        leanrnn.load(str(tmp_path / "sd.npz"))
    assert leanrnn.load(str(tmp_path / "sd.npz"), dtype=np.float64).dtype == np.float64


# ------------------------------------------------ the CLI can say what a state dict cannot
def test_cli_takes_the_state_dict_options_its_errors_ask_for(tmp_path, capsys, x):
    # before: "pass prefix='enc.' to load just the RNN", but convert/run/inspect had no way to
    # pass it (nor batch_first: a batch-first checkpoint became a time-major .lrnn)
    m = leanrnn.LSTM(5, 8, seed=0)
    sd = {f"enc.{k}": v for k, v in m.state_dict().items()}
    sd["head.weight"] = np.zeros((2, 8), np.float32)
    src, dst = str(tmp_path / "full.npz"), str(tmp_path / "enc.lrnn")
    np.savez(src, **sd)
    assert cli.main(["convert", src, dst]) == 1
    assert "--prefix enc." in capsys.readouterr().err
    assert cli.main(["convert", src, dst, "--prefix", "enc.", "--batch-first"]) == 0
    back = leanrnn.load(dst)
    assert back.spec.batch_first
    xb = np.ascontiguousarray(x.transpose(1, 0, 2))
    np.testing.assert_array_equal(back(xb)[0], m(x)[0].transpose(1, 0, 2))
    assert cli.main(["inspect", src, "--prefix", "enc."]) == 0
    np.save(tmp_path / "x.npy", x)
    assert cli.main(["run", src, "--prefix", "enc.", "--input", str(tmp_path / "x.npy")]) == 0


def test_cli_score_takes_the_state_dict_options_too(tmp_path, capsys):
    m = leanrnn.GRU(5, 8, seed=0)
    src = str(tmp_path / "full.npz")
    np.savez(src, **{f"enc.{k}": v for k, v in m.state_dict().items()}, head=np.zeros(2))
    np.save(tmp_path / "x.npy", np.ones((2, 3, 5), np.float32))
    out = str(tmp_path / "o.npz")
    assert (
        cli.main(["score", src, str(tmp_path / "x.npy"), out, "--prefix", "enc.", "--quiet"]) == 0
    )
    assert np.load(out)["h_n"].shape == (2, 1, 8)
    capsys.readouterr()
    argv = ["score", src, str(tmp_path / "x.npy"), src, "--prefix", "enc.", "--quiet"]
    assert cli.main(argv) == 1
    assert "the model file itself" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # before: --ray-actors 0 and -5 were accepted
        cli.main(["score", src, str(tmp_path / "x.npy"), out, "--ray-actors", "0"])
