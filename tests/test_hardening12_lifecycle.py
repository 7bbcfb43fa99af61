"""Session 38, from a red-team pass on interruptions: a KeyboardInterrupt (Ctrl-C) landing in
an optimizer step, in leanrnn.torch's repacking of changed parameters, or in a Trainer's first
forward of a shape left the model silently wrong or the trainer unusable. The interrupt is
raised where CPython delivers a real SIGINT: a function's entry, or right after a call
returns (a profile hook, one point per test). Each test failed before."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import leanrnn
from leanrnn.train import SGD, Adam, Trainer


def _interrupt_at(event: str, name: str, nth: int = 1, caller: str | None = None):
    """A profile hook raising KeyboardInterrupt at the ``nth`` ``event`` ("call", "return")
    of a function named ``name`` (called from ``caller``, if given)."""
    seen = [0]

    def hook(frame, ev, arg):
        code = frame.f_code
        if ev != event or code.co_name != name:
            return
        if caller is not None and frame.f_back.f_code.co_name != caller:
            return
        seen[0] += 1
        if seen[0] == nth:
            sys.setprofile(None)
            raise KeyboardInterrupt

    return hook


def _interrupted(fn, hook) -> None:
    sys.setprofile(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            fn()
    finally:
        sys.setprofile(None)


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("opt_cls", [SGD, Adam])
@pytest.mark.parametrize("nth", [1, 3])
def test_an_interrupted_optimizer_step_leaves_the_model_consistent_with_its_weights(
    opt_cls, nth, tmp_path
):
    """The model's inference and a checkpoint saved in the KeyboardInterrupt handler read the
    biases folded before the step: 0.07-0.41 off their own weights, in a file whose checksum
    passed."""
    x, dy = _x((5, 2, 4)), _x((5, 2, 8), 1)
    model = leanrnn.LSTM(4, 8, seed=0)
    tr = Trainer(model)
    opt = opt_cls(tr.parameters(), lr=0.5)
    tr.backward(tr.forward(x), dy, input_grad=False)
    _interrupted(opt.step, _interrupt_at("return", "_update", nth))
    rebuilt = leanrnn.from_state_dict(model.state_dict())  # from its own raw weights
    np.testing.assert_allclose(model(x)[0], rebuilt(x)[0], rtol=0, atol=1e-6)
    model.save(tmp_path / "ckpt.lrnn")
    np.testing.assert_allclose(leanrnn.load(tmp_path / "ckpt.lrnn")(x)[0], rebuilt(x)[0],
                               rtol=0, atol=1e-6)  # fmt: skip


def test_an_interrupted_first_trainer_forward_of_a_shape_leaves_it_usable():
    """A half-made view cache passed the plan check forever after: KeyError 'y.0'."""
    x = _x((6, 2, 4))
    tr = Trainer(leanrnn.LSTM(4, 8, num_layers=2, seed=0))
    _interrupted(lambda: tr.forward(x), _interrupt_at("return", "view", 2))
    want = Trainer(leanrnn.LSTM(4, 8, num_layers=2, seed=0)).forward(x).y
    np.testing.assert_array_equal(tr.forward(x).y, want)


def test_an_interrupted_repack_in_leanrnn_torch_refolds_at_the_next_forward():
    """Parameters marked seen before the biases were refolded: no later sync refolded them,
    and no_grad forwards stayed 1.25 off torch's module until the next step."""
    torch = pytest.importorskip("torch")
    lt = pytest.importorskip("leanrnn.torch")
    torch.manual_seed(0)
    x = torch.randn(6, 2, 4)
    m = lt.GRU(4, 8, num_layers=2)
    with torch.no_grad():
        m(x)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x)[0].square().sum().backward()
    opt.step()
    with torch.no_grad():
        _interrupted(lambda: m(x), _interrupt_at("call", "_check_weights", caller="sync"))
        ref = m.to_module()  # torch's own GRU with the same parameters
        torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=0, atol=1e-6)


def test_bench_keeps_its_results_whole_when_the_disk_is_full(tmp_path):
    """results.json and report.md were written in place: a full disk (a file size limit here)
    cut a good report.md short, and left results.json unparseable, every row measured lost."""
    import json
    import subprocess

    from helpers import src_env

    out = tmp_path / "bench"
    args = ["bench", "--engines", "leanrnn", "--cells", "lstm", "--batch", "1", "--steps", "10",
            "--stream-steps", "0", "--threads", "1", "--no-memray", "--no-bandwidth",
            "--no-plots", "--repeats", "3", "--warmup", "1", "--interleave", "0",
            "--max-time", "0.2", "--no-progress"]  # fmt: skip
    limited = ("import resource, sys; from leanrnn import cli; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
               "sys.exit(cli.main(sys.argv[2:]))")  # fmt: skip

    def run(limit, *argv):
        return subprocess.run([sys.executable, "-c", limited, str(limit), *argv], env=src_env(),
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    assert run(1 << 30, *args, "--hidden", "16", "--out", str(out)).returncode == 0
    report = (out / "report.md").read_bytes()
    results = (out / "results.json").read_bytes()
    assert len(report) > 1000
    r = run(1000, "bench", "--from-json", str(out / "results.json"), "--no-plots")
    assert r.returncode != 0 and "cannot write" in r.stderr and "report.md" in r.stderr, r.stderr
    assert (out / "report.md").read_bytes() == report  # kept whole
    r = run(len(results) + 200, *args, "--hidden", "16,32,48", "--out", str(out))
    assert r.returncode != 0 and "results.json" in r.stderr, r.stderr
    assert json.loads((out / "results.json").read_text())["rows"]  # parses: what it measured
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


def test_waiting_on_another_process_build_says_so(tmp_path, capsys):
    """A second process waiting on another's kernel build printed nothing for the build's
    minutes, and looked hung. (flock locks belong to open files: two opens in one process
    contend as two processes do.)"""
    import fcntl
    import threading
    import time

    from leanrnn.kernels import runner

    path = tmp_path / ".lock"
    with open(path, "w") as held, open(path, "w") as mine:
        fcntl.flock(held, fcntl.LOCK_EX)  # "the builder"
        threading.Timer(2.0, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        t0 = time.monotonic()
        with runner._exclusive(mine):
            waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "another process is compiling the kernels" in err and "its build is over" in err, err
    assert waited >= 1.8  # (it did wait for the lock)
