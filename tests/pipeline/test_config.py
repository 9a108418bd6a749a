import pytest

from pipeline.config import Config, dump_config, load_config
from pipeline.errors import DraftsmithError


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(overrides=["distill.steps=7", "validate.temperatures=[0.0, 0.7]", "target=/x"])
    assert cfg.distill.steps == 7 and cfg.validate.temperatures == [0.0, 0.7] and cfg.target == "/x"
    assert load_config().distill.steps == Config().distill.steps


def test_file_then_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("distill:\n  steps: 11\n  lr: 0.01\n")
    cfg = load_config(f, ["distill.lr=0.5"])
    assert (cfg.distill.steps, cfg.distill.lr) == (11, 0.5)


def test_dump_roundtrip(tmp_path):
    cfg = load_config(overrides=["data.max_records=5"])
    f = tmp_path / "c.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize("text, needle", [
    ("distill:\n  stepz: 3\n", "unknown key 'distill.stepz'"),
    ("distill:\n  steps: many\n", "distill.steps"),
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("- a\n- b\n", "mapping"),
    ("distill: [1\n", "not valid YAML"),
])
def test_bad_file_names_key_and_file(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(DraftsmithError) as e:
        load_config(f)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    if "YAML" not in needle and "mapping" not in needle:
        assert str(f) in msg


@pytest.mark.parametrize("pair, needle", [
    ("distill.stepz=3", "unknown key 'distill.stepz'"),
    ("distill.steps=abc", "distill.steps"),
    ("data.val_fraction=2", "data.val_fraction"),
    ("novalue", "expected key=value"),
])
def test_bad_override(pair, needle):
    with pytest.raises(DraftsmithError, match=needle.replace(".", r"\.")):
        load_config(overrides=[pair])


def test_missing_file():
    with pytest.raises(DraftsmithError, match="no such file"):
        load_config("/nonexistent/c.yaml")


def test_shipped_configs_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    # default.yaml documents the defaults exactly: every key, as `pipeline config` writes them
    assert (root / "default.yaml").read_text() == dump_config(Config())
    for f in root.glob("*.yaml"):
        load_config(f)


def test_qwen_coder_config_loads_with_presets_as_target_and_lm_base():
    from pathlib import Path

    from pipeline.presets import TARGET_PRESETS

    path = Path(__file__).resolve().parents[2] / "configs" / "qwen-coder.yaml"
    cfg = load_config(path)
    assert cfg.target == "qwen2.5-coder-1.5b-instruct" and cfg.target in TARGET_PRESETS
    assert cfg.data.cache_hidden and cfg.validate.num_prompts <= cfg.data.max_records * cfg.data.val_fraction
    sibling = load_config(path, ["drafter.kind=lm", "drafter.lm_base=qwen2.5-coder-0.5b-instruct"])
    assert sibling.drafter.lm_base in TARGET_PRESETS
