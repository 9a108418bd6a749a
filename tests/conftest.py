"""Shared fixtures: tiny random HF checkpoints of each supported family (one with a chat tokenizer), the real
SmolLM2 (slow tests), and the static steps' key spans."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

# served models keep their budget at every batch size unless a test asks for it measured (at load, which takes a while)
os.environ.setdefault("DRAFTSMITH_BATCH_POLICY", "fixed")
# a plain `pytest` keeps every cache inside the clone, as .ci/run does: a test run writes nothing into HOME
CACHES = {"DRAFTSMITH_HOME": "draftsmith", "XDG_CACHE_HOME": "xdg", "AIRFLOW_HOME": "airflow",
          "TORCH_EXTENSIONS_DIR": "torch_extensions", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
          "MPLCONFIGDIR": "mpl", "HF_HOME": "hf"}
for _variable, _folder in CACHES.items():
    os.environ.setdefault(_variable, str(Path(__file__).resolve().parents[1] / ".cache" / _folder))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def save_tiny_hf_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a randomly initialised HF `arch` model (config.json + model.safetensors) to `out`."""
    import transformers as T

    config_class = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
                    "mistral": T.MistralConfig}[arch]
    cfg = config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # the default init leaves biases and norms trivial; perturb them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="llama", **config_overrides) -> HF directory (cached per arguments)."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in made:
            made[key] = save_tiny_hf_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(params=[None, 16], ids=["one-span", "spans-switch"])
def min_span(request, monkeypatch):
    """The static steps' smallest key span: the default (one span: these tests' caches are shorter), or 16, so a
    generation's static steps attend over spans of 16, 32, 64 ... keys and change span as the context grows."""
    from runtime.speculation import cuda_graphs
    if request.param is not None:
        monkeypatch.setattr(cuda_graphs, "MIN_SPAN", request.param)
    return cuda_graphs.MIN_SPAN


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir) -> Path:
    """Qwen2-shaped: q/k/v biases (perturbed, so they matter), 2 kv heads, a tied head."""
    return tiny_model_dir("qwen2", tie_word_embeddings=True)


def save_tiny_gguf(hf_dir: Path, out: Path) -> Path:
    """The tiny HF `hf_dir` (a qwen2) written as an F32 GGUF, as llama.cpp names its tensors and fields, with a
    byte-level tokenizer of placeholder tokens: a file our converter reads like the real presets."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n = cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_scores([0.0] * n)  # no merges: transformers then ranks merges by score
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from pipeline.sources import resolve_target

    return resolve_target("smollm2-135m-instruct")


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_target(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny random llama plus a word-level tokenizer with a chat template (its 96 ids are words).

    Untied: with tied embeddings a random model just repeats its last token, which any drafter guesses."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("chat-target") / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    specials = ["<unk>", "<eos>", "<user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials), 96)])}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out
