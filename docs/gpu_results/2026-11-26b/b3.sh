# call C: the default bundle on the real target, bf16 then fp32; graph rows (static verify + static EAGLE chains)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DRAFTSMITH_HOME=/tmp/dh PYTHONPATH=/tmp/site:$PWD COLUMNS=200
TD=$(cat /tmp/td) || { echo "call B's files are gone"; exit 3; }
{
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
git log --oneline -1
for DT in bfloat16 float32; do
echo "== real target, default bundle with its calibrated budget, validate's 16 held-out prompts, $DT"
timeout 240 python3 -m pipeline.cli bench --target $TD --drafter .xc/bundle --device cuda --dtype $DT --prompts .x2/val16.jsonl --max-new-tokens 128 --out $OUT/real_val16_$DT.json
done
} 2>&1 | grep -v "Loading weights\|UserWarning\|_warn_once\|de-quantizing\|Writing model" | tee $OUT/b3.log
