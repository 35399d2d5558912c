"""Shared test fixtures: tiny checkpoints of every dtype, raw header builders, CLI runners.

Everything here is small and generic; area-specific helpers live in ``tests/helpers_<area>.py``.

Markers: ``slow`` tests run only with ``--runslow`` (or ``-m slow``); ``gpu`` tests are skipped
without CUDA.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Fixtures shared by many test files, registered here once (a test file importing them would shadow
# its own parameter names): the offline Hub server, and the tiny fp8-ready Llama.
from helpers_hub import hub  # noqa: F401
from helpers_quant import llama  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
SHARDKIT_BIN = str(Path(sys.executable).with_name("shardkit"))

# Every safetensors code that has a torch dtype in the torch versions we support, in a fixed order.
TORCH_DTYPE_CODES = [
    "BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
    "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
]
# Shapes chosen to hit the edge cases: scalar, empty, odd sizes, a few KB.
EDGE_SHAPES = [(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4), (33, 17)]


# ----------------------------------------------------------------------------- pytest plumbing

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--runslow") or "slow" in (config.getoption("-m") or "")
    # importing torch costs seconds: only ask about CUDA when a gpu test was collected
    has_cuda = any("gpu" in item.keywords for item in items) and _has_cuda()
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch missing is a broken env, not a skip reason
        return False


# ----------------------------------------------------------------------------- tensors

def torch_dtype(code: str) -> Any:
    from shardkit.formats.dtypes import to_torch

    return to_torch(code)


def random_tensor(code: str, shape: tuple[int, ...], *, seed: int = 0) -> Any:
    """A tensor of ``code`` whose bytes are random (every bit pattern, NaNs included).

    BOOL gets only 0/1 bytes, the only valid bool encodings.
    """
    import torch

    dtype = torch_dtype(code)
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if code == "BOOL":
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).to(torch.bool)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def make_state_dict(codes: list[str] | None = None, *, shapes: list[tuple[int, ...]] | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """One tensor per (dtype, shape), names like ``layers.F32.2``; bytes random but seeded."""
    tensors = {}
    for i, code in enumerate(codes or TORCH_DTYPE_CODES):
        for j, shape in enumerate(shapes or [(5, 3)]):
            tensors[f"layers.{code}.{j}"] = random_tensor(code, shape, seed=seed * 1000 + i * 50 + j)
    return tensors


def float_state_dict(*, seed: int = 0) -> dict[str, Any]:
    """Finite float tensors of every castable dtype plus int/bool tensors (for --dtype tests)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "a.f32": torch.randn(64, 33, generator=gen) * 100,
        "b.f16": torch.randn(17, 5, generator=gen).to(torch.float16),
        "c.bf16": torch.randn(40, generator=gen).to(torch.bfloat16),
        "d.f64": torch.randn(3, 7, generator=gen, dtype=torch.float64),
        "e.i64": torch.randint(-(2**40), 2**40, (9,), generator=gen),
        "f.i32": torch.randint(-1000, 1000, (4, 4), generator=gen, dtype=torch.int32),
        "g.bool": torch.rand(11, generator=gen) > 0.5,
        "h.u8": torch.randint(0, 256, (13,), generator=gen, dtype=torch.uint8),
        "i.f32.special": torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, 3.4e38, 65504.0, 7e4]),
    }


def tensor_bytes(t: Any) -> bytes:
    """The raw little-endian bytes of a tensor (works for every dtype, fp8 included)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same names, dtypes, shapes and bytes for every tensor (NaN payloads included)."""
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert tensor_bytes(got) == tensor_bytes(want), name


def load_folder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of every .safetensors file in a folder, via the official reader."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        part = load_file(str(path))
        assert not set(part) & set(out), f"duplicate tensors in {path}"
        out.update(part)
    return out


@pytest.fixture
def state_dict() -> dict[str, Any]:
    """Every torch-representable safetensors dtype, in edge-case shapes, random bytes."""
    return make_state_dict(shapes=EDGE_SHAPES)


@pytest.fixture
def safetensors_file(tmp_path: Path, state_dict: dict[str, Any]) -> Path:
    """``state_dict`` saved by safetensors' own writer as ``src/model.safetensors``."""
    from safetensors.torch import save_file

    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(state_dict, str(path), metadata={"format": "pt"})
    return path


# ----------------------------------------------------------------------------- raw files

