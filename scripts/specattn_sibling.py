"""SpecAttn with a sibling's attention: a same-tokenizer smaller LM (the `lm` drafter) chooses the target's keys.

calibrate's own functions (export/calibrate/specattn_sweep.py) on held-out documents: the layer map fitted on short
rows (every target layer's attention against every sibling layer's), then for each draft top-p the KV reads saved and
the target's perplexity change, teacher-forced over rows of `--context` tokens, and tau greedy-drafting after that
context with the sibling as the draft model (a 4-token chain); beside it the ceiling on the short rows, each target
layer choosing by its own attention. Prints a JSON line per top-p, then the summary.

    python scripts/specattn_sibling.py --target qwen2.5-coder-1.5b-instruct --sibling qwen2.5-coder-0.5b-instruct \\
        --context 1024
"""
from __future__ import annotations

import argparse
import json

import torch

from export.calibrate.specattn_sweep import (calibration_row, choose_top_p, fit_layer_map, measure_ceiling,
                                             perplexity, teacher_forced, draft_selector)
from pipeline.bench.long_context import held_out_documents
from pipeline.sources import resolve_target
from pipeline.tokens import generation_stop_ids
from runtime.drafters import get_kind
from runtime.drafters.lm import LMDrafter
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.tau_probe import TauProbe
from runtime.target.attention import SpecAttnConfig
from runtime.target.loading import from_pretrained


def token_rows(tokenizer, documents: list[str], n: int, length: int) -> list[torch.Tensor]:
    """n rows of `length` tokens: the documents one after another, cut into pieces."""
    ids = [t for doc in documents for t in tokenizer(doc + "\n\n", add_special_tokens=False).input_ids]
    rows = [torch.tensor(ids[i * length:(i + 1) * length]) for i in range(n)]
    if any(r.numel() < length for r in rows):
        raise SystemExit(f"the held-out documents hold {len(ids)} tokens, not {n} rows of {length}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--sibling", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2, help="rows of --context tokens the top-p sweep reads")
    p.add_argument("--map-rows", type=int, default=4, help="rows of --map-tokens the layer map is fitted on")
    p.add_argument("--map-tokens", type=int, default=256)
    p.add_argument("--top-p", default="0.5,0.7,0.8,0.9,0.95")
    p.add_argument("--dense-first", type=int, default=2)
    p.add_argument("--tau-tokens", type=int, default=32, help="new tokens per tau prompt (0: no tau)")
    p.add_argument("--tau-prompts", type=int, default=1, help="prompts of --context tokens tau drafts after")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args()
    from transformers import AutoTokenizer

    target_dir = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    docs = held_out_documents()
    long = token_rows(tokenizer, docs, args.rows + args.tau_prompts, args.context)
    long, tau_rows = long[:args.rows], long[args.rows:]  # tau drafts after held-out text the sweep did not read
    short = token_rows(tokenizer, docs[::-1], args.map_rows, args.map_tokens)
    max_len = args.context + args.tau_tokens + 16
    target = from_pretrained(target_dir, max_seq_len=max_len, lean=True)
    sibling = from_pretrained(resolve_target(args.sibling), max_seq_len=max_len, lean=True)
    kind = get_kind("lm")
    with torch.inference_mode():
        rows = [calibration_row(target, kind, sibling, r) for r in short]
        S, layer_map = fit_layer_map(rows, args.dense_first)
        del rows
        print(f"layer map (target layer -> sibling layer): {layer_map.mapping}", flush=True)
        swept = [calibration_row(target, kind, sibling, r, target_attention=False) for r in long]
        dense_ppl = perplexity([r.dense_nll for r in swept])
        budget = ServedBudget.parse("4x1").tree
        probe = TauProbe([r.tolist() for r in tau_rows], budget, args.tau_tokens, generation_stop_ids(target_dir))
        drafter = LMDrafter(sibling, max_len) if args.tau_tokens else None
        dense_tau = probe.measure(target, drafter)["tau"] if drafter else None
        sweep = []
        for top_p in map(float, args.top_p.split(",")):
            sparse = SpecAttnConfig(layer_map.mapping, top_p, layer_map.dense_first)
            r = teacher_forced(target, swept, sparse, draft_selector, dense_ppl)
            if drafter:
                tau = probe.measure(target, drafter, sparse=sparse)
                r |= {"tau": tau["tau"], "tau_change": tau["tau"] / dense_tau - 1,
                      "kv_saved_generating": tau["kv_saved"]}
            sweep.append(r)
            print(json.dumps(r), flush=True)
        del swept
        rows = [calibration_row(target, kind, sibling, r) for r in short]
        ceiling = [measure_ceiling(target, rows, float(top_p), layer_map.dense_first,
                                   perplexity([r.dense_nll for r in rows])) for top_p in args.top_p.split(",")]
    chosen, ceiling_chosen = choose_top_p(sweep, 0.01), choose_top_p(ceiling, 0.01)
    report = {"target": args.target, "sibling": args.sibling, "context": args.context, "rows": args.rows,
              "layer_map": layer_map.mapping, "dense_perplexity": dense_ppl, "dense_tau": dense_tau, "sweep": sweep,
              "chosen_at_1pct": chosen, "ceiling": ceiling, "ceiling_at_1pct": ceiling_chosen}
    print(json.dumps({k: report[k] for k in ("dense_perplexity", "dense_tau", "chosen_at_1pct", "ceiling_at_1pct")},
                     indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
