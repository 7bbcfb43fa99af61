"""Hardening, eighth pass: a red team's findings on the command line and the API (the server's
are in test_hardening5_serve, beside its server). Each test failed before its fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

import leanrnn
from helpers import fails_in_one_line
from leanrnn import cli
from leanrnn.errors import WeightsError


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("h8")
    leanrnn.save(leanrnn.LSTM(4, 8, seed=0), str(d / "m.lrnn"))
    np.save(d / "x.npy", np.zeros((3, 2, 4), np.float32))
    return d


# ------------------------------------------ run --output: another suffix, or not a file
@pytest.mark.parametrize("name", ["out.txt", "out.npy", "y.NPZ", "m.lrnn"])
def test_run_output_with_another_suffix_is_refused_before_any_work(name, d, capsys):
    # before: exit 0 and "wrote y, h_n, c_n to out.txt.npz"
    before = sorted(os.listdir(d))
    fails_in_one_line(capsys, ["run", str(d / "m.lrnn"), "--input", str(d / "x.npy"), "--output",
                               str(d / name)], name, ".npz")  # fmt: skip
    assert sorted(os.listdir(d)) == before


def test_outputs_that_are_not_regular_files_are_refused(d, capsys):
    # before: run --output /dev/null wrote a regular file /dev/null.npz next to the device, and
    # convert's rename replaced a FIFO (as root, it would have replaced /dev/null) — a FIFO
    # here, not /dev/null, so that a regression cannot touch the system's files
    for name in ("fifo", "fifo.lrnn", "fifo.npz"):
        os.mkfifo(d / name)
    fails_in_one_line(capsys, ["run", str(d / "m.lrnn"), "--input", str(d / "x.npy"), "--output",
                               str(d / "fifo")], "fifo", "not a regular file")  # fmt: skip
    fails_in_one_line(capsys, ["run", str(d / "m.lrnn"), "--input", str(d / "x.npy"), "--output",
                               str(d / "fifo.npz")], "fifo.npz", "not a regular file")  # fmt: skip
    fails_in_one_line(capsys, ["convert", str(d / "m.lrnn"), str(d / "fifo.lrnn")], "fifo.lrnn",
                      "not a regular file")  # fmt: skip
    with pytest.raises(leanrnn.errors.ModelFormatError, match="not a regular file"):
        leanrnn.load(str(d / "m.lrnn")).save(str(d / "fifo.lrnn"))
    assert all(not os.path.isfile(d / n) for n in ("fifo", "fifo.lrnn", "fifo.npz"))
    assert not os.path.exists(d / "fifo.npz.npz")
    for name in ("fifo", "fifo.lrnn", "fifo.npz"):
        os.remove(d / name)


def test_run_output_bare_name_and_npz_still_write(d, capsys):
    for name, wrote in (("bare", "bare.npz"), ("o.npz", "o.npz"), ("out.v2", "out.v2.npz"),
                        ("v1.2/o", None)):  # fmt: skip
        if wrote is None:  # a dot in a directory's name is no suffix of the file
            (d / "v1.2").mkdir()
            wrote = "v1.2/o.npz"
        argv = ["run", str(d / "m.lrnn"), "--input", str(d / "x.npy"), "--output", str(d / name)]
        assert cli.main(argv) == 0
        assert f"to {d / wrote}" in capsys.readouterr().out
        assert sorted(np.load(d / wrote).files) == ["c_n", "h_n", "y"]


# --------------------------------------------- a latency target of 0 ms: refused, not clamped
@pytest.mark.parametrize(
    "argv",
    [["tune", "gru:8", "--latency-ms", "0"], ["tune", "gru:8", "--latency-ms", "-1"],
     ["serve", "m=gru:8", "--max-call-ms", "0"]],
)  # fmt: skip
def test_a_zero_latency_target_is_a_usage_error(argv, capsys):
    # before: tune ran with a 0.001 ms target and serve with 0.01 ms, exit 0, without a word
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected milliseconds > 0" in err or "0..60000" in err, err


def test_serve_max_wait_may_still_be_zero():
    from leanrnn.commands.serve import _wait_ms

    assert _wait_ms("0") == 0.0  # never wait for more streams: a documented choice


# ------------------------------------------------------- from_state_dict of a non-mapping
@pytest.mark.parametrize("bad", [[1, 2], "weights.pt", None, 3.0])
def test_from_state_dict_of_something_else_names_it(bad):
    # before: AttributeError: 'list' object has no attribute 'items'
    with pytest.raises(WeightsError, match=r"expected a dict of arrays.*leanrnn\.load"):
        leanrnn.from_state_dict(bad)
    with pytest.raises(WeightsError, match="from_state_dict"):
        leanrnn.GRU.from_state_dict(bad)


def test_from_state_dict_takes_any_mapping():
    from types import MappingProxyType

    m = leanrnn.GRU(3, 5, seed=1)
    again = leanrnn.from_state_dict(MappingProxyType(m.state_dict()), cell="gru")
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    np.testing.assert_array_equal(again(x)[0], m(x)[0])


# ------------------------------------------------------------------ masked arrays as inputs
def test_masked_array_inputs_are_refused_not_run_unmasked(tmp_path):
    # before: the mask was dropped and the masked values ran as data
    m = leanrnn.LSTM(3, 4, seed=0)
    data = np.ones((2, 1, 3), np.float32)
    x = np.ma.masked_array(data, mask=np.zeros_like(data, bool))
    masked_len = np.ma.masked_array([2], mask=[1])  # (the masked 2 ran as a real length)
    for call in (lambda: m(x), lambda: m.session.run(x), lambda: m.stream().feed(x[0]),
                 lambda: m(data, lengths=masked_len)):  # fmt: skip
        with pytest.raises(leanrnn.errors.DTypeError, match="masked array"):
            call()
    from leanrnn.train import Parameter

    with pytest.raises(leanrnn.errors.DTypeError, match="MaskedArray"):
        Parameter(np.ma.masked_array(np.zeros(3, np.float32)))
    np.testing.assert_array_equal(m(x.filled(0))[0], m(data)[0])  # the session stays usable
    torch = pytest.importorskip("torch")
    onnx_path = tmp_path / "m.onnx"
    lstm = torch.nn.LSTM(3, 4)
    torch.onnx.export(lstm, (torch.zeros(2, 1, 3),), str(onnx_path), input_names=["x"],
                      dynamo=False)  # fmt: skip
    g = leanrnn.load(str(onnx_path))
    with pytest.raises(leanrnn.errors.DTypeError, match="input 'x' is a numpy masked array"):
        g.run({"x": x})
    with torch.no_grad():
        want = lstm(torch.from_numpy(data))[0].numpy()
    np.testing.assert_allclose(g.run({"x": data})[0], want, rtol=0, atol=1e-6)


# ---------------------------------------------- a command's unknown flag: that command's usage
def test_unknown_flag_after_a_command_shows_that_commands_usage(d, capsys):
    # before: the top-level usage ("leanrnn [-h] [--version] COMMAND ..."), no run flags
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(d / "m.lrnn"), "--input", str(d / "x.npy"), "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: leanrnn run" in err and "--output" in err, err
    assert err.strip().endswith("leanrnn run: error: unrecognized arguments: --bogus"), err
    with pytest.raises(SystemExit):
        cli.main(["--bogus"])
    assert "leanrnn: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_torch_module_with_parameters_of_two_dtypes_is_refused():
    # before: a float64 tensor assigned to a float32 module's parameter ran as float32, in
    # silence (torch.nn's own module raises)
    torch = pytest.importorskip("torch")
    import leanrnn.torch as lt

    m = lt.LSTM(4, 8)
    x = torch.randn(3, 2, 4)
    y = m(x)[0].detach().clone()
    m.weight_hh_l0.data = m.weight_hh_l0.data.double()
    with pytest.raises(leanrnn.errors.DTypeError, match=r"weight_hh_l0 is torch\.float64"):
        m(x)
    m.weight_hh_l0.data = m.weight_hh_l0.data.float()  # back as it was: the same outputs
    assert torch.equal(m(x)[0], y)


def test_bench_from_json_of_a_missing_file_is_one_line(tmp_path, capsys):
    # before: "leanrnn: error: FileNotFoundError: [Errno 2] ..." (the OS's words alone)
    fails_in_one_line(capsys, ["bench", "--from-json", str(tmp_path / "nope.json")],
                      "--from-json", "nope.json", "results.json")  # fmt: skip


@pytest.mark.parametrize(("argv", "words"), [
    (["plan", "lstm:16", "--train", "--autocast-mode", "bf16-act"], ["--autocast-mode", "add --autocast"]),
    (["plan", "lstm:16x-1"], ["lstm:16x-1", "shorthand", "lstm:512x2"]),
    (["plan", "gru:abc", "--train"], ["gru:abc", "shorthand"]),
])  # fmt: skip
def test_plan_flags_that_were_ignored_or_misreported(argv, words, capsys):
    # before: --autocast-mode without --autocast was ignored in silence, and a mistyped
    # shorthand was "does not exist or is not a file"
    fails_in_one_line(capsys, argv, *words)


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_torch_module_with_an_empty_batch_returns_what_torch_returns(cell, batch_first):
    # before: a ShapeError, where torch.nn's modules return empty outputs with a graph
    torch = pytest.importorskip("torch")
    import leanrnn.torch as lt

    kw = dict(num_layers=2, bidirectional=True, batch_first=batch_first)
    ours = getattr(lt, cell)(4, 8, **kw)
    theirs = ours.to_module()
    shape = (0, 3, 4) if batch_first else (3, 0, 4)
    outs = []
    for m in (ours, theirs):
        x = torch.randn(*shape, requires_grad=True)
        y, h = m(x)
        hs = h if isinstance(h, tuple) else (h,)
        (y.sum() + sum(t.sum() for t in hs)).backward()
        outs.append((y.shape, y.dtype, [t.shape for t in hs], x.grad.shape,
                     [None if p.grad is None else float(p.grad.abs().sum())
                      for p in m.parameters()]))  # fmt: skip
    assert outs[0] == outs[1]
    with pytest.raises(leanrnn.errors.ShapeError, match="T >= 1"):
        ours(torch.randn(4, 0, 4) if batch_first else torch.randn(0, 2, 4))
