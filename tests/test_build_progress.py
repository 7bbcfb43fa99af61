"""A build shows what it is doing and for how long (it once printed nothing for 82 s)."""

import io
import sys
import textwrap

from leanrnn.kernels import native, runner


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_off_a_terminal_with_the_elapsed_time_and_a_heartbeat():
    out, clock = _Stream(tty=False), _Clock()
    p = runner.Progress(out, "compiling the kernels", quiet=30, clock=clock)
    clock.now += 12
    p.event("building float32 kernels (lstm, gru, rnn, matmul)")
    for _ in range(29):  # a tick a second: silence is only broken after `quiet` seconds
        clock.now += 1
        p.tick()
    clock.now += 1
    p.tick()
    clock.now += 3
    p.close("done")
    assert out.getvalue().splitlines() == [
        "leanrnn: compiling the kernels",
        "leanrnn: building float32 kernels (lstm, gru, rnn, matmul) ... 12 s",
        "leanrnn: still running ... 42 s",
        "leanrnn: done ... 45 s",
    ]
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()


def test_one_line_rewritten_in_place_on_a_terminal():
    out, clock = _Stream(tty=True), _Clock()
    p = runner.Progress(out, "compiling the kernels", clock=clock)
    p.event("building float64 kernels (lstm, gru, rnn, matmul)")
    clock.now += 7
    p.tick()
    clock.now += 1
    p.close("done")
    text = out.getvalue()
    assert text.startswith("leanrnn: compiling the kernels\n")
    assert text.count("\n") == 2 and text.endswith("leanrnn: done ... 8 s\n")
    assert "\r\033[Kleanrnn: building float64 kernels (lstm, gru, rnn, matmul) ... 7 s" in text


# Stands in for `python -m leanrnn.kernels.aot DIR FINGERPRINT`: says what it builds, and
# publishes a file (verify checks size and hash, not that it is a real module).
FAKE_BUILD = """
    import sys, time
    from pathlib import Path
    from leanrnn.kernels import native
    print("building float32 kernels (lstm, gru, rnn, matmul)", flush=True)
    time.sleep(0.2)
    print("built the float32 lstm kernel in 0 s", flush=True)
    out = Path(sys.argv[1]).parent / "module.so"
    out.write_bytes(b"not a real module")
    native.publish(Path(sys.argv[1]), out, sys.argv[2])
"""


def test_the_build_subprocess_progress_is_shown_as_it_comes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "_BUILD", [sys.executable, "-c", textwrap.dedent(FAKE_BUILD)])
    d = tmp_path / "native" / "fp"
    d.mkdir(parents=True)
    runner._build(d, "fp")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"leanrnn: compiling the kernels for this machine, once ({runner.BUILD_TIME})"
    assert err[1].startswith("leanrnn: building float32 kernels (lstm, gru, rnn, matmul) ... ")
    assert err[2].startswith("leanrnn: built the float32 lstm kernel in 0 s ... ")
    assert err[-1].startswith("leanrnn: done ... ") and err[-1].endswith(" s")
    assert native.verify(d, "fp") == native.module_path(d)


def test_a_build_that_dies_says_so_and_records_why(tmp_path, monkeypatch, capsys):
    code = "import sys; print('building float32 kernels', flush=True); sys.exit('out of memory')"
    monkeypatch.setattr(runner, "_BUILD", [sys.executable, "-c", code])
    d = tmp_path / "native" / "fp"
    d.mkdir(parents=True)
    runner._build(d, "fp")
    err = capsys.readouterr().err
    assert "leanrnn: failed (exit 1) ... " in err
    assert "out of memory" in native.failure(d)
