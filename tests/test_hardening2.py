"""Hardening, second pass: hostile input to the surfaces added last (Trainer, leanrnn.torch,
`plan --train`, `serve`'s options, `score`'s paths) and the README's new-user path. Each test
failed before its fix; each bad call must give a leanrnn error and leave things usable."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from helpers import fails_in_one_line
from leanrnn import cli
from leanrnn.errors import DTypeError, ShapeError, SpecError
from leanrnn.train import Trainer


@pytest.fixture(scope="module")
def lstm():
    return leanrnn.LSTM(4, 8, num_layers=2, seed=0)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)


# ------------------------------------------------ settings: refused, never truncated or clamped
# Before: Trainer(segment=0 / -3 / True / 2.5) ran segments of 1 or 2, threads=-1 and 0 ran,
# segment='a' raised a bare ValueError, dropout='a' / seed='a' a bare TypeError, Trainer('x')
# an AttributeError; Session(threads=-1) reached the kernels with -1 threads.
@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(segment=0), "segment=0"),
        (dict(segment=-3), "segment=-3"),
        (dict(segment=2.5), "segment=2.5"),
        (dict(segment=True), "segment=True"),
        (dict(segment="a"), "segment='a'"),
        (dict(threads=-1), "threads=-1"),
        (dict(threads=0), "threads=0"),
        (dict(threads=2.5), "threads=2.5"),
        (dict(memory_limit=-1), "memory_limit=-1"),
        (dict(memory_limit="1M"), "memory_limit='1M'"),
        (dict(dropout="a"), "dropout='a'"),
        (dict(seed="a"), "seed='a'"),
        (dict(seed=-1), "seed=-1"),
    ],
)
def test_trainer_settings_are_checked(lstm, x, kw, word):
    with pytest.raises(SpecError, match=r"\[Trainer\]") as e:
        Trainer(lstm, **kw)
    assert word in str(e.value)


def test_trainer_of_something_else_is_a_clear_error(lstm, x):
    with pytest.raises(SpecError, match=r"\[Trainer\] got a str; expected a leanrnn"):
        Trainer("model.lrnn")
    tr = Trainer(lstm)  # and a good one still works
    tape = tr.forward(x)
    tr.backward(tape, np.ones_like(tape.y))


@pytest.mark.parametrize("threads", [-1, 0, 2.5, "2", True])
def test_session_threads_are_checked_in_the_constructor_and_the_attribute(lstm, x, threads):
    with pytest.raises(SpecError, match=r"\[Session\] threads="):
        leanrnn.Session(lstm.weights, threads=threads)
    s = leanrnn.Session(lstm.weights)
    with pytest.raises(SpecError, match=r"\[Session\] threads="):
        s.threads = threads  # loading and scoring set it after construction
    y, _, _ = s.run(x)  # unchanged and usable
    np.testing.assert_array_equal(y, lstm(x)[0])


def test_session_of_something_else_is_a_clear_error():
    with pytest.raises(SpecError, match=r"\[Session\] got a str"):
        leanrnn.Session("model.lrnn")


# ------------------------------------------------------------------- plan --train, huge sizes
def test_plan_train_refuses_sizes_past_memory_instead_of_wrapping_around(capsys):
    # before: np.prod wrapped around in int64: "buffer 'xw.0' has nbytes=-9017668127734890496"
    fails_in_one_line(capsys, ["plan", "--train", "lstm:64x2", "--batch", str(10**12),
                                "--steps", str(10**6)], "plan --train", "this machine has")  # fmt: skip
    fails_in_one_line(capsys, ["plan", "--train", "lstm:64x2", "--batch", str(10**6),
                                "--steps", "1000"], "plan --train", "GiB")  # fmt: skip
    assert cli.main(["plan", "--train", "lstm:8", "--batch", "2", "--steps", "5"]) == 0


# ----------------------------------------------------------------------------- serve options
@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_serve_port_past_65535_is_an_argument_error(flag, capsys):
    # before: OverflowError from bind(), with a traceback
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "a=nothere.lrnn", flag, "70000"])
    assert e.value.code == 2
    assert "0..65535" in capsys.readouterr().err


# ------------------------------------------------------------------------------ score paths
@pytest.fixture
def score_files(tmp_path):
    m = leanrnn.LSTM(4, 8, seed=0)
    model = str(tmp_path / "m.lrnn")
    m.save(model)
    data = str(tmp_path / "d.npz")
    np.savez(data, x=np.ones((3, 5, 4), np.float32), lengths=np.array([5, 2, 0]))
    return tmp_path, model, data


def test_score_refuses_to_overwrite_its_own_input_or_model(score_files, capsys):
    # before: `leanrnn score m.lrnn d.npz d.npz` replaced the dataset by the scores, silently
    tmp, model, data = score_files
    before = open(data, "rb").read()
    fails_in_one_line(capsys, ["score", model, data, data, "--quiet"], "is the input file")
    (tmp / "link.npz").hardlink_to(data)
    fails_in_one_line(capsys, ["score", model, data, str(tmp / "link.npz"), "--quiet"],
                       "is the input file")  # fmt: skip
    assert open(data, "rb").read() == before
    fails_in_one_line(capsys, ["score", model, data, model, "--quiet"], "is the model file")
    assert leanrnn.load(model) is not None
    sub = tmp / "dir"
    sub.mkdir()
    np.savez(sub / "a.npz", x=np.ones((2, 3, 4), np.float32), lengths=np.array([3, 1]))
    fails_in_one_line(capsys, ["score", model, str(sub), str(sub / "o.npz"), "--quiet"],
                       "inside the input directory")  # fmt: skip
    assert cli.main(["score", model, data, str(tmp / "o.npz"), "--quiet"]) == 0


def test_score_output_in_a_missing_directory_is_one_line(score_files, capsys):
    # before: "leanrnn: error: FileNotFoundError: [Errno 2] ... '/x/.leanrnn-score-att22rco'"
    tmp, model, data = score_files
    line = fails_in_one_line(capsys, ["score", model, data, str(tmp / "no" / "o.npz"), "--quiet"],
                              "does not exist")  # fmt: skip
    assert "FileNotFoundError" not in line and ".leanrnn-score" not in line


# ------------------------------------------------------------------------ examples' arguments
def _example(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    d = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(d))  # the examples import their _common beside them
    try:
        spec = importlib.util.spec_from_file_location(f"hardening2_{name}", d / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(d))
    return mod


@pytest.mark.parametrize(
    "name, argv",
    [
        # before: --steps 0 exited 0 having done nothing; --batch/--bptt 0: range() ValueError;
        # --accum/--val-windows 0: ZeroDivisionError; --hidden/--layers/--embed 0: a child
        # process's CalledProcessError; --threads 0 and --lr nan: tracebacks; a --plot or --json
        # in a missing directory: FileNotFoundError after the whole training run
        ("forecast", ["--steps", "0"]),
        ("forecast", ["--hidden", "0"]),
        ("forecast", ["--layers", "0"]),
        ("forecast", ["--batch", "0"]),
        ("forecast", ["--window", "0"]),
        ("forecast", ["--threads", "-3"]),
        ("forecast", ["--eval-every", "0"]),
        ("forecast", ["--lr", "nan"]),
        ("forecast", ["--clip", "-1"]),
        ("forecast", ["--plot", "/nonexistent-dir/x.png"]),
        ("forecast", ["--json", "/nonexistent-dir/x.json"]),
        ("forecast", ["--init", "/nonexistent.npz"]),
        ("char_lm", ["--bptt", "0"]),
        ("char_lm", ["--accum", "0"]),
        ("char_lm", ["--val-windows", "0"]),
        ("char_lm", ["--embed", "0"]),
    ],
)
def test_example_arguments_are_checked_before_any_work(name, argv, capsys):
    with pytest.raises(SystemExit) as e:
        _example(name).main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {argv[0]}" in err


def test_example_init_that_is_not_an_npz_of_arrays_is_one_line(tmp_path):
    # before: a torch checkpoint opened as a zip of no arrays -> WeightsError traceback
    torch = pytest.importorskip("torch")
    p = tmp_path / "lstm.pt"
    torch.save(torch.nn.LSTM(1, 4).state_dict(), p)
    with pytest.raises(SystemExit, match="holds no arrays"):
        _example("forecast").main(["--init", str(p), "--steps", "1", "--quiet"])


# ------------------------------------------------------------------------------ leanrnn.torch
@pytest.fixture(scope="module")
def lt():
    pytest.importorskip("torch")
    import leanrnn.torch as lt

    return lt


def test_torch_module_refuses_what_is_not_a_tensor(lt):
    import torch

    m = lt.LSTM(4, 8)
    x = torch.randn(5, 3, 4)
    # before: AttributeError: 'numpy.ndarray' object has no attribute 'dim'
    with pytest.raises(DTypeError, match=r"input is a ndarray; expected a torch.Tensor"):
        m(x.numpy())
    g = lt.GRU(4, 8)
    # before: AttributeError: 'tuple' object has no attribute 'dim'
    with pytest.raises(ShapeError, match=r"h_0 is a tuple; .*GRU takes hx = h_0 alone"):
        g(x, (torch.zeros(1, 3, 8), torch.zeros(1, 3, 8)))
    assert g(x)[0].shape == (5, 3, 8)


@pytest.mark.parametrize("dtype", ["int64", "float16", "bfloat16"])
def test_torch_dtype_error_suggests_only_a_module_dtype_that_works(lt, dtype):
    import torch

    # before: "... or the module with .to(torch.int64)", which then fails too
    with pytest.raises(DTypeError) as e:
        lt.LSTM(4, 8)(torch.zeros(5, 3, 4, dtype=getattr(torch, dtype)))
    assert "the module with" not in str(e.value)
    with pytest.raises(DTypeError, match=r"or the module with .to\(torch.float64\)"):
        lt.LSTM(4, 8)(torch.zeros(5, 3, 4, dtype=torch.float64))


@pytest.mark.parametrize("batch_sizes", [[3, 3], [2, 2, 2], [2, 0, 3], [1, 2, 2]])
def test_torch_malformed_packed_sequence_is_a_shape_error(lt, batch_sizes):
    import torch
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    m = lt.LSTM(4, 8)
    # before: IndexError: index_copy_(): Number of indices (6) should be equal to ... (5)
    with pytest.raises(ShapeError, match=r"PackedSequence .* is malformed"):
        m(PackedSequence(torch.randn(5, 4), torch.tensor(batch_sizes)))
    y, _ = m(pack_sequence([torch.randn(3, 4), torch.randn(2, 4)]))  # still usable
    assert y.data.shape == (5, 8)


def test_torch_parameter_replaced_by_another_shape_is_a_shape_error(lt):
    import torch

    g = lt.GRU(4, 8)
    x = torch.randn(5, 3, 4)
    g(x)
    good = g.weight_hh_l0
    g.weight_hh_l0 = torch.nn.Parameter(torch.zeros(3, 3))
    # before: IndexError: index 3 is out of bounds for axis 0 with size 3
    with pytest.raises(
        ShapeError, match=r"parameter weight_hh_l0 has shape \(3, 3\); expected \(24, 8\)"
    ):
        g(x)
    g.weight_hh_l0 = good
    assert g(x)[0].shape == (5, 3, 8)


# ----------------------------------------------------------------------- flags are booleans
@pytest.mark.parametrize(
    "kw", [dict(batch_first="no"), dict(bias="no"), dict(bidirectional="no"), dict(batch_first=2)]
)
def test_model_flags_that_are_not_booleans_are_refused(kw):
    # before: batch_first="no" / bidirectional="no" were truthy: a batch-first or
    # bidirectional model, silently; bias="no" was stored in the spec as the string
    with pytest.raises(SpecError, match=r"expected True or False"):
        leanrnn.LSTM(4, 8, seed=0, **kw)
    assert leanrnn.LSTM(4, 8, seed=0, batch_first=np.True_, bias=1).spec.batch_first is True


def test_lrnn_header_with_a_non_boolean_flag_is_refused(tmp_path):
    import json
    import struct

    from leanrnn.errors import ModelFormatError

    path = tmp_path / "m.lrnn"
    leanrnn.LSTM(4, 8, seed=0).save(str(path))
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    spec = json.loads(header["__metadata__"]["spec"])
    spec["batch_first"] = "yes"
    header["__metadata__"]["spec"] = json.dumps(spec)
    b = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(b)) + b + raw[8 + n :])
    with pytest.raises(ModelFormatError, match=r"batch_first='yes'; expected True or False"):
        leanrnn.load(str(path))


# ----------------------------------------------------- the model after an optimizer step
def _stepped(cell="LSTM", H=8, lr=0.1):
    from leanrnn.train import Adam

    m = getattr(leanrnn, cell)(4, H, seed=0)
    tr = Trainer(m)
    opt = Adam(tr.parameters(), lr=lr)
    x = np.random.default_rng(0).standard_normal((6, 2, 4)).astype(np.float32)
    tape = tr.forward(x)
    tr.backward(tape, np.ones_like(tape.y))
    return m, tr, opt, x


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_model_is_current_right_after_an_optimizer_step(cell, tmp_path):
    from tolerances import atol

    # before: the folded biases the engine reads were refreshed only at the trainer's next
    # forward, so model(x) and model.save() right after opt.step() (the README's loop) were
    # one step stale: 0.33 off the model's own state dict
    m, tr, opt, x = _stepped(cell)
    opt.step()
    want = leanrnn.from_state_dict(m.state_dict())(x)[0]  # repacked from the canonical weights
    np.testing.assert_allclose(m(x)[0], want, rtol=0, atol=atol(np.float32))
    m.save(str(tmp_path / "t.lrnn"))
    np.testing.assert_allclose(leanrnn.load(str(tmp_path / "t.lrnn"))(x)[0], want, rtol=0,
                               atol=atol(np.float32))  # fmt: skip


def test_a_copied_trainer_is_refreshed_by_its_own_optimizer():
    import copy
    import pickle

    from leanrnn.train import Adam

    m, tr, opt, x = _stepped()
    for b in (copy.deepcopy(tr), pickle.loads(pickle.dumps(tr))):
        assert all(p._owner() is b for p in b.parameters())
        ob = Adam(b.parameters(), lr=0.1)
        tape = b.forward(x)
        b.backward(tape, np.ones_like(tape.y))
        ob.step()
        assert b._seen == [p.version for p in b.parameters()]
    assert all(p._owner() is tr for p in tr.parameters())
