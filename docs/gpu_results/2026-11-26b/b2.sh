# call B: second half of the GGUF + transformers 5.24 (the version that converted the target the bundle is bound to)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DRAFTSMITH_HOME=/tmp/dh PYTHONPATH=/tmp/site:$PWD
test -f /tmp/parts/part_a && test -d /tmp/site || { echo "call A's files are gone: fresh machine"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wtf/*.whl || exit 1
mkdir -p /tmp/t && G=/tmp/t/SmolLM2-135M-Instruct.Q4_1.gguf && cat /tmp/parts/part_a .xb/part_b > $G || exit 1
echo "$(cat .x2/gguf.sha256)  $G" | sha256sum -c || exit 4
python3 -c "import transformers, torch, pydantic; print('transformers', transformers.__version__, 'torch', torch.__version__, 'pydantic', pydantic.__version__)"
TD=$(python3 -c "from pipeline.sources import resolve_target; print(resolve_target('$G'))" 2>/dev/null | tail -1)
echo "$TD" > /tmp/td; echo "target dir $TD"
echo "$(cat .x2/model.sha256)  $TD/model.safetensors" | sha256sum -c || exit 5
diff $TD/config.json .x2/config.json && echo config-same
echo B-ok
