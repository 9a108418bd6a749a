"""A .gguf checkpoint -> a plain HF safetensors directory, through transformers' GGUF reader, one tensor at a time.

transformers dequantizes a whole GGUF into one state dict before it builds the model, and its GGUF-loaded models
refuse save_pretrained: loading, rebuilding and saving held three fp32 copies of the weights.
Here each tensor is dequantized, renamed and written into a shard of at most SHARD_BYTES, so the converter holds
one shard and one tensor; the names and the per-family fixes (Llama's q/k permutation) are transformers' own.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.errors import DraftsmithError
from pipeline.home import atomic_dir
from runtime.target.model_config import ARCHITECTURES

SHARD_BYTES = 1 << 30
# GGUF general.architecture -> the HF model_type it converts to (llama.cpp files Mistral under llama)
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def supported_families() -> str:
    return ", ".join(ARCHITECTURES)


def gguf_architecture(gguf: Path) -> str:
    """The GGUF's general.architecture, read from its header (the weights stay unread); a one-line error for a
    file that is not a GGUF."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    try:
        arch = read_field(GGUFReader(gguf), "general.architecture")
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise DraftsmithError(f"target {gguf}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if not arch:
        raise DraftsmithError(f"target {gguf}: GGUF header has no general.architecture")
    return arch[0]


def check_gguf_family(gguf: Path) -> str:
    arch = gguf_architecture(gguf)
    if arch not in GGUF_FAMILIES:
        raise DraftsmithError(f"target {gguf}: GGUF architecture {arch!r} is not supported; supported families: "
                              f"{supported_families()}")
    return arch


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Convert a .gguf checkpoint into an HF safetensors directory at `out` (once; atomic): config.json,
    generation_config.json, the tokenizer, and the weights dequantized to fp32 in shards."""
    if (out / "config.json").exists():
        return out
    arch = check_gguf_family(gguf)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kw = dict(gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    with torch.device("meta"):  # names and shapes only: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    with atomic_dir(out) as tmp:
        write_weights(gguf, arch, skeleton, tmp)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def write_weights(gguf: Path, arch: str, skeleton, out: Path) -> None:
    """Dequantize every tensor of `gguf` the HF model `skeleton` has, into fp32 safetensors shards in `out` (with
    an index where there is more than one)."""
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=load_gguf_checkpoint(str(gguf))["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    expected = {k for k in skeleton.state_dict()
                if not (k == "lm_head.weight" and skeleton.config.tie_word_embeddings)}
    shards: list[dict[str, str]] = []
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        shards.append(dict.fromkeys(shard, name))
        shard.clear()

    reader = GGUFReader(gguf)
    for tensor in tqdm(reader.tensors, desc=f"convert {gguf.name}", unit="tensor"):
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"tensors": {}})
        if result.name not in names:
            continue
        shard[names[result.name]] = torch.from_numpy(result.weights.astype("float32", copy=True))
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    weight_map = {k: v for s in shards for k, v in s.items()}
    missing = sorted(expected - weight_map.keys())
    if missing:
        raise DraftsmithError(f"target {gguf}: the GGUF lacks {len(missing)} weights of a {skeleton.config.model_type}"
                              f" model, e.g. {missing[0]}")
    if len(shards) == 1:
        (out / "model-00001.safetensors").rename(out / "model.safetensors")
        return
    total = sum(4 * skeleton.get_parameter(k).numel() for k in weight_map)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
