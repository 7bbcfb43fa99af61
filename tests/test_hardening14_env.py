"""Session 40, from a red-team pass on paths and the process environment: score deleted its
whole output when stderr could not take the progress bar; on a full disk its .npz spool folder
stayed and the error named no file; plan --png onto the model overwrote it; serve started with
a token no client could match (a CR from a CRLF env file); NUMBA_NUM_THREADS='²' broke
`import leanrnn`; compile --cache-dir '~/k' built into ./~/k, and an unwritable one built in
/tmp instead; LEANRNN_SERVE_LOG's errors named no variable."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import leanrnn
from helpers import src_env
from leanrnn import cli
from leanrnn.errors import LeanRNNError


class _DeadStream:
    def write(self, s):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


def test_score_keeps_its_output_when_stderr_cannot_take_the_progress_bar(tmp_path, monkeypatch):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 4, 2), np.float32), lengths=np.array([4, 2, 3]))
    monkeypatch.setattr(sys, "stderr", _DeadStream())
    s = leanrnn.score(leanrnn.GRU(2, 3, seed=0), str(tmp_path / "d.npz"),
                      str(tmp_path / "o.npz"), progress=True)  # fmt: skip
    assert s.sequences == 3 and (tmp_path / "o.npz").exists()


def test_an_aborted_npz_output_leaves_no_spool_even_if_its_files_cannot_flush(tmp_path):
    from leanrnn.score import writers

    out = writers.NpzOut(str(tmp_path / "o.npz"))
    out._spool("length", np.arange(3))
    spool = out._dir

    class Failing:
        def close(self):
            raise OSError(28, "No space left on device")

    out._files["length"].close()
    out._files["length"] = Failing()
    out.abort()  # raised the flush's OSError, and left the folder
    assert not os.path.exists(spool) and not os.listdir(tmp_path)


def test_plan_png_onto_its_own_model_is_refused(tmp_path, capsys):
    path = tmp_path / "m.lrnn"
    leanrnn.LSTM(3, 4, seed=0).save(path)
    png = tmp_path / "m.png"
    png.write_bytes(path.read_bytes())  # a model file that happens to end in .png
    before = png.read_bytes()
    assert cli.main(["plan", str(png), "--png", str(png)]) != 0
    assert "is the model file itself" in capsys.readouterr().err
    assert png.read_bytes() == before


def test_a_token_no_client_can_send_is_refused_at_start():
    import argparse

    from leanrnn.commands.serve import _token

    for bad in ("secret\r", "secret ", "sécret", "a\tb"):
        with pytest.raises(argparse.ArgumentTypeError, match="printable ASCII"):
            _token(bad)
    assert _token("s3cret-Token_1") == "s3cret-Token_1"


def test_numba_num_threads_of_non_ascii_digits_does_not_break_the_import():
    env = {**src_env(), "NUMBA_NUM_THREADS": "²"}
    done = subprocess.run([sys.executable, "-c", "import leanrnn; print(leanrnn.get_num_threads())"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-800:]


def test_compile_cache_dir_expands_home_and_refuses_an_unwritable_one(tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    from leanrnn import config

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(config, "writable", lambda d: False)  # (root writes anywhere)
    assert cli.main(["compile", "--cache-dir", "~/k"]) != 0
    err = capsys.readouterr().err
    assert f"{tmp_path}/k" in err and "cannot be written" in err
    assert not (tmp_path / "~").exists()


def test_a_bad_serve_log_level_names_the_variable(monkeypatch):
    from leanrnn import config

    monkeypatch.setenv("LEANRNN_SERVE_LOG", "loud")
    with pytest.raises(LeanRNNError, match="LEANRNN_SERVE_LOG='LOUD'"):
        config.serve_log_level()
    for ok, level in (("", "INFO"), ("warn", "WARN"), ("debug", "DEBUG")):  # logging's names
        monkeypatch.setenv("LEANRNN_SERVE_LOG", ok)
        assert config.serve_log_level() == level
