"""Session 41: a model served under a name of dots only ('.', '..') was unreachable (clients
resolve /v2/models/../infer to /v2/infer)."""

from __future__ import annotations

import pytest

from leanrnn import cli


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_model_name_of_dots_only_is_refused(capsys, name):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", f"{name}=gru:8", "--no-grpc"])
    assert e.value.code == 2
    assert "dots only" in capsys.readouterr().err


def test_a_scheduler_stops_before_it_starts_and_as_a_context_manager():
    """stop() on a scheduler never started raised threading's RuntimeError; ``with`` starts
    and stops one (a dropped, running scheduler keeps its thread: the docstring says so)."""
    import threading

    import numpy as np

    import leanrnn
    from leanrnn.serve import Lane, Scheduler

    m = leanrnn.LSTM(8, 16, seed=0)

    def lane():
        return Lane("m", m, leanrnn.Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=4,
                    idle_timeout=1.0)  # fmt: skip

    Scheduler({"m": lane()}, max_wait=0.0).stop()
    before = threading.active_count()
    with Scheduler({"m": lane()}, max_wait=0.0) as s:
        done = threading.Event()
        x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
        r = s.submit("m", 7, True, True, x, on_done=lambda r: done.set())
        assert done.wait(10)
        np.testing.assert_allclose(r.y, m(x[:, None])[0][:, 0], atol=1e-6, rtol=0)
    assert threading.active_count() == before
