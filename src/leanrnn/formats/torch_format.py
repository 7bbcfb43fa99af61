"""PyTorch's nn.LSTM / nn.GRU / nn.RNN parameters <-> canonical weights.

PyTorch names parameters ``weight_ih_l{k}[_reverse]`` [G, C], ``weight_hh_l{k}`` [G, K],
``bias_ih_l{k}``/``bias_hh_l{k}`` [G], ``weight_hr_l{k}`` [P, H]; gate rows are (i, f, g, o) for
LSTM — already our order — and (r, z, n) for GRU, which we swap to (z, r, n). PyTorch's GRU is
linear_before_reset. torch itself is imported only by ``from_torch_module``.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from ..errors import SpecError, WeightsError
from ..spec import Activation, RNNSpec
from .packing import TORCH_ORDER, LayerWeights, reorder_gates

# At most 9 digits: a longer layer index is no real layer (and int() of a huge digit string is
# itself slow); such a key stays unmatched and is reported as unexpected.
_KEY = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh|weight_hr)_l(\d{1,9})(_reverse)?$")


def _suffix(d: int) -> str:
    return "_reverse" if d == 1 else ""


def _a(cell: str) -> str:
    return ("a " if cell == "gru" else "an ") + cell.upper()  # a GRU, an LSTM, an RNN


def infer_spec(sd: dict, cell: str | None = None, nonlinearity: str = "tanh",
               batch_first: bool = False) -> RNNSpec:  # fmt: skip
    """Read sizes (and, if ``cell`` is None, the cell) off a PyTorch RNN state dict."""
    if "weight_ih_l0" not in sd or "weight_hh_l0" not in sd:
        raise WeightsError(
            f"[from_state_dict] no weight_ih_l0/weight_hh_l0 among keys {sorted(sd)[:8]}; "
            "expected a torch.nn.LSTM/GRU/RNN state dict"
        )
    w_ih, w_hh = np.shape(sd["weight_ih_l0"]), np.shape(sd["weight_hh_l0"])
    if len(w_ih) != 2 or len(w_hh) != 2:
        raise WeightsError(
            f"[from_state_dict] weight_ih_l0 {w_ih}, weight_hh_l0 {w_hh}: expected 2-D"
        )
    if cell not in (None, "lstm", "gru", "rnn"):
        raise WeightsError(f"[from_state_dict] cell={cell!r}; expected 'lstm', 'gru', 'rnn' or "
                           "None (read off the weight shapes)")  # fmt: skip
    if nonlinearity not in ("tanh", "relu"):
        raise WeightsError(
            f"[from_state_dict] nonlinearity={nonlinearity!r}; expected 'tanh' or 'relu'"
        )
    G, C = w_ih
    proj = np.shape(sd["weight_hr_l0"])[0] if "weight_hr_l0" in sd else 0
    H = np.shape(sd["weight_hr_l0"])[1] if proj else w_hh[1]
    ratios = {4: "lstm", 3: "gru", 1: "rnn"}
    read = ratios.get(G // H) if H and not G % H else None  # the cell the shapes say
    if cell is None:
        if read is None:
            raise WeightsError(
                f"[from_state_dict] weight_ih_l0 has shape {tuple(w_ih)}: its {G} rows are not "
                f"4H, 3H or H for H={H} ({'weight_hr_l0' if proj else 'weight_hh_l0'}'s "
                "columns); torch stores it [gates*H, input_size] (transposed?)"
            )
        cell = read
    elif read is not None and read != cell:  # LSTM.from_state_dict(a GRU's): "expected (12, 3)"
        raise WeightsError(
            f"[from_state_dict] {_a(read)}'s state dict (weight_ih_l0 has {G} rows = "
            f"{G // H}H for H={H}), not {_a(cell)}'s; leanrnn.from_state_dict(sd) picks "
            "the class from the shapes"
        )
    else:
        # The cell fixes the gate count, so the input weights' rows give H; every other shape
        # is then checked against it (with a message naming the tensor that disagrees).
        ng = {"lstm": 4, "gru": 3, "rnn": 1}[cell]
        if G % ng:
            raise WeightsError(
                f"[from_state_dict] weight_ih_l0 has {G} rows; a {cell.upper()} needs a multiple of {ng}"
            )
        H = G // ng
    # The highest layer index is a declared count: the keys present must back it up before
    # anything loops over it (a key "weight_ih_l2147483647" must not buy 2**31 iterations).
    seen = {int(m.group(2)) for k in sd if (m := _KEY.match(k))}
    layers = 1 + max(seen)
    if layers != len(seen):
        gaps = [i for i in range(len(seen) + 1) if i not in seen][:1]
        raise WeightsError(
            f"[from_state_dict] keys name layer {layers - 1} but only {len(seen)} distinct "
            f"layers have keys (none for layer {gaps[0]}); a state dict holds layers 0..L-1 "
            "without gaps: drop the stray keys"
        )
    bidir = "weight_ih_l0_reverse" in sd
    acts = None
    if cell != "rnn" and nonlinearity != "tanh":  # torch's LSTM and GRU have no such choice
        raise WeightsError(f"[from_state_dict] nonlinearity={nonlinearity!r} for a "
                           f"{cell.upper()}; only an RNN takes one (its default is 'tanh')")  # fmt: skip
    if cell == "rnn":
        acts = ((Activation.make(nonlinearity),),) * (2 if bidir else 1)
    return RNNSpec(
        cell, int(C), int(H), num_layers=layers,
        direction="bidirectional" if bidir else "forward", proj_size=int(proj),
        bias="bias_ih_l0" in sd, batch_first=batch_first, activations=acts,
    )  # fmt: skip


def expected_keys(spec: RNNSpec) -> list[str]:
    keys = []
    for layer in range(spec.num_layers):
        for d in range(spec.num_directions):
            sfx = f"_l{layer}{_suffix(d)}"
            keys += [f"weight_ih{sfx}", f"weight_hh{sfx}"]
            if spec.bias:
                keys += [f"bias_ih{sfx}", f"bias_hh{sfx}"]
            if spec.proj_size:
                keys.append(f"weight_hr{sfx}")
    return keys


def param_shape(spec: RNNSpec, key: str) -> tuple[int, ...]:
    """The shape torch gives parameter ``key`` (one of expected_keys(spec))."""
    layer = int(key.split("_l")[1].split("_")[0])
    G, H, K = spec.gate_width, spec.hidden_size, spec.output_size
    if key.startswith("weight_ih"):
        return (G, spec.layer_input_size(layer))
    if key.startswith("weight_hh"):
        return (G, K)
    if key.startswith("weight_hr"):
        return (spec.proj_size, H)
    return (G,)


def from_state_dict(spec: RNNSpec, sd: dict) -> list[list[LayerWeights]]:
    """Canonical weights from a PyTorch-named dict of arrays (numpy, or anything np.asarray takes)."""
    want = expected_keys(spec)
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing or unexpected:
        raise WeightsError(
            f"[from_state_dict] missing keys {missing}; unexpected keys {unexpected} "
            f"(for {spec.cell.upper()} layers={spec.num_layers} directions={spec.num_directions} "
            f"bias={spec.bias} proj_size={spec.proj_size})"
        )
    H, K, G = spec.hidden_size, spec.output_size, spec.gate_width
    order = TORCH_ORDER[spec.cell]
    out = []
    for layer in range(spec.num_layers):
        C = spec.layer_input_size(layer)
        dirs = []
        for d in range(spec.num_directions):
            sfx = f"_l{layer}{_suffix(d)}"

            def get(name, shape, sfx=sfx):
                a = np.asarray(sd[name + sfx])
                if a.shape != shape:
                    raise WeightsError(
                        f"[from_state_dict] {name}{sfx} has shape {a.shape}; expected {shape}"
                    )
                return a

            W = reorder_gates(get("weight_ih", (G, C)), order, H)
            R = reorder_gates(get("weight_hh", (G, K)), order, H)
            if spec.bias:
                bW = reorder_gates(get("bias_ih", (G,)), order, H)
                bR = reorder_gates(get("bias_hh", (G,)), order, H)
            else:
                bW = np.zeros(G, W.dtype)
                bR = np.zeros(G, W.dtype)
            proj = get("weight_hr", (spec.proj_size, H)) if spec.proj_size else None
            dirs.append(LayerWeights(W, R, bW, bR, None, proj))
        out.append(dirs)
    return out


def to_state_dict(spec: RNNSpec, layers: list[list[LayerWeights]]) -> dict[str, np.ndarray]:
    """The inverse of ``from_state_dict``: PyTorch names and gate order. A spec PyTorch's
    modules cannot be (spec.beyond_torch: a reverse-only direction, peepholes, clip, ONNX's
    other activations...) is refused: its names would hold the weights and lose the rest, and
    the dict loaded back computed something else, silently (0.15-2.0 off)."""
    bad = spec.beyond_torch()
    if bad:
        raise SpecError(
            f"[state_dict] this {spec.cell.upper()} uses {', '.join(bad)}, which PyTorch's "
            "parameter names cannot record: save it as .lrnn (model.save) instead"
        )
    H = spec.hidden_size
    # Inverse permutation of TORCH_ORDER: source block k came from internal position inv[k].
    order = TORCH_ORDER[spec.cell]
    inv = tuple(order.index(k) for k in range(len(order)))
    sd = {}
    for layer, dirs in enumerate(layers):
        for d, lw in enumerate(dirs):
            sfx = f"_l{layer}{_suffix(d)}"
            sd[f"weight_ih{sfx}"] = reorder_gates(lw.W, inv, H)
            sd[f"weight_hh{sfx}"] = reorder_gates(lw.R, inv, H)
            if spec.bias:
                sd[f"bias_ih{sfx}"] = reorder_gates(lw.bW, inv, H)
                sd[f"bias_hh{sfx}"] = reorder_gates(lw.bR, inv, H)
            if spec.proj_size:
                sd[f"weight_hr{sfx}"] = lw.proj
    return sd


def tensor_array(v) -> np.ndarray:
    """A torch tensor's values as a numpy array: detached, on the CPU, contiguous; bfloat16,
    which numpy has no dtype for, as float32 (exact: its top 16 bits). Needs no torch import."""
    if str(v.dtype) == "torch.bfloat16":
        v = v.float()
    return v.detach().cpu().contiguous().numpy()


def module_weights(module, op: str) -> dict:
    """The weights a torch RNN module computes with, by torch's own list of them
    (``_flat_weights_names``): parametrized ones (``parametrizations.weight_norm``) resolved,
    a subclass's child modules left out (its state_dict holds both). A weight that is neither
    a parameter nor parametrized is a hook's: the old ``torch.nn.utils.weight_norm`` recomputes
    it before each forward, so it reads as of the last one (one optimizer step stale): refused."""
    from torch.nn.utils import parametrize, prune

    names = getattr(module, "_flat_weights_names", None) or list(module.state_dict())
    out = {}
    for k in names:
        if k not in module._parameters and not parametrize.is_parametrized(module, k):
            pruned = any(isinstance(h, prune.BasePruningMethod)
                         for h in module._forward_pre_hooks.values())  # fmt: skip
            fix = (f"torch.nn.utils.prune.remove(module, {k!r})" if pruned
                   else f"torch.nn.utils.remove_weight_norm(module, {k!r})")  # fmt: skip
            raise WeightsError(
                f"[{op}] the module's {k!r} is computed by a forward pre-hook (torch.nn.utils."
                "prune's, or the old torch.nn.utils.weight_norm's), so it holds the last "
                f"forward's value: make it a parameter again first ({fix}), or use a "
                "parametrization (torch.nn.utils.parametrize, parametrizations.weight_norm)"
            )
        out[k] = getattr(module, k)
    return out


def from_torch_module(module) -> tuple[RNNSpec, dict[str, np.ndarray]]:
    """(spec, numpy state dict) of a torch.nn.LSTM/GRU/RNN. Imports torch only here."""
    import torch

    lt = sys.modules.get("leanrnn.torch")  # (imported by whoever made such a module)
    if lt is not None and isinstance(module, lt._RNNBase):
        module = module.to_module()  # leanrnn.torch's modules: torch's names and weights
    kinds = {torch.nn.LSTM: "lstm", torch.nn.GRU: "gru", torch.nn.RNN: "rnn"}
    cell = next((c for t, c in kinds.items() if isinstance(module, t)), None)
    if cell is None:
        t = type(module)
        raise WeightsError(
            f"[from_torch] got {t.__module__}.{t.__qualname__}; expected torch.nn.LSTM, GRU or "
            "RNN (a model holding one: pass that submodule, e.g. model.rnn; a DataParallel or "
            "torch.compile wrapper: its .module or ._orig_mod; torch's quantized LSTM: load the "
            "float module and use leanrnn.quantize)"
        )
    params = module_weights(module, "from_torch")
    sd = {k: tensor_array(v) for k, v in params.items()}
    nonlin = getattr(module, "nonlinearity", "tanh")
    spec = infer_spec(sd, cell, nonlin, bool(module.batch_first))
    return spec, sd
