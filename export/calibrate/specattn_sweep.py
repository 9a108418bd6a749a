"""SpecAttn calibration: fit the layer map, then measure sparse verification for each draft top-p.

The layer map compares, on calibration rows, every target layer's attention with each draft layer's: the EAGLE
block's, or each layer of an `lm` drafter (export.calibrate.layer_map). Each top_p is then measured for real, not
through a proxy: the KV reads saved and the target perplexity change come from teacher-forced forwards over the same
rows in which every query reads only the keys that the drafter's attention selects
(runtime.target.attention.kept_keys, as the engine does at each verify), and tau from greedy speculative generation
with the engine verifying sparsely. The largest saving whose perplexity increase stays within
calibrate.ppl_tolerance becomes specattn.json, which export carries into the bundle.

The same teacher-forced sweep runs once more with every target layer choosing its keys by its own attention: what
a drafter that predicted each layer's attention perfectly would select. No drafter can beat that ceiling, so the
report says how much of a shortfall is the drafter's and how much the target's.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from export.calibrate.layer_map import LayerMap, kl_similarity, plot_layer_map
from runtime.host_memory import release_freed_memory, returning_large_blocks
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.speculation.tau_probe import TauProbe
from runtime.target.attention import SpecAttnConfig, kept_keys, kv_reads, query_slices
from runtime.target.kv_cache import KVCache
from runtime.target.model import ForwardOutput, Taps, Transformer
from runtime.target.quant_kv_cache import QuantizedKVCache

DENSE_P = 1.0  # reads every key: the dense baseline the changes are relative to
QUERY_SLICE = 256  # queries per forward of a long row: its transients, draft slice and masked scores follow it


@dataclass(frozen=True)
class CalibrationRow:
    ids: torch.Tensor  # [T] token ids
    # [Lt, H, T-1, T-1] queries 1.., keys x_1.. (what the draft sees), renormalised; None where not kept (a long row
    # that only the top-p sweep reads: every layer's attention would not fit in memory)
    target_attention: torch.Tensor | None
    # [Ld, H, T, T]: per draft layer, query t's weights over the target's keys 0..t, as the drafter sees them
    # when it proposes x_{t+1} (the EAGLE pair at t, the lm's token x_t); None for a long row (draft_slices)
    draft_attention: torch.Tensor | None
    dense_nll: torch.Tensor  # [T-1] -log p(x_{t+1} | x_0..x_t) of the dense target
    # a long row's draft attention, its heads averaged per target kv head, computed afresh each time a sweep reads
    # it, `rows` queries at a time, of the layers asked (DrafterKind.draft_attention_slices): whole, it would not fit
    # (12.9 GB at 8k)
    draft_slices: Callable[[int, tuple[int, ...] | None], Iterator[torch.Tensor]] | None = None

    @property
    def draft_rows(self) -> torch.Tensor:
        """[Ld, H, T-1, T-1]: the draft attention in target_attention's frame, to compare the two."""
        return renormalised(self.draft_attention[:, :, 1:, 1:])


def renormalised(att: torch.Tensor) -> torch.Tensor:
    return att / att.sum(-1, keepdim=True).clamp_min(1e-12)


@torch.inference_mode()
def calibration_row(target: Transformer, kind: DrafterKind, model: nn.Module, ids: torch.Tensor,
                    target_attention: bool = True) -> CalibrationRow:
    """One row's target and draft attention (the target's only if `target_attention`). The draft's rows are in the
    target's key positions as the kind maps them (an EAGLE pair never sees x_0, which the target's queries do: key 0
    is dropped from the rows compared in the layer map, which are renormalised over x_1..)."""
    T = ids.numel()
    layers = tuple(range(target.config.n_layers)) if target_attention else ()
    taps = Taps(hidden_layers=Taps.entering(kind.reads(model)).hidden_layers, attention_layers=layers)
    out = target(ids[None], target.new_cache(1, T), torch.arange(T)[None], taps=taps, no_logits=True) \
        if target_attention else sliced_forward(target, ids, taps)
    nll = hidden_nll(target, out.hidden, ids)
    if not target_attention:  # a long row: its draft heads averaged per target kv head, all kept_keys reads of them
        return CalibrationRow(ids, None, None, nll,
                              partial(kind.draft_attention_slices, model, out, ids, target.config.n_kv_heads))
    att_t = renormalised(torch.stack([out.attention[i][0, :, 1:, 1:] for i in layers])).float()
    return CalibrationRow(ids, att_t, kind.draft_attention(model, out, ids).float(), nll)


