"""The README's usage example runs as written (keeps the README true)."""

from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_readme_usage_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("```python\nimport numpy as np, torch, leanrnn") + len("```python\n")
    code = text[start : text.index("```", start)]
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["y"].shape == (100, 8, 256)
    assert ns["s"].chunk is not None and ns["s"].plan.total <= 4 << 20
