"""The README's usage example runs as written (keeps the README true)."""

from pathlib import Path

import numpy as np
import pytest

from tolerances import atol

torch = pytest.importorskip("torch")


def test_readme_usage_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("```python\nimport numpy as np, leanrnn\n\nlstm") + len("```python\n")
    code = text[start : text.index("```", start)]
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["y"].shape == (100, 8, 256)
    assert ns["s"].chunk is not None and ns["s"].plan.total <= 4 << 20
    # Both copies of the batch-first GRU compute what it does on batch-first input (a state dict
    # cannot carry batch_first: without the argument the copy read [N, T, C] as [T, N, C]).
    xb = np.random.default_rng(0).standard_normal((3, 7, 32)).astype(np.float32)
    with torch.no_grad():
        want = ns["gru"](torch.from_numpy(xb))[0].numpy()
    for m in (ns["m1"], ns["m2"]):
        np.testing.assert_allclose(m(xb)[0], want, rtol=0, atol=atol(np.float32))
