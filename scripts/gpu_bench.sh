#!/usr/bin/env bash
# Every GPU measurement on a CUDA machine (docs/gpu.md, "How to reproduce them"). Writes logs and JSON under
# ${OUT:-gpu_out}.
# Optional: TARGET=<HF dir, .gguf or preset> BUNDLE=<exported bundle> [PROMPTS=<jsonl>] to bench a real drafter;
# BUNDLE may name several, space-separated (e.g. an eagle and an eagle3 run's bundles on the same data): each is
# benched side by side into real_bf16_<run id>.json;
# FLASHINFER_WHEELS=dir of wheels (flashinfer-python, apache-tvm-ffi, einops) to try the flashinfer backend (QUICK too);
# with TARGET/BUNDLE, SPECATTN_TOP_P=p to time SpecAttn sparse verification through sdpa and through triton_sparse;
# BUDGET=DxW/N+L@T: the real-bundle run again with that draft budget (a GPU affords bigger verifies than calibrate's),
# or BUDGET=device: with the bundle's device candidate that runs fastest on this GPU, as serving chooses it;
# QUICK=1: only what no GPU has measured yet: the kernel table, the static steps' costs (also at serving's cache length,
# over key spans and over the whole cache), the SmolLM2-shape bf16 bench, and where a graphed speculative step's time
# goes (pipeline.bench.step_profile).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
{
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m kernels.gpu_check --out "$OUT/kernels.json"
python3 -m pipeline.bench.step_costs --random-weights smollm2-135m --dtype bfloat16 --out "$OUT/step_costs_bf16.json"
python3 -m pipeline.bench.step_costs --random-weights smollm2-135m --dtype bfloat16 --compile --budgets 2x3/6,4x4/16 \
  --out "$OUT/step_costs_bf16_compiled.json"
# serving's cache (the target's 4096 tokens): steps over the key span that holds the context, against the whole cache
python3 -m pipeline.bench.step_costs --random-weights smollm2-135m --dtype bfloat16 --budgets 2x3/6 --cache-len 4096 \
  --out "$OUT/step_costs_bf16_cache4096.json"
python3 -m pipeline.bench.step_costs --random-weights smollm2-135m --dtype bfloat16 --budgets 2x3/6 --cache-len 4096 \
  --min-span 4096 --out "$OUT/step_costs_bf16_cache4096_whole.json"
python3 -m pipeline.bench.random_weights --random-weights smollm2-135m --dtype bfloat16 --max-new-tokens 128 --compile \
  --out "$OUT/smollm2_bf16.json"
python3 -m pipeline.bench.step_profile --random-weights smollm2-135m --dtype bfloat16 --budget 2x3/6 \
  --out "$OUT/step_profile_bf16.json"
# the graph rows across key spans (up to 384 keys: spans of 256 and 512), in fp32, where their tokens equal our AR's
python3 -m pipeline.bench.random_weights --random-weights smollm2-135m --dtype float32 --max-new-tokens 320 --n-prompts 2 \
  --out "$OUT/smollm2_fp32_spans.json"
if [ -n "$FLASHINFER_WHEELS" ]; then  # each path against sdpa, then the eager rows through flashinfer end to end
  echo "== flashinfer"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fi \
      "$FLASHINFER_WHEELS"/*.whl \
    && PYTHONPATH=/tmp/fi timeout ${FLASHINFER_TIMEOUT:-240} python3 -m pipeline.bench.flashinfer_check \
    && DRAFTSMITH_ATTENTION_BACKEND=flashinfer PYTHONPATH=/tmp/fi timeout ${FLASHINFER_TIMEOUT:-240} \
      python3 -m pipeline.bench.random_weights --random-weights smollm2-135m --dtype bfloat16 --max-new-tokens 128 \
      --out "$OUT/smollm2_bf16_flashinfer.json"
  echo "flashinfer exit $?"
fi
[ -n "$QUICK" ] && exit 0
python3 -m pipeline.bench.random_weights --random-weights smollm2-135m --dtype float32 --max-new-tokens 64 --out "$OUT/smollm2_fp32.json"
python3 -m pipeline.bench.random_weights --random-weights llama3-8b --dtype bfloat16 --max-new-tokens 128 --compile \
  --out "$OUT/llama3_8b_bf16.json"
if [ -n "$TARGET" ] && [ -n "$BUNDLE" ]; then
  for bundle in $BUNDLE; do
    run=$(basename "$(dirname "$(dirname "$bundle")")")  # runs/<id>/export/bundle -> <id>
    python3 -m pipeline.cli bench --target "$TARGET" --drafter "$bundle" --device cuda --dtype bfloat16 \
      ${PROMPTS:+--prompts "$PROMPTS"} --max-new-tokens 128 --compile --out "$OUT/real_bf16_$run.json"
    if [ -n "$BUDGET" ]; then
      python3 -m pipeline.cli bench --target "$TARGET" --drafter "$bundle" --device cuda --dtype bfloat16 \
        ${PROMPTS:+--prompts "$PROMPTS"} --max-new-tokens 128 --compile --budget "$BUDGET" \
        --out "$OUT/real_bf16_budget_$run.json"
    fi
    for backend in ${SPECATTN_TOP_P:+sdpa triton_sparse}; do
      DRAFTSMITH_ATTENTION_BACKEND=$backend python3 -m pipeline.cli bench --target "$TARGET" --drafter "$bundle" \
        --device cuda --dtype bfloat16 ${PROMPTS:+--prompts "$PROMPTS"} --max-new-tokens 128 \
        --specattn-top-p "$SPECATTN_TOP_P" --out "$OUT/real_bf16_specattn_${backend}_$run.json"
    done
  done
fi
} 2>&1 | tee "$OUT/all.log"
