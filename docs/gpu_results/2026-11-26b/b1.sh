# call A: first half of the GGUF + pydantic/gguf wheels
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p /tmp/parts /tmp/site && cp .xa/part_a /tmp/parts/ || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 2
PYTHONPATH=/tmp/site python3 -c "import pydantic, gguf, torch; print('A-ok', pydantic.__version__, torch.__version__)"
