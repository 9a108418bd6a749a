"""The calibrate stage: drafter weight quantisation chosen by measured tau, and the SpecAttn layer map.

Quantisation touches only the drafter: the target's weights and therefore its perplexity are unchanged; what a
scheme can cost is acceptance, so each candidate is judged by the tau it reaches in the runtime.
The layer map compares the target's attention with the EAGLE drafter's on calibration rows; a top-p sweep on
the draft attention reports how many KV reads SpecAttn would save and how much target attention mass the kept
keys cover (a proxy for the perplexity change of sparse verification, which the runtime does not run yet).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from export.layer_map import DENSE, LayerMap, kl_similarity, plot_layer_map
from export.quant import QuantScheme, dequantize_state_dict, quantize_state_dict, relative_errors
from kernels.topp import topp_mask_torch
from pipeline.distill import draft_budget, load_target, measure_tau
from pipeline.runstore import StageResult
from pipeline.stages import StageContext
from runtime.drafters import DRAFT_VOCAB, draft_head
from runtime.model import Taps, Transformer, attention_mask
from train.data import TokenizedSet, prompts_from

NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class CalibrateSettings:
    schemes: tuple[str, ...] = ("int8", "int4-g128", "int4-g64", "int4-g32")
    tau_prompts: int = 4
    tau_new_tokens: int = 32
    map_prompts: int = 4
    map_tokens: int = 64  # calibration rows are truncated here: attention memory grows as T^2 per layer
    dense_first: int = 2
    top_p: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95, 0.99)


SETTINGS = CalibrateSettings()


# ---------------------------------------------------------------- drafter weights


def build_drafter_model(config: dict, target: Transformer, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The eagle/medusa module exactly as runtime.drafters.build_drafter builds it, from in-memory tensors."""
    cfg = {k: v for k, v in config.items() if k != "kind"}
    if config["kind"] == "eagle":
        from runtime.eagle import EagleModel

        model = EagleModel(target.config, target.tok_embeddings.weight, draft_head(target, tensors),
                           target.max_seq_len + 64)
    elif config["kind"] == "medusa":
        from runtime.medusa import MedusaConfig, MedusaHeads

        model = MedusaHeads(MedusaConfig(**cfg), draft_head(target, tensors))
    else:
        raise ValueError(f"drafter kind {config['kind']!r} has no weights to calibrate (expected eagle or medusa)")
    model.load_state_dict({k: v for k, v in tensors.items() if k != DRAFT_VOCAB}, strict=True)
    return model.to(target.dtype).eval()


def runtime_drafter(kind: str, model: torch.nn.Module, target: Transformer):
    from runtime.eagle import EagleDrafter
    from runtime.medusa import MedusaDrafter

    return EagleDrafter(model, target.max_seq_len + 64) if kind == "eagle" else MedusaDrafter(model)


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def choose_scheme(candidates: list[dict], tolerance: float) -> str:
    """The smallest stored scheme whose relative tau drop is within `tolerance`; "fp32" when none is."""
    ok = [c for c in candidates if "tau_drop" in c and c["tau_drop"] <= tolerance]
    return min(ok, key=lambda c: c["bytes"])["scheme"] if ok else "fp32"


def calibrate_quant(ctx: StageContext, target: Transformer, config: dict, tensors: dict[str, torch.Tensor],
                    prompts: list[list[int]], s: CalibrateSettings) -> dict:
    """Measure tau for fp32 and each scheme, write quant.json (+ quant.safetensors unless fp32 wins)."""
    budget, kind = draft_budget(ctx), config["kind"]

    def tau_of(weights: dict[str, torch.Tensor]) -> float:
        model = build_drafter_model(config, target, weights)
        return measure_tau(target, runtime_drafter(kind, model, target), prompts, budget, s.tau_new_tokens)["tau"]

    fp32_tau = tau_of(tensors)
    candidates, packed = [], {}
    for name in s.schemes:
        scheme = QuantScheme.parse(name)
        try:
            packed[name] = quantize_state_dict(tensors, scheme)
        except ValueError as e:  # e.g. an input dim that is not a multiple of the group size
            candidates.append({"scheme": name, "skipped": str(e)})
            continue
        restored = dequantize_state_dict(packed[name], scheme, dtype=target.dtype)
        tau = tau_of(restored)
        candidates.append({"scheme": name, "tau": tau, "tau_drop": (fp32_tau - tau) / fp32_tau,
                           "rel_error": max(relative_errors(tensors, restored).values(), default=0.0),
                           "bytes": stored_bytes(packed[name])})
    tolerance = ctx.cfg.calibrate.tau_tolerance
    chosen = choose_scheme(candidates, tolerance)
    report = {"chosen": chosen, "fp32_tau": fp32_tau, "fp32_bytes": stored_bytes(tensors),
              "tau_tolerance": tolerance, "tau_prompts": len(prompts), "candidates": candidates,
              "target_perplexity": "unchanged: only drafter weights are quantised"}
    (ctx.out / "quant.json").write_text(json.dumps(report, indent=2) + "\n")
    if chosen != "fp32":
        save_file(packed[chosen], str(ctx.out / "quant.safetensors"), metadata={"scheme": chosen})
    return report


