"""Session 37, from a red-team pass of ``leanrnn tune``: a choice that misses the latency target
read "chosen" and was printed as the serve command with no word (nothing met the target; batch 1
is chosen because a server must run), and a memory limit beyond the machine let the search
allocate calls the machine cannot hold. Each test failed before."""

from __future__ import annotations

import json

import pytest

import leanrnn
from leanrnn import cli, tuning
from leanrnn.memory.arena import machine_memory


def test_a_choice_over_the_target_says_so(capsys):
    m = leanrnn.LSTM(4, 8, seed=0)
    got = tuning.tune(m.session, latency=1e-6, measure=lambda b, c: 1e-3 * b * c)
    assert (got.batch, got.chunk) == (1, 1) and not got.meets_target
    assert "chosen, over" in got.table()
    assert cli.main(["tune", "lstm:8", "--latency-ms", "0.000001", "--max-batch", "4",
                     "--max-chunk", "2"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "warning: no call meets the 1e-06 ms target" in err
    assert cli.main(["tune", "lstm:8", "--latency-ms", "0.000001", "--max-batch", "4",
                     "--max-chunk", "2", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["meets_target"] is False


def test_a_target_met_is_met():
    m = leanrnn.LSTM(4, 8, seed=0)
    got = tuning.tune(m.session, latency=1.0, measure=lambda b, c: 1e-6)
    assert got.meets_target and "chosen, over" not in got.table()


@pytest.mark.parametrize("limit", [1 << 50, 10 * machine_memory()])
def test_a_memory_limit_beyond_the_machine_is_the_machines(limit):
    m = leanrnn.GRU(8, 64, seed=1)
    asked = []

    def measure(b, c):
        asked.append((b, c))
        return 1e-9  # latency never binds: only memory could

    got = tuning.tune(m.session, latency=1.0, memory_limit=limit, measure=measure,
                      max_batch=1 << 40, max_chunk=1 << 20)  # fmt: skip
    cap = machine_memory() // 2
    assert got.memory_limit == cap
    assert all(tuning.call_bytes(m.session, b, c) <= cap for b, c in asked)