def write_raw_safetensors(path: str | os.PathLike[str], header: dict | str | bytes, data: bytes = b"", *,
                          length: int | None = None, pad: bool = False) -> Path:
    """Write ``<u64 length><header><data>`` by hand, for sub-byte dtypes and malformed files.

    ``header`` may be a dict (JSON-encoded), a str or raw bytes; ``length`` overrides the
    length prefix (to lie about it); ``pad`` pads the JSON with spaces to a multiple of 8.
    """
    if isinstance(header, dict):
        raw = json.dumps(header, separators=(",", ":")).encode()
    elif isinstance(header, str):
        raw = header.encode()
    else:
        raw = header
    if pad:
        raw += b" " * (-len(raw) % 8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def raw_header(specs: list[tuple[str, str, list[int], int]]) -> tuple[dict, int]:
    """``[(name, dtype, shape, nbytes)]`` laid out back to back → (header dict, buffer bytes)."""
    doc, cursor = {}, 0
    for name, dtype, shape, nbytes in specs:
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    return doc, cursor


# ----------------------------------------------------------------------------- folders

def snapshot(path: str | os.PathLike[str]) -> dict[str, str]:
    """Relative path → sha256 of every file under ``path`` (hidden files included)."""
    root = Path(path)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def leftovers(folder: str | os.PathLike[str]) -> list[str]:
    """Names in ``folder`` (recursively) that look like shardkit temporaries or staging dirs."""
    root = Path(folder)
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".shardkit-" in p.name)


# ----------------------------------------------------------------------------- models

TINY_UNET_CONFIG: dict[str, Any] = {
    "block_out_channels": [8, 16],
    "layers_per_block": 1,
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 8,
    "norm_num_groups": 4,
    "attention_head_dim": 2,
}


def tiny_unet(seed: int = 0) -> Any:
    """A ~51k-parameter diffusers ``UNet2DConditionModel`` with random weights, in eval mode."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(**TINY_UNET_CONFIG).eval()


def realign(model: Any) -> Any:
    """Move every parameter and buffer into a fresh (64-byte aligned) allocation.

    CPU kernels round differently depending on how their inputs are aligned, and tensors
    mmapped from any safetensors file (the reference writer's too) sit at arbitrary 8-byte
    offsets. Comparing forward outputs bit for bit is only meaningful after this.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def unet_forward(model: Any, *, seed: int = 1) -> Any:
    """A deterministic forward pass of a tiny UNet (weights realigned first, see :func:`realign`)."""
    import torch

    realign(model)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(1, 4, 8, 8, generator=gen)
    context = torch.randn(1, 3, TINY_UNET_CONFIG["cross_attention_dim"], generator=gen)
    with torch.no_grad():
        return model(sample, torch.tensor([10]), encoder_hidden_states=context).sample


def tiny_clip_text_config() -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=16, projection_dim=16,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)


def tiny_bert_config() -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=16, pad_token_id=0)


@pytest.fixture
def unet_model() -> Any:
    return tiny_unet()


# ----------------------------------------------------------------------------- running the CLI

@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def invoke_cli(*args: Any, input: str | None = None) -> CliResult:
    """Run ``shardkit ARGS`` in-process through the real entry point's error mapping."""
    from click.testing import CliRunner

    from shardkit.cli import cli
    from shardkit.cli.common import run_cli as run_group

    runner = CliRunner()
    with runner.isolation(input=input) as (out, err, _):
        code = run_group(cli, [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args])
    return CliResult(code, out.getvalue().decode(), err.getvalue().decode())


@pytest.fixture
def run_cli() -> Callable[..., CliResult]:
    """``run_cli("split", src, out, "--max-shard-size", "1KB")`` → :class:`CliResult`."""
    return invoke_cli


def shardkit_subprocess(*args: Any, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``.venv/bin/shardkit ARGS`` as a real process (text output captured)."""
    return subprocess.run([SHARDKIT_BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


@pytest.fixture
def run_shardkit() -> Callable[..., subprocess.CompletedProcess]:
    return shardkit_subprocess


def assert_one_line_error(result: CliResult | subprocess.CompletedProcess, *, code: int = 2,
                          contains: str | None = None) -> str:
    """Exit ``code`` with exactly one non-empty stderr line (no traceback); returns the line."""
    exit_code = result.exit_code if isinstance(result, CliResult) else result.returncode
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert exit_code == code, (exit_code, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    if contains is not None:
        assert contains.lower() in lines[0].lower(), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- a real object store

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One SeaweedFS S3 server for the session (skipped with the reason where ``weed`` cannot run)."""
    from helpers_s3 import start_or_skip

    server = start_or_skip(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket and the standard AWS_* variables naming the server (``~/.aws`` hidden)."""
    from helpers_s3 import S3Env, new_bucket

    env = s3_server.client_env()
    env["AWS_CONFIG_FILE"] = str(tmp_path / "no-aws-config")
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp_path / "no-aws-credentials")
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return S3Env(s3_server, new_bucket(s3_server), env)