# ---------------------------------------------------------------- SpecAttn layer map


def shared_key_attention(target: Transformer, eagle, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One calibration row set -> (target [Lt, H, T-1, T-1], draft [1, H, T-1, T-1]) over the keys both see.

    Draft pair j = (x_{j+1}, f_j) sits at position j+1 and attends pairs 0..j, i.e. tokens x_1..x_{j+1}; the
    target's query at position j+1 also sees x_0, which the draft never does, so it is dropped and the target
    rows renormalised over x_1..x_{j+1}.
    """
    T = ids.numel()
    layers = tuple(range(target.config.n_layers))
    out = target.run(ids[None], target.new_cache(1, T), torch.arange(T)[None], taps=Taps(attention_layers=layers),
                     no_logits=True)
    att_t = torch.stack([out.attention[i][0, :, 1:, 1:] for i in layers])
    att_t = att_t / att_t.sum(-1, keepdim=True).clamp_min(1e-12)
    # EagleModel.causal on an empty cache, asking the block's attention for its weights
    cache = eagle.new_cache(1, T - 1)
    positions = 1 + torch.arange(T - 1)[None]
    mask = attention_mask(cache.lengths, positions, T - 1, None)
    x = eagle.fc(torch.cat([F.embedding(ids[None, 1:], eagle.embed_weight), out.hidden[:, :-1]], -1))
    cos, sin = eagle.rope_cos[positions].unsqueeze(2), eagle.rope_sin[positions].unsqueeze(2)
    b = eagle.block
    _, att_d = b.attention(b.attention_norm(x), 0, cache, cache.slots(T - 1), T - 1, mask, cos, sin, True)
    return att_t, att_d


def pad_keys(att: torch.Tensor, S: int) -> torch.Tensor:
    return F.pad(att, (0, S - att.shape[-1]))


@torch.inference_mode()
def calibration_attention(target: Transformer, eagle, rows: list[torch.Tensor]):
    """Stack every row of every prompt: (target [Lt, H, R, S], draft [1, H, R, S], valid keys [R, S])."""
    pairs = [shared_key_attention(target, eagle, ids) for ids in rows]
    S = max(t.shape[-1] for t, _ in pairs)
    att_t = torch.cat([pad_keys(t, S) for t, _ in pairs], dim=2)
    att_d = torch.cat([pad_keys(d, S) for _, d in pairs], dim=2)  # batch 1 doubles as Ld = 1
    valid = torch.cat([pad_keys(torch.ones(t.shape[-2], t.shape[-1]).tril().bool(), S) for t, _ in pairs])
    return att_t.float(), att_d.float(), valid


def topp_sweep(att_t: torch.Tensor, att_d: torch.Tensor, valid: torch.Tensor, layer_map: LayerMap,
               ps: tuple[float, ...]) -> list[dict]:
    """Per p: KV reads saved by the draft's per-head top-p keep-set, and target mass those keys cover in the
    mapped target layers (each read through the draft layer it is mapped to)."""
    mapped = [(j, m) for j, m in enumerate(layer_map.mapping) if m != DENSE]
    rows = []
    for p in ps:
        keep = topp_mask_torch(att_d, p)[0] & valid  # padding keys have weight 0 and are never real reads
        saved = 1 - keep.sum().item() / (valid.sum().item() * keep.shape[0] * keep.shape[1])
        mass = [(att_t[j] * keep[m]).sum(-1).mean().item() for j, m in mapped]
        rows.append({"top_p": p, "kv_saved": saved, "target_mass": sum(mass) / len(mass) if mass else None})
    return rows


def plot_sparsity(sweep: list[dict], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    ps = [r["top_p"] for r in sweep]
    ax.plot(ps, [r["kv_saved"] for r in sweep], marker="o", label="KV reads saved")
    if all(r["target_mass"] is not None for r in sweep):
        ax.plot(ps, [r["target_mass"] for r in sweep], marker="s", label="target attention mass kept")
    ax.set_xlabel("draft top-p")
    ax.set_ylim(0, 1.02)
    ax.set_title("SpecAttn sparsity")
    ax.legend(loc="lower left", fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def calibrate_layer_map(ctx: StageContext, target: Transformer, eagle, rows: list[torch.Tensor],
                        s: CalibrateSettings) -> dict:
    att_t, att_d, valid = calibration_attention(target, eagle, rows)
    S = kl_similarity(att_t.mean(1), att_d.mean(1))  # [Ld, Lt], heads averaged
    # keep at least one layer mapped so a shallow target still gets a sparsity estimate
    layer_map = LayerMap.fit(S, dense_first=min(s.dense_first, S.shape[1] - 1))
    sweep = topp_sweep(att_t, att_d, valid, layer_map, s.top_p)
    (ctx.out / "layer_map.json").write_text(layer_map.to_json() + "\n")
    (ctx.out / "sparsity.json").write_text(json.dumps(sweep, indent=2) + "\n")
    plot_layer_map(S, layer_map.mapping, ctx.out / "layer_map.png")
    plot_sparsity(sweep, ctx.out / "sparsity.png")
    # per target layer: how well the best draft layer's attention predicts it (-KL, 0 is perfect)
    metrics = {f"neg_kl_layer_{j}": float(v) for j, v in enumerate(S.max(0).values.tolist())}
    for r in sweep:
        metrics[f"kv_saved_p{r['top_p']}"] = r["kv_saved"]
        if r["target_mass"] is not None:
            metrics[f"target_mass_p{r['top_p']}"] = r["target_mass"]
    return metrics


# ---------------------------------------------------------------- the stage


def calibration_rows(ts: TokenizedSet, n: int, max_tokens: int) -> list[torch.Tensor]:
    rows = [ts.row(i)[0][:max_tokens] for i in range(len(ts))]
    rows = [r for r in rows if r.numel() >= 3][:n]  # a row needs two shared keys to say anything
    if not rows:
        raise ValueError(f"calibrate: no validation row has >= 3 tokens ({len(ts)} rows)")
    return rows


def run_calibrate(ctx: StageContext, s: CalibrateSettings = SETTINGS) -> StageResult:
    distill = ctx.input("distill")
    config = json.loads((distill / "drafter_config.json").read_text())
    kind = config["kind"]
    if kind not in ("eagle", "medusa"):
        (ctx.out / "quant.json").write_text(json.dumps({"chosen": NOT_APPLICABLE, "candidates": []}) + "\n")
        return StageResult(outputs={"quant": "quant.json"}, metrics={},
                           message=f"{kind} drafter has no weights: quantisation and layer map not applicable")
    target = load_target(ctx)
    tensors = load_file(str(distill / "drafter.safetensors"))
    val = TokenizedSet.load(ctx.input("prepare") / "val.safetensors")
    prompts = prompts_from(val, s.tau_prompts)
    if not prompts:
        raise ValueError("calibrate: the validation split has no row with a prompt before its assistant turn")
    quant = calibrate_quant(ctx, target, config, tensors, prompts, s)
    outputs = {"quant": "quant.json"}
    if quant["chosen"] != "fp32":
        outputs["quant_weights"] = "quant.safetensors"
    metrics = {"fp32_tau": quant["fp32_tau"], "quant_bytes_ratio": next(
        (c["bytes"] / quant["fp32_bytes"] for c in quant["candidates"] if c["scheme"] == quant["chosen"]), 1.0)}
    metrics.update({f"tau_{c['scheme']}": c["tau"] for c in quant["candidates"] if "tau" in c})
    message = f"quant: {quant['chosen']} (fp32 tau {quant['fp32_tau']:.2f}); "
    if kind == "eagle":
        eagle = build_drafter_model(config, target, tensors)
        metrics.update(calibrate_layer_map(ctx, target, eagle, calibration_rows(val, s.map_prompts, s.map_tokens),
                                           s))
        outputs.update(layer_map="layer_map.json", layer_map_plot="layer_map.png", sparsity="sparsity.json",
                       sparsity_plot="sparsity.png")
        p = s.top_p[len(s.top_p) // 2]
        message += f"layer map fitted, draft top-p {p} saves {metrics[f'kv_saved_p{p}']:.0%} of KV reads; "
    else:
        message += "layer map not applicable (medusa has no attention); "
    message += "sparse verification in the runtime is not yet wired"
    return StageResult(outputs=outputs, metrics=metrics, message=message)
