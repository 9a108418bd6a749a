"""Export a drafter's cache-free step to ONNX (torch's dynamo exporter) and check it against onnxruntime.

The exported step is what a serving stack without our runtime needs to draft:
  eagle:  input_ids [B, T], features [B, T, H] -> next features [B, T, H], draft logits [B, T, Vd]
          (pairs at positions 1..T, causal among themselves: EagleModel.causal on an empty cache)
  medusa: features [B, T, H] -> logits [B, T, K, Vd]
  lm:     input_ids [B, T] -> logits [B, T, V] (the small LM's own forward at positions 0..T-1, causal; its
          reduced draft vocabulary, if any, is a row selection the caller applies)
Batch and sequence axes are dynamic; weights are stored inside the one .onnx file so the bundle's sha256 of
that file covers them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from runtime.eagle import EagleModel
from runtime.medusa import MedusaHeads
from runtime.model import NoCache, Transformer, attention_mask

ONNX_FILE = "drafter.onnx"
KINDS = ("eagle", "medusa", "lm")
INPUT_NAMES = {"eagle": ("input_ids", "features"), "medusa": ("features",), "lm": ("input_ids",)}
OUTPUT_NAMES = {"eagle": ("next_features", "logits"), "medusa": ("logits",), "lm": ("logits",)}


class EagleStep(nn.Module):
    """EagleModel.causal on an empty cache, plus the draft head: the same forward, minus the KV bookkeeping."""

    def __init__(self, model: EagleModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        B, T = input_ids.shape
        positions = torch.arange(1, T + 1, device=input_ids.device).expand(B, T)
        empty = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        mask = attention_mask(empty, positions, T, None)
        next_features = self.model(input_ids, features, positions, NoCache(), None, T, mask)
        return next_features, self.model.head(next_features)


class LMStep(nn.Module):
    """The LM drafter's forward over whole sequences without a KV cache (Transformer.run_uncached)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model.run_uncached(input_ids).logits


def drafter_step(drafter: nn.Module, kind: str) -> nn.Module:
    """The module that is exported (and that parity is measured against) for a drafter of `kind`, in eval mode."""
    expected = {"eagle": EagleModel, "medusa": MedusaHeads, "lm": Transformer}
    if kind not in expected:
        raise ValueError(f"ONNX export: kind {kind!r} is not one of {KINDS}")
    if not isinstance(drafter, expected[kind]):
        raise ValueError(f"ONNX export: kind {kind!r} takes drafter type {expected[kind].__name__}, "
                         f"got {type(drafter).__name__}")
    dtype = next(drafter.parameters()).dtype
    if dtype != torch.float32:  # onnxruntime's CPU kernels (and numpy, for parity) have no bfloat16
        raise ValueError(f"ONNX export: the drafter is {dtype}, expected torch.float32 (cast it with .float())")
    step = {"eagle": EagleStep, "lm": LMStep}.get(kind)  # medusa's heads are their own step
    return (step(drafter) if step else drafter).eval()


def example_inputs(drafter: nn.Module, kind: str, batch: int, seq: int, seed: int = 0) -> dict[str, Tensor]:
    """Random inputs of the right names and shapes (token ids within the target vocabulary)."""
    drafter_step(drafter, kind)  # the same kind, type and dtype checks as the export
    g = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        return {"input_ids": torch.randint(0, drafter.embed_weight.shape[0], (batch, seq), generator=g),
                "features": torch.randn(batch, seq, drafter.cfg.dim, generator=g)}
    if kind == "lm":
        return {"input_ids": torch.randint(0, drafter.config.vocab_size, (batch, seq), generator=g)}
    return {"features": torch.randn(batch, seq, drafter.cfg.hidden_size, generator=g)}


def _ordered(kind: str, inputs: dict[str, Tensor]) -> tuple[Tensor, ...]:
    if set(inputs) != set(INPUT_NAMES[kind]):
        raise ValueError(f"ONNX {kind} step takes inputs {INPUT_NAMES[kind]}, got {sorted(inputs)}")
    return tuple(inputs[name] for name in INPUT_NAMES[kind])


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
                          input_names=list(INPUT_NAMES[kind]), output_names=list(OUTPUT_NAMES[kind]),
                          dynamic_shapes={name: axes for name in INPUT_NAMES[kind]})
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
    got = session.run(list(OUTPUT_NAMES[kind]), {n: t.cpu().numpy() for n, t in zip(INPUT_NAMES[kind], args)})
    with torch.no_grad():
        want = step(*args)
    want = want if isinstance(want, tuple) else (want,)
    max_abs, max_rel = 0.0, 0.0
    for name, g, w in zip(OUTPUT_NAMES[kind], got, want):
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"ONNX output {name!r} has shape {tuple(g.shape)}, torch gives {tuple(w.shape)}")
        error = (torch.from_numpy(g).float() - w.float()).abs()
        diff = float(torch.nan_to_num(error, nan=float("inf")).max())  # a NaN must fail, not vanish in max()
        max_abs, max_rel = max(max_abs, diff), max(max_rel, diff / max(1.0, float(w.abs().max())))
    return {"onnxruntime": ort.__version__, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "tolerance": tolerance, "passed": max_rel <= tolerance}
