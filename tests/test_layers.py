"""The one-way layers (STYLE.md): cli/bench -> engine -> kernels, memory -> spec, errors; the engine
reads the graph IR (leanrnn.ir) and never a file format's importer."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import leanrnn

SRC = Path(leanrnn.__file__).parent
IMPORTERS = ("formats.onnx_import", "formats.native", "formats.torch_format", "formats.checkpoint")
ABOVE_ENGINE = ("nn", "graph_model", "loading", "onnx_backend", "cli", "commands", "bench",
                "score", "serve", "train", "torch")  # fmt: skip
THIRD_PARTY = ("!onnx", "!torch")  # the packages themselves (kernels.reference reads torch modules)

# Per layer (a package or a module, relative to leanrnn): what it must not import, or with
# "only", everything it may import from leanrnn (its own package always allowed).
RULES = {
    "kernels": {"forbid": ("engine", "memory", "ir", *IMPORTERS, *ABOVE_ENGINE)},
    "engine": {"forbid": (*IMPORTERS, *ABOVE_ENGINE, *THIRD_PARTY)},
    "memory": {"only": ("errors", "config")},
    "errors": {"only": ()},
    "spec": {"only": ("errors",)},
    # the IR converts an RNN node's weights to internal gate order: packing's LayerWeights and
    # gate orders (the packed-weights layout every importer targets; no importer)
    "ir": {"only": ("errors", "spec", "formats.packing")},
}


def imports_of(path: Path) -> set[str]:
    """Every leanrnn module ``path`` imports, relative to leanrnn ("engine.session"), resolving
    relative imports; ``from pkg import name`` counts pkg.name when that is a module, else pkg.
    Imports inside functions count too."""
    rel = path.relative_to(SRC).with_suffix("")
    package = list(rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(["leanrnn", *base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            names = [
                f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod for a in node.names
            ]
        else:
            continue
        for n in names:
            if n.split(".")[0] in ("torch", "onnx"):
                found.add("!" + n.split(".")[0])  # the third-party package
            if n.startswith("leanrnn."):
                found.add(n[len("leanrnn.") :])
    return found


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    return bool(parts) and (
        SRC.joinpath(*parts).with_suffix(".py").is_file() or SRC.joinpath(*parts).is_dir()
    )


def _layer_files(layer: str) -> list[Path]:
    d = SRC / layer
    return sorted(d.rglob("*.py")) if d.is_dir() else [SRC / f"{layer}.py"]


def _covers(name: str, target: str) -> bool:
    return name == target or name.startswith(target + ".")


def violations(layer: str) -> list[str]:
    rule = RULES[layer]
    bad = []
    for path in _layer_files(layer):
        for name in sorted(imports_of(path)):
            if _covers(name, layer):
                continue
            if "forbid" in rule:
                wrong = any(_covers(name, f) for f in rule["forbid"])
            else:
                wrong = not any(_covers(name, o) for o in rule["only"])
            if wrong:
                bad.append(f"{path.relative_to(SRC)} imports leanrnn.{name}")
    return bad


@pytest.mark.parametrize("layer", sorted(RULES))
def test_imports_run_one_way(layer):
    assert violations(layer) == []


def test_the_checker_sees_a_wrong_import(tmp_path, monkeypatch):
    """Each kind of import the rules must catch, in a fake engine module: absolute, relative,
    ``from package import module``, and one inside a function."""
    fake = tmp_path / "leanrnn"
    for f in ("engine/_fork.py", "formats/native.py", "formats/checkpoint.py", "nn.py"):
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    cases = {
        "import leanrnn.formats.onnx_import": "formats.onnx_import",
        "from ..formats import native": "formats.native",
        "from ..nn import Model": "nn",
        "def f():\n    from ..formats.checkpoint import sniff": "formats.checkpoint",
        "import torch": "!torch",
        "import onnx.helper": "!onnx",
    }
    for code, caught in cases.items():
        (fake / "engine" / "bad.py").write_text(code + "\n")
        got = violations("engine")
        assert got and caught in got[0], (code, got)
    (fake / "engine" / "bad.py").write_text(
        "from ..formats.packing import pack\nfrom . import _fork\n"
    )
    assert violations("engine") == []


def test_engine_import_loads_no_importer():
    """``import leanrnn.engine`` (and its graph runtime) loads no file-format importer, no onnx,
    no torch: nothing after loading knows where a model came from."""
    code = (
        "import json, sys, leanrnn.engine, leanrnn.engine.graph, leanrnn.ir\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    mods = set(json.loads(out.stdout))
    assert "leanrnn.engine.graph.session" in mods  # the check looks at a real import
    forbidden = {f"leanrnn.{m}" for m in IMPORTERS} | {"onnx", "torch"}
    assert not mods & forbidden, sorted(mods & forbidden)
    assert not {m for m in mods if m.startswith(("onnx.", "torch."))}