def sliced_forward(target: Transformer, ids: torch.Tensor, taps: Taps = Taps(),
                   cache: KVCache | QuantizedKVCache | None = None) -> ForwardOutput:
    """The target's forward over ids [T], QUERY_SLICE queries at a time over a growing cache: its hidden states
    whole, its transients a slice's. `taps` without attention. A quantised `cache` (default: full precision) also
    bounds each slice by its exact depth, so every query reads the history as a one-token decode would."""
    T, device = ids.numel(), target.device
    ids, parts, start = ids.to(device), [], 0
    cache = target.new_cache(1, T) if cache is None else cache
    while start < T:
        n = min(T - start, QUERY_SLICE)
        if isinstance(cache, QuantizedKVCache):
            n = min(n, cache.exact_depth() + 1)
        parts.append(target(ids[None, start:start + n], cache, torch.arange(start, start + n, device=device)[None],
                            taps=taps, no_logits=True))
        cache.advance(n)
        start += n
    return ForwardOutput(None, torch.cat([p.hidden for p in parts], 1),
                         {k: torch.cat([p.layer_hidden[k] for p in parts], 1) for k in parts[0].layer_hidden})


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1].float(), ids[1:], reduction="none")


def hidden_nll(target: Transformer, hidden: torch.Tensor, ids: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """next_token_nll from the final hidden states [1, T, dim], through the head `rows` positions at a time: a long
    row's logits whole would take T x vocabulary floats (2.5 GB at 4,096 tokens of a 152k vocabulary); a few rows
    at a time keep the logits and their log-softmax small beside a sparse pass (docs/qwen.md)."""
    T = ids.numel()
    return torch.cat([F.cross_entropy(target.output(hidden[0, i:min(i + rows, T - 1)]).float(),
                                      ids[i + 1:min(i + rows, T - 1) + 1], reduction="none")
                      for i in range(0, T - 1, rows)])


def fit_layer_map(rows: list[CalibrationRow], dense_first: int) -> tuple[torch.Tensor, LayerMap]:
    """S [Ld, Lt] = -KL(target layer || draft layer), heads averaged, over every query row of every calibration
    row; the monotone map on it. At least one target layer stays mapped so that a shallow target gets measured."""
    K = max(r.ids.numel() - 1 for r in rows)  # rows differ in length: pad keys (weight 0 adds 0 to the KL)
    att_t = torch.cat([F.pad(r.target_attention.mean(1), (0, K - r.ids.numel() + 1)) for r in rows], dim=1)
    att_d = torch.cat([F.pad(r.draft_rows.mean(1), (0, K - r.ids.numel() + 1)) for r in rows], dim=1)
    S = kl_similarity(att_t, att_d)
    return S, LayerMap.fit(S, dense_first=min(dense_first, S.shape[1] - 1))


def draft_selector(row: CalibrationRow, rows: int, layers: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """[len(layers), H, rows, keys], `rows` queries at a time: query t's keys as the drafter's query that would
    propose x_{t+1} ranks them in each of the draft `layers`, as the engine's verify does for its root."""
    if row.draft_attention is None:  # map keeps no reference to a slice once it is handed on
        return map(torch.Tensor.float, row.draft_slices(rows, layers))
    return query_slices(row.draft_attention[list(layers)], rows)


def target_selector(row: CalibrationRow, rows: int, layers: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """[len(layers), H, rows, keys], `rows` queries at a time: each target layer's own attention, query t over
    keys 1..t (key 0, a sink, is always read): the ranking a drafter that predicted every layer perfectly would
    give. Use with the identity layer map."""
    return query_slices(F.pad(row.target_attention[list(layers)], (1, 0, 1, 0)), rows)


def slice_keep(ranked: torch.Tensor, start: int, end: int, n_kv: int, sparse: SpecAttnConfig) -> torch.Tensor:
    """kept_keys for queries start..end-1 ranked [Ld, H, rows, keys], a draft layer at a time: the search's
    temporaries then follow one layer, not all. The caller's slice is let go when this returns."""
    keep = torch.empty(ranked.shape[0], n_kv, end - start, end, dtype=torch.bool)
    for i, layer in enumerate(ranked):
        keep[i] = kept_keys(layer[None], torch.arange(start, end), end, n_kv, sparse.top_p, sparse.sink,
                            sparse.recent)[0]
    return keep


@torch.inference_mode()
def sparse_nll(target: Transformer, row: CalibrationRow, sparse: SpecAttnConfig,
               selector: Callable[[CalibrationRow, int, tuple[int, ...]], Iterator[torch.Tensor]] = draft_selector
               ) -> tuple[torch.Tensor, int, int]:
    """Teacher-forced sparse target on one row -> (nll [T-1], KV reads, dense KV reads). Query t reads the keys
    `selector` ranks highest in the prefix 0..t-1 (see kept_keys); key t itself is the token being verified and
    always read. The row runs as forwards of QUERY_SLICE queries over a growing cache, each with its slice's kept
    keys, ranked by the draft layers the map reads alone (a sibling's map reads about half of them)."""
    T, n_kv = row.ids.numel(), target.config.n_kv_heads
    cache, hidden, reads, dense = target.new_cache(1, T), [], 0, 0
    layers = sparse.draft_layers()
    slices, mapped = (selector(row, QUERY_SLICE, layers), sparse.over(layers)) if layers else (None, None)
    for start in range(0, T, QUERY_SLICE):
        end = min(start + QUERY_SLICE, T)
        keep = (mapped.layer_keep(slice_keep(next(slices), start, end, n_kv, sparse))  # the slice let go here
                if layers else [None] * target.config.n_layers)
        out = target(row.ids[None, start:end], cache, torch.arange(start, end)[None], kv_keep=keep, no_logits=True)
        cache.advance(end - start)
        hidden.append(out.hidden)
        slice_reads, slice_dense = kv_reads(keep, torch.ones(end - start, end, dtype=torch.bool).tril(start), n_kv)
        reads, dense = reads + slice_reads, dense + slice_dense
        del keep
        release_freed_memory()  # each slice's temporaries outgrow the last's: the heap's holes would not be reused
    return hidden_nll(target, torch.cat(hidden, 1), row.ids), reads, dense


def effective_keys(rows: list[torch.Tensor]) -> float:
    """Mean over attention rows (every layer, head and query of [..., S] distributions) of exp(entropy): how many
    keys a row spreads its mass over. A draft far below its target says its attention cannot pick their keys."""
    per_row = [torch.special.entr(a.double()).sum(-1).exp().flatten() for a in rows]
    return torch.cat(per_row).mean().item()


def perplexity(nll: list[torch.Tensor]) -> float:
    return math.exp(torch.cat(nll).double().mean().item())


def teacher_forced(target: Transformer, rows: list[CalibrationRow], sparse: SpecAttnConfig,
                   selector: Callable[[CalibrationRow, int, tuple[int, ...]], Iterator[torch.Tensor]],
                   dense_ppl: float) -> dict:
    """KV reads saved and perplexity over the rows, verifying sparsely with the keys `selector` ranks."""
    release_freed_memory()  # each measurement starts from what is live, not from the last one's freed buffers
    runs = [sparse_nll(target, r, sparse, selector) for r in rows]
    ppl = perplexity([nll for nll, _, _ in runs])
    return {"top_p": sparse.top_p, "kv_saved": 1 - sum(r for _, r, _ in runs) / sum(d for _, _, d in runs),
            "perplexity": ppl, "ppl_change": ppl / dense_ppl - 1}


def measure_top_p(target: Transformer, drafter: Drafter, rows: list[CalibrationRow], sparse: SpecAttnConfig,
                  dense_ppl: float, dense_tau: float, probe: TauProbe) -> dict:
    release_freed_memory()
    tau = probe.measure(target, drafter, sparse=sparse)
    return {**teacher_forced(target, rows, sparse, draft_selector, dense_ppl), "tau": tau["tau"],
            "tau_change": tau["tau"] / dense_tau - 1, "kv_saved_generating": tau["kv_saved"]}


def measure_ceiling(target: Transformer, rows: list[CalibrationRow], top_p: float, dense_first: int,
                    dense_ppl: float) -> dict:
    """KV reads saved and perplexity change when every target layer selects its keys by its own attention."""
    sparse = SpecAttnConfig(tuple(range(target.config.n_layers)), top_p, dense_first)
    return teacher_forced(target, rows, sparse, target_selector, dense_ppl)


def choose_top_p(sweep: list[dict], ppl_tolerance: float) -> dict | None:
    """The sweep entry saving the most KV reads with ppl_change <= ppl_tolerance; None when none qualifies."""
    ok = [r for r in sweep if r["ppl_change"] <= ppl_tolerance]
    return max(ok, key=lambda r: (r["kv_saved"], -r["top_p"])) if ok else None


def progress(items: list, what: str, unit: str):
    return tqdm(items, desc=f"calibrate: {what}", unit=unit, mininterval=1.0)


def plot_sparsity(sweep: list[dict], ceiling: list[dict], ppl_tolerance: float, dense_tau: float, path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5))
    ppl_ax, tau_ax = fig.subplots(1, 2)
    saved = [100 * r["kv_saved"] for r in sweep]
    for ax, key, scale, label in ((ppl_ax, "ppl_change", 100, "target perplexity change (%)"),
                                  (tau_ax, "tau", 1, "tau (tokens per target forward)")):
        ax.plot(saved, [scale * r[key] for r in sweep], marker="o", label="keys chosen by the draft's attention")
        for x, r in zip(saved, sweep):
            ax.annotate(f"p={r['top_p']}", (x, scale * r[key]), fontsize="x-small", xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("KV reads saved (%)")
        ax.set_ylabel(label)
    ppl_ax.plot([100 * r["kv_saved"] for r in ceiling], [100 * r["ppl_change"] for r in ceiling], marker=".",
                color="gray", label="ceiling: each target layer's own attention")
    ppl_ax.axhline(100 * ppl_tolerance, color="red", linestyle="--", linewidth=1, label="tolerance")
    ppl_ax.set_yscale("symlog", linthresh=1)  # linear within +-1%, where the tolerance sits; a poor draft lies far above
    tau_ax.axhline(dense_tau, color="gray", linestyle="--", linewidth=1, label="dense")
    for ax in (ppl_ax, tau_ax):
        ax.legend(loc="best", fontsize="small")
    fig.suptitle("SpecAttn: sparse verification by draft top-p")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


@returning_large_blocks()  # long rows: their large temporaries outgrow one another slice after slice
def calibrate_specattn(out: Path, target: Transformer, kind: DrafterKind, model: nn.Module, drafter: Drafter,
                       ids: list[torch.Tensor], *, dense_first: int, top_p: list[float], ppl_tolerance: float,
                       probe: TauProbe, dense_tau: float, long_ids: list[torch.Tensor] | None = None
                       ) -> tuple[dict[str, str], dict[str, float], str]:
    """Writes layer_map.json/.png, sparsity.json/.png and specattn.json (the chosen settings, top_p 1.0 = dense
    when no top_p keeps the perplexity within tolerance) to `out`; returns (outputs, metrics, message). `dense_tau`:
    the drafter's tau by `probe` verifying densely. With `long_ids` (calibrate.context) the top-p sweep reads those
    rows, and `probe` should draft at that context too; the layer map and the ceiling, which hold every target
    layer's attention, stay on `ids`."""
    rows = [calibration_row(target, kind, model, r) for r in progress(ids, "layer map rows", "row")]
    S, layer_map = fit_layer_map(rows, dense_first)
    settings = SpecAttnConfig(layer_map.mapping, DENSE_P, layer_map.dense_first)
    swept = rows if long_ids is None else [calibration_row(target, kind, model, r, target_attention=False)
                                           for r in progress(long_ids, "long-context rows", "row")]
    dense_ppl = perplexity([r.dense_nll for r in swept])
    sweep = []
    for p in progress(sorted(top_p), "SpecAttn top-p sweep", "top-p"):
        sparse = SpecAttnConfig(layer_map.mapping, p, layer_map.dense_first)
        sweep.append(measure_top_p(target, drafter, swept, sparse, dense_ppl, dense_tau, probe))
    chosen = choose_top_p(sweep, ppl_tolerance)
    rows_ppl = dense_ppl if swept is rows else perplexity([r.dense_nll for r in rows])
    ceiling = [measure_ceiling(target, rows, p, layer_map.dense_first, rows_ppl)
               for p in progress(sorted(top_p), "SpecAttn ceiling (target's own attention)", "top-p")]
    ceiling_chosen = choose_top_p(ceiling, ppl_tolerance)
    ceiling_saved = ceiling_chosen["kv_saved"] if ceiling_chosen else 0.0
    if chosen is not None:
        settings = SpecAttnConfig(layer_map.mapping, chosen["top_p"], layer_map.dense_first)
    spread = {"draft_attention_keys": effective_keys([r.draft_rows for r in rows]),
              "target_attention_keys": effective_keys([r.target_attention for r in rows])}
    report = {**spread, "dense_perplexity": dense_ppl, "dense_tau": dense_tau, "ppl_tolerance": ppl_tolerance,
              "sink": settings.sink, "recent": settings.recent, "rows": len(swept),
              "tokens": sum(r.ids.numel() for r in swept), "layer_map_tokens": sum(r.ids.numel() for r in rows),
              "chosen_top_p": settings.top_p, "sweep": sweep,
              "ceiling_kv_saved_at_ppl_tolerance": ceiling_saved, "ceiling_sweep": ceiling}
    (out / "layer_map.json").write_text(layer_map.to_json() + "\n")
    (out / "sparsity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "specattn.json").write_text(settings.to_json() + "\n")
    plot_layer_map(S, layer_map.mapping, out / "layer_map.png")
    plot_sparsity(sweep, ceiling, ppl_tolerance, dense_tau, out / "sparsity.png")

    # per target layer: how well the best draft layer's attention predicts it (-KL, 0 is perfect)
    metrics = {f"neg_kl_layer_{j}": float(v) for j, v in enumerate(S.max(0).values.tolist())}
    metrics |= spread | {"dense_perplexity": dense_ppl, "specattn_top_p": settings.top_p,
                "kv_saved_at_ppl_tolerance": chosen["kv_saved"] if chosen else 0.0,
                "ceiling_kv_saved_at_ppl_tolerance": ceiling_saved}
    for r in sweep:
        metrics |= {f"kv_saved_p{r['top_p']}": r["kv_saved"], f"ppl_change_p{r['top_p']}": r["ppl_change"],
                    f"tau_p{r['top_p']}": r["tau"]}
    outputs = {"layer_map": "layer_map.json", "layer_map_plot": "layer_map.png", "sparsity": "sparsity.json",
               "sparsity_plot": "sparsity.png", "specattn": "specattn.json"}
    ceiling_note = f"; the target's own attention would save {ceiling_saved:.0%} (the ceiling)"
    message = (f"SpecAttn top-p {chosen['top_p']} saves {chosen['kv_saved']:.0%} of KV reads at "
               f"{chosen['ppl_change']:+.2%} perplexity, tau {chosen['tau']:.2f} (dense {dense_tau:.2f})"
               if chosen else f"SpecAttn: no top-p within +{ppl_tolerance:.1%} perplexity, verification stays dense "
               f"(draft attention rows spread over {spread['draft_attention_keys']:.1f} keys, the target's over "
               f"{spread['target_attention_keys']:.1f})") + ceiling_note
    return outputs, metrics, message
