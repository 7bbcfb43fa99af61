"""Hardening, fifth pass: the ``leanrnn`` command against a red team's files and flags. Each
test failed before its fix; each bad call is one line (``leanrnn: error: ...``), names the file
or the flag, and writes nothing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import leanrnn
from helpers import fails_in_one_line
from leanrnn import cli
from leanrnn.errors import LeanRNNError, ModelFormatError


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("h5")
    m = leanrnn.LSTM(4, 8, seed=0)
    leanrnn.save(m, str(d / "m.lrnn"))
    np.savez(d / "sd.npz", **m.state_dict())
    np.save(d / "x.npy", np.zeros((3, 2, 4), np.float32))  # run: [T, N, C]
    np.save(d / "sx.npy", np.zeros((2, 3, 4), np.float32))  # score: [N, T, C]
    np.savez(d / "inp.npz", x=np.zeros((3, 2, 4), np.float32))
    # a .npy header whose text never closes its tuple: np's parser raised tokenize.TokenError
    hdr = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3"
    hdr += b" " * ((-(10 + len(hdr) + 1)) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr + b"\0" * 48
    (d / "tokerr.npy").write_bytes(npy)
    with zipfile.ZipFile(d / "tokerr.npz", "w") as z:
        z.writestr("x.npy", npy)
    return d


def _bytes(*paths) -> list[bytes]:
    return [open(p, "rb").read() for p in paths]


# ------------------------------------------------------- 1: an unterminated .npy header
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "{d}/m.lrnn", "--input", "{d}/tokerr.npy"],
        ["run", "{d}/m.lrnn", "--input", "{d}/tokerr.npz"],
        ["run", "{d}/m.lrnn", "--input", "{d}/x.npy", "--lengths", "{d}/tokerr.npy"],
        ["score", "{d}/m.lrnn", "{d}/tokerr.npy", "{d}/out.npz"],
        ["score", "{d}/m.lrnn", "{d}/tokerr.npz", "{d}/out.npz"],
    ],
)
def test_unterminated_npy_header_is_one_line_naming_the_file(argv, d, capsys):
    # before: tokenize.TokenError ('EOF in multi-line statement') with a traceback
    fails_in_one_line(capsys, [a.format(d=d) for a in argv], "tokerr.np", "not a readable")
    assert not (d / "out.npz").exists()


# --------------------------------------------------- 2: an output that is one of the inputs
def test_run_output_that_is_the_model_or_the_input_is_refused(d, tmp_path, capsys):
    # before: np.savez replaced the state dict / the inputs with the outputs
    sd, inp = tmp_path / "sd.npz", tmp_path / "inp.npz"
    sd.write_bytes((d / "sd.npz").read_bytes())
    inp.write_bytes((d / "inp.npz").read_bytes())
    os.symlink(sd, tmp_path / "link.npz")
    before = _bytes(sd, inp)
    fails_in_one_line(capsys, ["run", str(sd), "--input", str(d / "x.npy"), "--output", str(sd)],
                      "sd.npz", "model")  # fmt: skip
    fails_in_one_line(capsys, ["run", str(sd), "--input", str(d / "x.npy"), "--output",
                               str(tmp_path / "link.npz")], "link.npz", "model")  # fmt: skip
    fails_in_one_line(capsys, ["run", str(d / "m.lrnn"), "--input", str(inp), "--output",
                               str(tmp_path / "inp")], "inp", "input")  # fmt: skip
    assert _bytes(sd, inp) == before
    assert cli.main(["run", str(sd), "--input", str(inp), "--output", str(tmp_path / "y")]) == 0


def test_convert_onto_its_own_input_is_refused(d, tmp_path, capsys):
    # before: `leanrnn convert v.lrnn v.lrnn --precision int8` replaced the original
    v = tmp_path / "v.lrnn"
    v.write_bytes((d / "m.lrnn").read_bytes())
    os.link(v, tmp_path / "hard.lrnn")
    os.symlink(v, tmp_path / "soft.lrnn")
    before = v.read_bytes()
    for dst in ("v.lrnn", "hard.lrnn", "soft.lrnn"):
        fails_in_one_line(capsys, ["convert", str(v), str(tmp_path / dst), "--precision", "int8"],
                          dst, "input")  # fmt: skip
    assert v.read_bytes() == before
    assert cli.main(["convert", str(v), str(tmp_path / "q.lrnn"), "--precision", "int8"]) == 0


# ------------------------------------------------------------- 3: FIFOs among the inputs
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_score_refuses_a_fifo_instead_of_waiting_for_a_writer(d, tmp_path):
    # before: a FIFO named a.npy in the input directory hung forever (opened for reading with
    # no writer); the FIFO itself as INPUT was reported as "does not exist"
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "a.npy")
    for inp in (tmp_path / "data", tmp_path / "data" / "a.npy"):
        r = subprocess.run(
            [sys.executable, "-m", "leanrnn", "score", str(d / "m.lrnn"), str(inp),
             str(tmp_path / "o.npz"), "--quiet"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "a.npy" in lines[0] and "is not a regular file" in lines[0], lines[0]
    assert not (tmp_path / "o.npz").exists()


# ------------------------------------------- 4, 5: state-dict options on every loading command
@pytest.fixture(scope="module")
def multi(d):
    # an encoder LSTM next to a head, as in a whole model's state dict
    sd = {f"enc.{k}": v for k, v in leanrnn.LSTM(4, 8, seed=0).state_dict().items()}
    sd |= {"head.weight": np.ones((2, 8), np.float32), "head.bias": np.zeros(2, np.float32)}
    np.savez(d / "multi.npz", **sd)
    return d / "multi.npz"


def test_plan_and_tune_take_the_state_dict_options(multi, capsys):
    # before: "unrecognized arguments: --prefix enc." although the load error asked for it
    fails_in_one_line(capsys, ["plan", str(multi), "--batch", "1", "--steps", "2"], "--prefix")
    assert cli.main(["plan", str(multi), "--batch", "1", "--steps", "2", "--prefix", "enc."]) == 0
    assert "LSTM C=4 H=8" in capsys.readouterr().out
    assert cli.main(["tune", str(multi), "--prefix", "enc.", "--max-batch", "2",
                     "--max-chunk", "1", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["batch"] >= 1
    fails_in_one_line(capsys, ["plan", "lstm:8", "--prefix", "enc."], "--prefix", "lstm:8")


def test_serve_takes_the_state_dict_options(multi, monkeypatch):
    pytest.importorskip("uvicorn")
    from leanrnn.serve import server

    seen = {}

    async def fake(config, loaded=None, ready_line=print, **kw):
        # loaded once the port is bound (serve_async calls it): a taken port fails first
        seen["loaded"] = loaded() if callable(loaded) else loaded

    monkeypatch.setattr(server, "serve_async", fake)
    assert cli.main(["serve", f"enc={multi}", "--prefix", "enc.", "--no-grpc"]) == 0
    assert seen["loaded"]["enc"].spec.hidden_size == 8


def test_float16_state_dict_loads_with_dtype_option(d, tmp_path, capsys):
    # before: "pass dtype=np.float32 or np.float64" and no way to do that on the command line
    sd = {k: v.astype(np.float16) for k, v in leanrnn.LSTM(4, 8, seed=0).state_dict().items()}
    np.savez(tmp_path / "f16.npz", **sd)
    line = fails_in_one_line(capsys, ["convert", str(tmp_path / "f16.npz"),
                                      str(tmp_path / "o.lrnn")], "float16")  # fmt: skip
    assert "--dtype float32" in line
    assert cli.main(["convert", str(tmp_path / "f16.npz"), str(tmp_path / "o.lrnn"),
                     "--dtype", "float32"]) == 0  # fmt: skip
    assert leanrnn.load(str(tmp_path / "o.lrnn")).dtype == np.float32
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "f16.npz"), "--dtype", "float64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float64"
    line = fails_in_one_line(capsys, ["score", str(tmp_path / "f16.npz"), str(d / "sx.npy"),
                                      str(tmp_path / "s.npz"), "--quiet"], "float16")  # fmt: skip
    assert "--dtype" in line


# ------------------------------------------------------------------ 6: bench's inputs
def test_bench_from_json_that_is_not_results_is_one_line(d, tmp_path, capsys):
    # before: KeyError 'rows' with a traceback; a binary file: a bare UnicodeDecodeError
    (tmp_path / "bad.json").write_text(json.dumps({"created": "now"}))
    (tmp_path / "list.json").write_text("[1, 2]")
    out = tmp_path / "out"
    for name in ("bad.json", "list.json"):
        fails_in_one_line(capsys, ["bench", "--from-json", str(tmp_path / name), "--out",
                                   str(out)], name, "results")  # fmt: skip
    fails_in_one_line(capsys, ["bench", "--from-json", str(d / "x.npy"), "--out", str(out)],
                      "x.npy", "results")  # fmt: skip
    assert not out.exists()


def test_bench_engine_that_is_not_an_engine_is_refused(tmp_path, capsys):
    # before: `--engines os:system` ran, exited 0 and wrote a report of "n/a" cells
    from leanrnn.bench.cli import options_from_args

    for name in ("os:system", "no_such_module_xyz:Engine", "leanrnn:NoSuchClass"):
        args = cli.build_parser().parse_args(["bench", "--engines", name, "--out",
                                              str(tmp_path)])  # fmt: skip
        with pytest.raises(leanrnn.errors.LeanRNNError) as e:
            options_from_args(args)
        msg = str(e.value)
        assert name in msg and "leanrnn" in msg and "onnxruntime" in msg, msg
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------- 7: plan --png
def test_plan_png_suffix_is_checked_before_any_work(d, capsys):
    # before: the whole plan printed, then matplotlib's "Format 'txt' is not supported"
    pytest.importorskip("matplotlib")
    fails_in_one_line(capsys, ["plan", str(d / "m.lrnn"), "--png", str(d / "out.txt")],
                      "out.txt", ".png")  # fmt: skip
    assert capsys.readouterr().out == ""
    assert not (d / "out.txt").exists()


def _two_rnn_graph(path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    T, N, C, H = 3, 2, 4, 5

    def w(*s):
        return numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3)

    inits = []
    for name, shape in (("W1", (1, H, C)), ("R1", (1, H, H)), ("W2", (1, H, H)),
                        ("R2", (1, H, H))):  # fmt: skip
        t = w(*shape)
        t.name = name
        inits.append(t)
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "ax"))
    nodes = [
        helper.make_node("RNN", ["x", "W1", "R1"], ["y1"], name="rnn1", hidden_size=H),
        helper.make_node("Squeeze", ["y1", "ax"], ["s1"], name="sq"),
        helper.make_node("RNN", ["s1", "W2", "R2"], ["y2"], name="rnn2", hidden_size=H),
    ]
    g = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, N, C])],
        [helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(path))
    return str(path)


def test_plan_png_of_a_graph_writes_one_file_per_rnn_node(tmp_path, capsys):
    # before: every node's timeline went to the same file; only the last survived
    pytest.importorskip("matplotlib")
    model = _two_rnn_graph(tmp_path / "two.onnx")
    assert cli.main(["plan", model, "--batch", "2", "--steps", "3",
                     "--png", str(tmp_path / "t.png")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["t-1.png", "t.png"], pngs
    assert out.count("timeline") == 2 and "t-1.png" in out


# ------------------------------------------------------------------------- 8: inspect
def test_inspect_says_which_shape_a_fixed_graph_was_planned_for(tmp_path, capsys):
    # before: "planned arena for N=7, T=9" although the file's fixed [3, 2, 4] was planned
    model = _two_rnn_graph(tmp_path / "two.onnx")
    assert cli.main(["inspect", model, "--batch", "7", "--steps", "9"]) == 0
    out = capsys.readouterr().out
    assert "N=7" not in out and "T=9" not in out, out
    assert "[3, 2, 4]" in out.split("planned arena")[1].splitlines()[0], out


def test_inspect_past_memory_names_the_requested_steps(d, capsys, monkeypatch):
    # before: "arena[lstm N=100000000 T=4]": the engine's chunk, not the T asked for
    from leanrnn.memory import arena

    monkeypatch.setattr(arena, "machine_memory", lambda: 1 << 20)
    line = fails_in_one_line(capsys, ["inspect", str(d / "m.lrnn"), "--batch", "100000",
                                      "--steps", "1000"], "N=100000", "T=1000")  # fmt: skip
    assert "arena[" not in line


# --------------------------------------------------------------- 9: conflicting options
def test_serve_grpc_port_with_no_grpc_is_refused(d, capsys, monkeypatch):
    # before: --grpc-port 0 --no-grpc started HTTP only, the port silently dropped
    pytest.importorskip("uvicorn")
    from leanrnn.serve import server

    async def fake(config, loaded=None, ready_line=print, **kw):  # never a real server here
        raise LeanRNNError("started")

    monkeypatch.setattr(server, "serve_async", fake)
    fails_in_one_line(capsys, ["serve", str(d / "m.lrnn"), "--grpc-port", "0", "--no-grpc"],
                      "--grpc-port", "--no-grpc")  # fmt: skip


@pytest.mark.parametrize("flag", [["--x-key", "foo"], ["--lengths-key", "l"], ["--column", "c"]])
def test_score_options_for_another_kind_of_input_are_refused(flag, d, capsys):
    # before: `--x-key foo` with a .npy input was ignored
    fails_in_one_line(capsys, ["score", str(d / "m.lrnn"), str(d / "sx.npy"),
                               str(d / "o.npz"), "--quiet", *flag], flag[0], "sx.npy")  # fmt: skip
    assert not (d / "o.npz").exists()


def test_save_refuses_a_path_that_is_not_lrnn(tmp_path):
    # before: leanrnn.save(model, "o.onnx") wrote a native file under an ONNX name
    m = leanrnn.LSTM(4, 8, seed=0)
    for name in ("o.onnx", "o.npz", "o"):
        with pytest.raises(ModelFormatError, match=r"\.lrnn"):
            leanrnn.save(m, str(tmp_path / name))
    assert not any(tmp_path.iterdir())
    assert leanrnn.save(m, tmp_path / "o.LRNN") == str(tmp_path / "o.LRNN")
    assert issubclass(ModelFormatError, LeanRNNError)
