"""The ``leanrnn`` command on bad input: one line ``leanrnn: error: ...``, a non-zero exit, no
traceback, nothing written or allocated first; sizes past the machine's memory refused by
arithmetic; every option documented. All in-process through ``cli.main``."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import leanrnn
from helpers import fails_in_one_line
from leanrnn import cli
from leanrnn.errors import PlanError
from leanrnn.memory import arena


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    leanrnn.save(leanrnn.LSTM(4, 8, seed=0), str(d / "m.lrnn"))
    np.save(d / "x.npy", np.zeros((3, 1, 4), np.float32))
    (d / "empty.npy").write_bytes(b"")
    (d / "afile").write_text("not a directory")
    (d / "adir").mkdir()
    (d / "d.lrnn").mkdir()
    return d


# --------------------------------------------------------------- item 12: one-line errors
def test_output_paths_are_checked_before_any_work(files, capsys):
    m, x, d = str(files / "m.lrnn"), str(files / "x.npy"), files
    fails_in_one_line(capsys, ["convert", m, f"{d}/afile/x.lrnn"], "afile", "not a directory")
    fails_in_one_line(capsys, ["convert", m, f"{d}/d.lrnn"], "d.lrnn", "is a directory")
    fails_in_one_line(
        capsys, ["run", m, "--input", x, "--output", f"{d}/afile/o.npz"], "not a directory"
    )
    fails_in_one_line(capsys, ["plan", "lstm:8", "--png", f"{d}/afile/t.png"], "not a directory")
    fails_in_one_line(capsys, ["plan", "lstm:8", "--png", f"{d}/adir"], "is a directory")
    fails_in_one_line(capsys, ["compile", "--cache-dir", f"{d}/afile/c"], "afile", "under the file")
    assert sorted(p.name for p in d.iterdir()) == ["adir", "afile", "d.lrnn", "empty.npy",
                                                   "m.lrnn", "x.npy"]  # fmt: skip


def test_run_output_to_a_directory_is_refused_and_a_bare_name_gets_npz(files, capsys):
    m, x, d = str(files / "m.lrnn"), str(files / "x.npy"), files / "adir"
    fails_in_one_line(capsys, ["run", m, "--input", x, "--output", f"{d}/"], "is a directory")
    fails_in_one_line(capsys, ["run", m, "--input", x, "--output", str(d)], "is a directory")
    assert list(d.iterdir()) == []  # no hidden DIR/.npz
    assert cli.main(["run", m, "--input", x, "--output", str(d / "out")]) == 0
    assert f"to {d / 'out.npz'}" in capsys.readouterr().out  # the file np.savez really wrote
    assert sorted(np.load(d / "out.npz").files) == ["c_n", "h_n", "y"]


def test_empty_input_file_is_one_line(files, capsys):
    argv = ["run", str(files / "m.lrnn"), "--input", str(files / "empty.npy")]
    fails_in_one_line(capsys, argv, "--input", "empty.npy")


def test_bad_backend_variable_is_one_line_in_info(capsys, monkeypatch):
    # This process read LEANRNN_BACKEND at import; `info` times fresh processes, which read it
    # again and used to die with a traceback (CalledProcessError).
    monkeypatch.setenv("LEANRNN_BACKEND", "bogus")
    fails_in_one_line(capsys, ["info"], "LEANRNN_BACKEND", "bogus")


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "M", "--input", "x.npy", "--threads", "0"],
        ["run", "M", "--input", "x.npy", "--threads", "-5"],
        ["inspect", "M", "--batch", "0"],
        ["plan", "lstm:8", "--steps", "-1"],
        ["plan", "lstm:8", "--chunk", "0"],
        ["plan", "lstm:8", "--batch", str(1 << 63)],  # past int64
        ["demo", "--hidden", "0"],
        ["demo", "--repeat", "-2"],
        ["bench", "--repeats", "0"],
        ["bench", "--timeout", "-1"],
    ],
)
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_only_user_errors_are_shortened(monkeypatch, capsys):
    def bug(args):
        raise TypeError("a bug in leanrnn")

    def oserror(args):
        raise PermissionError(13, "Permission denied", "/x")

    parser = cli.build_parser()
    for func, exc in ((bug, TypeError), (oserror, PermissionError)):
        monkeypatch.setattr(cli, "build_parser", lambda f=func: _with_func(parser, f))
        if exc is TypeError:  # a genuine bug keeps its traceback
            with pytest.raises(TypeError):
                cli.main(["plan", "lstm:8"])
        else:
            fails_in_one_line(capsys, ["plan", "lstm:8"], "PermissionError", "/x")
            monkeypatch.setenv("LEANRNN_DEBUG", "1")  # ... and the traceback on request
            with pytest.raises(PermissionError):
                cli.main(["plan", "lstm:8"])


def _with_func(parser, func):
    parser.set_defaults(func=func)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                p.set_defaults(func=func)
    return parser


# ---------------------------------------------------- item 9: sizes past the machine's memory
@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "lstm:2147483647x2147483647", "--batch", "1", "--steps", "1"], ["hidden="]),
        (["plan", "lstm:64x2147483647"], ["layers=2147483647", "1..256"]),
        (["plan", "gru:" + "9" * 5000], ["5000 digits"]),
        (["plan", "lstm:1048576x256"], ["bytes", "GiB", "this machine has"]),
        (["plan", "lstm:8", "--batch", str(10**12)], ["N=1000000000000", "bytes", "machine"]),
        (["demo", "--hidden", "100000"], ["H=100000", "bytes", "this machine has"]),
        (["demo", "--batch", str(10**9), "--steps", str(10**6)], ["N=1000000000", "bytes"]),
    ],
    ids=[
        "hidden-2^31",
        "layers-2^31",
        "5000-digits",
        "weights-past-memory",
        "batch-10^12",
        "demo-hidden",
        "demo-inputs",
    ],
)
def test_huge_sizes_are_refused_up_front(argv, words, capsys):
    fails_in_one_line(capsys, argv, *words)


def test_inspect_refuses_a_huge_batch(files, capsys):
    argv = ["inspect", str(files / "m.lrnn"), "--batch", str(10**12)]
    fails_in_one_line(capsys, argv, "N=1000000000000", "bytes", "this machine has")


def test_arena_past_memory_is_a_plan_error_and_the_session_stays_usable(monkeypatch):
    m = leanrnn.LSTM(4, 8, seed=0)
    monkeypatch.setattr(arena, "machine_memory", lambda: 1 << 16)
    with pytest.raises(PlanError, match=r"N=1000 T=\d+\] needs [\d,]+ bytes .* 65,536 bytes"):
        m.session.resize(1000, 50)
    x = np.ones((3, 2, 4), np.float32)
    y, _ = m(x)  # a plan that fits still runs
    assert y.shape == (3, 2, 8) and np.isfinite(y).all()


def test_plan_prints_a_plan(capsys):
    assert cli.main(["plan", "gru:16x2", "--batch", "3", "--steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "GRU C=16 H=16 layers=2" in out and "arena" in out


# --------------------------------------------------------------- item 16: help and the plot
def test_every_option_of_every_command_has_help():
    missing = []
    for action in cli.build_parser()._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, sub in action.choices.items():
            for a in sub._actions:
                if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                    missing.append(f"{name} {a.option_strings or a.dest}")
    assert missing == []


def test_plan_timeline_draws_no_stub_for_an_empty_buffer(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from leanrnn.commands.plan import draw
    from leanrnn.memory.planner import Buffer, plan

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    p = plan([Buffer("xw.0", 4096, 0, 0), Buffer("aux.0", 0, 0, 1), Buffer("h.1", 1024, 1, 1)])
    draw(p, str(tmp_path / "t.png"), "t")
    (ax,) = figs[0].axes
    heights = sorted(r.get_height() for r in ax.patches if r is not ax.patch)
    assert heights == [1.0, 4.0]  # KiB: the two real buffers only


@pytest.mark.parametrize(
    "var, value",
    [("LEANRNN_BACKEND", "bogus"), ("LEANRNN_NUM_THREADS", "many"),
     ("LEANRNN_NUM_THREADS", "0"), ("LEANRNN_NUM_THREADS", "-3")],
)  # fmt: skip
def test_bad_environment_from_a_shell_is_one_line(var, value):
    """`import leanrnn` read the bad value before cli.main could catch anything: a traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, var: value}
    res = subprocess.run([sys.executable, "-m", "leanrnn", "info"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanrnn: error:"), res.stderr
    assert var in lines[0] and value in lines[0]


def test_bad_environment_fails_the_first_kernel_call_not_the_import():
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, leanrnn\n"
        "m = leanrnn.LSTM(2, 3, seed=0)\n"
        "try:\n"
        "    m(np.zeros((1, 1, 2), np.float32))\n"
        "except leanrnn.errors.LeanRNNError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "LEANRNN_BACKEND": "bogus"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "refused:" in res.stdout and "LEANRNN_BACKEND='bogus'" in res.stdout
