"""Export a drafter's cache-free step to ONNX (torch's dynamo exporter) and check it against onnxruntime.

The exported step is what a serving stack without our runtime needs to draft; each kind names its inputs and
outputs (runtime.speculation.drafter.DrafterKind.onnx_inputs/onnx_outputs) and builds the step (onnx_step). Batch and
sequence axes are dynamic; weights are stored inside the one .onnx file so the bundle's sha256 of that file covers them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from runtime.drafters import get_kind

ONNX_FILE = "drafter.onnx"


def drafter_step(drafter: nn.Module, kind: str) -> nn.Module:
    """The module that is exported (and that parity is measured against) for a drafter of `kind`, in eval mode."""
    k = get_kind(kind)
    if not k.onnx_inputs:
        raise ValueError(f"ONNX export: a {kind} drafter has no ONNX step")
    if not isinstance(drafter, k.module_type):
        raise ValueError(f"ONNX export: kind {kind!r} takes drafter type {k.module_type.__name__}, "
                         f"got {type(drafter).__name__}")
    dtype = next(drafter.parameters()).dtype
    if dtype != torch.float32:  # onnxruntime's CPU kernels (and numpy, for parity) have no bfloat16
        raise ValueError(f"ONNX export: the drafter is {dtype}, expected torch.float32 (cast it with .float())")
    return k.onnx_step(drafter).eval()


def example_inputs(drafter: nn.Module, kind: str, batch: int, seq: int, seed: int = 0) -> dict[str, Tensor]:
    """Random inputs of the right names and shapes (token ids within the target vocabulary)."""
    drafter_step(drafter, kind)  # the same kind, type and dtype checks as the export
    return get_kind(kind).onnx_example(drafter, batch, seq, torch.Generator().manual_seed(seed))


def _ordered(kind: str, inputs: dict[str, Tensor]) -> tuple[Tensor, ...]:
    names = get_kind(kind).onnx_inputs
    if set(inputs) != set(names):
        raise ValueError(f"ONNX {kind} step takes inputs {names}, got {sorted(inputs)}")
    return tuple(inputs[name] for name in names)


def export_onnx(drafter: nn.Module, kind: str, inputs: dict[str, Tensor], path: str | Path) -> dict:
    """Write the drafter's step to `path` (one self-contained file) and return a record for the manifest."""
    import onnx

    step = drafter_step(drafter, kind)
    args = _ordered(kind, inputs)
    batch, seq = args[0].shape[:2]
    if batch < 2 or seq < 2:  # torch.export specialises size-1 dims to constants: the axis would not be dynamic
        raise ValueError(f"ONNX export: example inputs need batch >= 2 and seq >= 2, got batch={batch}, seq={seq}")
    axes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    path = Path(path)
    with torch.no_grad():
        torch.onnx.export(step, args, str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=list(get_kind(kind).onnx_inputs),
                          output_names=list(get_kind(kind).onnx_outputs),
                          dynamic_shapes={name: axes for name in get_kind(kind).onnx_inputs})
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)

    def dims(values) -> dict[str, list]:
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    return {"file": path.name, "kind": kind, "torch": torch.__version__, "onnx": onnx.__version__,
            "opset": max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
            "inputs": dims(proto.graph.input), "outputs": dims(proto.graph.output)}


def check_onnx_parity(drafter: nn.Module, kind: str, path: str | Path, inputs: dict[str, Tensor],
                      tolerance: float = 1e-5) -> dict:
    """Run the exported file with onnxruntime on CPU and the torch step on the same inputs. Errors are measured
    relative to each output's largest magnitude (at least 1): logits reach the hundreds, where fp32 rounding
    alone differs by ~1e-6 relative, i.e. ~1e-3 absolute, between two correct implementations."""
    import onnxruntime as ort

    step = drafter_step(drafter, kind)
    args = _ordered(kind, inputs)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    k = get_kind(kind)
    got = session.run(list(k.onnx_outputs), {n: t.cpu().numpy() for n, t in zip(k.onnx_inputs, args)})
    with torch.no_grad():
        want = step(*args)
    want = want if isinstance(want, tuple) else (want,)
    max_abs, max_rel = 0.0, 0.0
    for name, g, w in zip(k.onnx_outputs, got, want):
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"ONNX output {name!r} has shape {tuple(g.shape)}, torch gives {tuple(w.shape)}")
        error = (torch.from_numpy(g).float() - w.float()).abs()
        diff = float(torch.nan_to_num(error, nan=float("inf")).max())  # a NaN must fail, not vanish in max()
        max_abs, max_rel = max(max_abs, diff), max(max_rel, diff / max(1.0, float(w.abs().max())))
    return {"onnxruntime": ort.__version__, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "tolerance": tolerance, "passed": max_rel <= tolerance}
