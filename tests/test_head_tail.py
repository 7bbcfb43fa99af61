"""benchmarks/head_tail.py at a tiny size: both of leanrnn's tails (and onnxruntime where
installed) on 1 and 2 threads; the script stops if the two tails' products differ."""

from pathlib import Path


def test_head_tail_runs_both_tails(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import head_tail

    # 50 rows x 128 x 200 is past PACKED_MATMUL_PARALLEL_MACS: on 2 threads the padded tail's
    # one launch, compared bit for bit with the one-panel tail's two
    assert head_tail.main(["--rows", "7", "50", "--threads", "1", "2", "--classes", "200",
                           "--inputs", "128", "--samples", "3"]) == 0  # fmt: skip
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["7"], ["50"])]  # fmt: skip
    assert sorted((r[0], r[1]) for r in rows) == [("50", "1"), ("50", "2"), ("7", "1"), ("7", "2")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
