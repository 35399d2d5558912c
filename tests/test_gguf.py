"""GGUF as a source: the container reader, the ggml kernels (judged by ``gguf.quants``), info/verify/split/convert."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, snapshot
from helpers_gguf import (
    gguf_dequantized,
    llama_cpp_unpermute,
    random_blocks,
    tiny_llama_config,
    write_gguf,
    write_llama_gguf,
    write_raw_gguf,
)
from safetensors.torch import load_file

import shardkit
from shardkit.formats.gguf import ggml_type, read_gguf
from shardkit.layouts.ggml import dequantize, quantize

gguf = pytest.importorskip("gguf")


# ----------------------------------------------------------------------------- kernels, judged by gguf.quants


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "BF16"])
def test_dequantize_is_bit_equal_to_gguf(qtype: str) -> None:
    raw = random_blocks(qtype, 96, seed=hash(qtype) % 1000)
    ref = gguf.quants.dequantize(raw.reshape(4, -1), gguf.GGMLQuantizationType[qtype]).reshape(-1)
    ours = dequantize(raw.tobytes(), ggml_type(qtype)).numpy()
    assert np.array_equal(ref.view(np.uint32), ours.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"])
def test_quantize_is_bit_equal_to_gguf(qtype: str) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((48, 128)) * rng.uniform(1e-3, 5, size=(48, 1))).astype(np.float32)
    values[0, :32] = 0  # an all-zero block: scale 0
    values[1, :32] = 0.5  # ties
    values[2, :32] = -values[2, :32].max()  # the largest magnitude negative
    ref = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype]).view(np.uint8).reshape(-1)
    assert np.array_equal(quantize(torch.from_numpy(values), ggml_type(qtype)).numpy(), ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_quantize_of_bf16_and_f16_values_is_bit_equal_to_gguf(qtype: str, source: torch.dtype) -> None:
    """Values that came from bf16/f16 weights (few mantissa bits: products land on float32 ties often); q4_0 once
    differed here in 4 of 4608 bytes (its scaling was done in float64, gguf-py's in float32)."""
    torch.manual_seed(0)
    values = torch.cat([torch.randn(64, 256) * 0.05, torch.randn(64, 256) * 3]).to(source).float()
    ref = gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType[qtype]).view(np.uint8).reshape(-1)
    assert np.array_equal(quantize(values, ggml_type(qtype)).numpy(), ref)


def test_q8_0_rounding_matches_gguf_at_every_half() -> None:
    """Round half away from zero, at and one float32 step either side of every k + 0.5 a Q8_0 code can take."""
    from shardkit.layouts.ggml_quantize import roundf

    halves = np.arange(-128, 128, dtype=np.float32) + np.float32(0.5)
    x = np.concatenate([halves, np.nextafter(halves, np.float32(0)), np.nextafter(halves, np.float32(-1e9)),
                        np.nextafter(halves, np.float32(1e9)), np.arange(-127, 128, dtype=np.float32)])
    assert np.array_equal(roundf(x), gguf.quants.np_roundf(x))


# ----------------------------------------------------------------------------- hostile containers


def _header(kv: bytes = b"", kv_count: int = 0, tensors: bytes = b"", tensor_count: int = 0,
            version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count) + kv + tensors


def _string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def _tensor(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def _pad(head: bytes, data: bytes) -> bytes:
    return head + b"\0" * (-len(head) % 32) + data


HOSTILE = {
    "not gguf": (b"GGUF"[::-1] + bytes(40), "not a GGUF file"),
    "version 1": (_header(version=1), "version 1"),
    "big-endian": (_header(version=3 << 24), "big-endian"),
    "kv count": (_header(kv_count=2**60), "cannot fit"),
    "key length": (_header(_string("k", 2**40) + bytes(64), kv_count=1), "over the"),
    "string value": (_header(_string("k") + struct.pack("<I", 8) + _string("v", 2**62) + bytes(64), kv_count=1),
                     "over the"),
    "string past the end": (_header(_string("k") + struct.pack("<I", 8) + _string("v", 2**20) + bytes(64),
                                    kv_count=1), "file ends"),
    "array count": (_header(_string("k") + struct.pack("<IIQ", 9, 4, 2**40) + bytes(64), kv_count=1), "claims"),
    "value type": (_header(_string("k") + struct.pack("<I", 99) + bytes(64), kv_count=1), "unknown value type"),
    "alignment": (_header(_string("general.alignment") + struct.pack("<II", 4, 24) + bytes(64), kv_count=1),
                  "power of two"),
    "dims": (_pad(_header(tensors=_tensor("w", (1, 1, 1, 1, 1), 0, 0), tensor_count=1), b""), "dimensions"),
    "ggml type": (_pad(_header(tensors=_tensor("w", (4,), 77, 0), tensor_count=1), bytes(16)), "unknown ggml type"),
    "partial block": (_pad(_header(tensors=_tensor("w", (16,), 8, 0), tensor_count=1), bytes(64)), "not a multiple"),
    "past the end": (_pad(_header(tensors=_tensor("w", (64,), 0, 0), tensor_count=1), bytes(16)), "runs past"),
    "misaligned": (_pad(_header(tensors=_tensor("w", (4,), 0, 8), tensor_count=1), bytes(64)), "alignment"),
    "overlap": (_pad(_header(tensors=_tensor("a", (8,), 0, 0) + _tensor("b", (8,), 0, 0), tensor_count=2),
                     bytes(64)), "overlaps"),
    "duplicate": (_pad(_header(tensors=_tensor("a", (8,), 0, 0) + _tensor("a", (8,), 0, 32), tensor_count=2),
                       bytes(64)), "twice"),
    "bad utf-8": (_header(_string(b"\xff\xfe") + struct.pack("<I", 4) + bytes(64), kv_count=1), "utf-8"),
    # issue 41: a zero-element tensor with a dimension torch cannot hold (before: converted, exit 0)
    "zero-element 2^64-1 rows": (_pad(_header(tensors=_tensor("w", (0, 2**64 - 1), 0, 0), tensor_count=1),
                                      bytes(64)), "2^63"),
    "zero-element 2^63 columns": (_pad(_header(tensors=_tensor("w", (2**63, 0), 0, 0), tensor_count=1),
                                       bytes(64)), "2^63"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_one_line_naming_the_field(case: str, tmp_path: Path, run_cli) -> None:
    data, needle = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    before = snapshot(tmp_path)
    assert_one_line_error(run_cli("info", path), contains=needle)
    assert_one_line_error(run_cli("convert", path, tmp_path / "out", "--dtype", "bf16"), contains=needle)
    result = run_cli("verify", path)
    assert result.exit_code == 1 and needle.lower() in result.stdout.lower(), result.stdout
    assert snapshot(tmp_path) == before


def test_the_reader_agrees_with_gguf_on_a_file_gguf_wrote(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = write_gguf(tmp_path / "m.gguf", "flux", {"a.weight": (rng.standard_normal((64, 96)), "Q8_0"),
                                                   "a.bias": (rng.standard_normal(64), "F32"),
                                                   "b.weight": (rng.standard_normal((32, 64)), "F16")})
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(str(path))
    assert ours.architecture == "flux" and ours.alignment == 32
    assert [(t.name, t.kind.id, t.offset, t.nbytes, t.shape) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in reversed(t.shape)))
        for t in theirs.tensors]


# ----------------------------------------------------------------------------- Llama GGUF → Hugging Face


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = tiny_llama_config()
    state = transformers.LlamaForCausalLM(config).state_dict()
    folder = tmp_path_factory.mktemp("llama-gguf")
    return write_llama_gguf(folder / "llama-q8_0.gguf", state, config, "Q8_0"), state


def test_info_names_the_gguf_layout(llama_gguf, run_cli) -> None:
    path, state = llama_gguf
    result = run_cli("info", path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "gguf" and doc["tensor_count"] == len(state)
    assert doc["quantization"]["architecture"] == "llama"
    assert set(doc["quantization"]["ggml_types"]) == {"Q8_0", "F32"}
    assert doc["bytes_by_dtype"].keys() == {"Q8_0", "F32"} and "model.layers.0.self_attn.q_proj.weight" in {
        t["name"] for t in doc["largest"]} | {n for n in state if "q_proj" in n}
    assert doc["memory_bytes"]["fp32"] == sum(t.numel() * 4 for t in state.values())
    assert "GGUF v3 llama: Q8_0" in run_cli("info", path).stdout


def test_quantized_tensors_need_a_dtype(llama_gguf, tmp_path: Path, run_cli) -> None:
    path, _ = llama_gguf
    line = assert_one_line_error(run_cli("convert", path, tmp_path / "out"), contains="add --dtype bf16")
    assert "Q8_0" in line and not (tmp_path / "out").exists()


def test_convert_matches_transformers_own_gguf_loader(llama_gguf, tmp_path: Path, run_cli) -> None:
    """Names, q/k row order and config.json: what transformers' from_pretrained(gguf_file=) builds, bit for bit."""
    import transformers

    path, state = llama_gguf
    result = run_cli("convert", path, tmp_path / "hf", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == set(state)
    for name, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    assert config["rms_norm_eps"] == pytest.approx(1e-5) and config["vocab_size"] == 128


def test_dequantized_values_are_gguf_s_in_bf16(llama_gguf, tmp_path: Path, run_cli) -> None:
    path, state = llama_gguf
    assert run_cli("convert", path, tmp_path / "hf", "--dtype", "bf16").exit_code == 0
    written = load_file(tmp_path / "hf" / "model.safetensors")
    reference = gguf_dequantized(path)
    q = torch.from_numpy(llama_cpp_unpermute(reference["blk.1.attn_q.weight"], 4))
    k = torch.from_numpy(llama_cpp_unpermute(reference["blk.1.attn_k.weight"], 2))
    assert torch.equal(written["model.layers.1.self_attn.q_proj.weight"], q.to(torch.bfloat16))
    assert torch.equal(written["model.layers.1.self_attn.k_proj.weight"], k.to(torch.bfloat16))
    assert torch.equal(written["lm_head.weight"], torch.from_numpy(reference["output.weight"]).to(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in written.values()) and set(written) == set(state)


def test_split_and_verify_a_gguf(llama_gguf, tmp_path: Path, run_cli) -> None:
    path, state = llama_gguf
    result = run_cli("split", path, tmp_path / "shards", "--dtype", "bf16", "--max-shard-size", "60KB")
    assert result.exit_code == 0, result.stderr
    assert len(list((tmp_path / "shards").glob("model-0000*-of-*.safetensors"))) > 1
    assert run_cli("verify", tmp_path / "shards").exit_code == 0
    assert run_cli("verify", path).exit_code == 0


def test_verify_names_a_damaged_block_scale(llama_gguf, tmp_path: Path, run_cli) -> None:
    path, _ = llama_gguf
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(path.read_bytes())
    target = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    with open(damaged, "r+b") as f:
        f.seek(int(target.data_offset) + 34 * 5)  # the f16 scale of the sixth Q8_0 block
        f.write(np.float16(np.inf).tobytes())
    result = run_cli("verify", damaged)
    assert result.exit_code == 1 and "model.layers.0.mlp.up_proj.weight" in result.stdout
    assert "32 NaN/infinite" in result.stdout


def test_k_quants_and_other_architectures_keep_their_names(tmp_path: Path, run_cli) -> None:
    """A Flux-style file (BFL names) with Q4_K / Q6_K / Q5_0 tensors, which gguf can read but not write."""
    tensors = {"double_blocks.0.img_attn.qkv.weight": (random_blocks("Q4_K", 4 * 2, seed=1), (4, 512), "Q4_K"),
               "double_blocks.0.img_mlp.0.weight": (random_blocks("Q6_K", 3, seed=2), (3, 256), "Q6_K"),
               "img_in.weight": (random_blocks("Q5_0", 8, seed=3), (4, 64), "Q5_0")}
    path = write_raw_gguf(tmp_path / "flux.gguf", "flux", tensors)
    result = run_cli("convert", path, tmp_path / "out", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    written = load_file(tmp_path / "out" / "model.safetensors")
    reference = gguf_dequantized(path)
    assert set(written) == set(tensors) and not (tmp_path / "out" / "config.json").exists()
    for name, value in reference.items():
        assert np.array_equal(written[name].numpy().view(np.uint32), value.view(np.uint32)), name


def test_python_api_reads_a_gguf(llama_gguf) -> None:
    path, state = llama_gguf
    with shardkit.open_source(path) as src:
        entries = {e.name: e for e in src.entries()}
        assert set(entries) == set(state)
        assert entries["model.norm.weight"].dtype == "F32" and entries["model.norm.weight"].file == str(path)
        assert entries["lm_head.weight"].dtype == "F32" and entries["lm_head.weight"].file is None


def test_llama_cpp_only_tensors_keep_their_name(tmp_path: Path, run_cli) -> None:
    """rope_freqs.weight (Llama 3.1 GGUFs) has no Hugging Face name: kept as is, dropped with --exclude."""
    import transformers

    config = tiny_llama_config()
    state = transformers.LlamaForCausalLM(config).state_dict()
    freqs = np.linspace(1, 2, 8, dtype=np.float32)
    path = write_llama_gguf(tmp_path / "l.gguf", state, config, "F16", extra={"rope_freqs.weight": freqs})
    assert run_cli("convert", path, tmp_path / "kept").exit_code == 0
    kept = load_file(tmp_path / "kept" / "model.safetensors")
    assert np.array_equal(kept["rope_freqs.weight"].numpy(), freqs) and len(kept) == len(state) + 1
    assert run_cli("convert", path, tmp_path / "dropped", "--exclude", "rope_freqs.*").exit_code == 0
    assert set(load_file(tmp_path / "dropped" / "model.safetensors")) == set(state)
    assert run_cli("convert", tmp_path / "kept", tmp_path / "back.gguf", "--to", "gguf").exit_code == 0
    back = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "back.gguf")).tensors}
    assert np.array_equal(np.asarray(back["rope_freqs.weight"].data), freqs)


def test_a_type_shardkit_cannot_dequantize_is_named(tmp_path: Path, run_cli) -> None:
    path = write_raw_gguf(tmp_path / "iq.gguf", "flux", {"a.weight": (random_blocks("IQ4_NL", 4), (2, 64), "IQ4_NL")})
    assert "IQ4_NL" in run_cli("info", path).stdout
    assert run_cli("verify", path).exit_code == 0
    line = assert_one_line_error(run_cli("convert", path, tmp_path / "out", "--dtype", "bf16"), contains="IQ4_NL")
    assert "llama-quantize" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("qtype", ["MXFP4", "NVFP4", "Q1_0"])
def test_the_fp4_types_are_read_and_copied_whole(qtype: str, tmp_path: Path, run_cli) -> None:
    """gpt-oss GGUFs keep their experts MXFP4 (convert_hf_to_gguf.py); NVFP4 and Q1_0 are llama.cpp's newest types:
    named by info, the container verified, split and merged back byte for byte; not dequantized (one line)."""
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    tensors = {f"blk.{i}.ffn_up_exps.weight": (random_blocks(qtype, 16, seed=i), (4, 4 * block), qtype) for i in range(4)}
    path = write_raw_gguf(tmp_path / "m.gguf", "gpt-oss", tensors)
    assert {t.name: t.kind.name for t in read_gguf(path).tensors} == {name: qtype for name in tensors}
    assert f"{qtype} ×4" in shardkit.info(path).quantization["description"]
    assert run_cli("verify", path).exit_code == 0
    (tmp_path / "split").mkdir()
    parts = shardkit.convert(path, tmp_path / "split" / "m.gguf", to="gguf", max_shard_size=f"{16 * 17 * 2}B").files
    assert len(parts) >= 2 and shardkit.verify(parts[0]).ok
    shardkit.convert(parts[0], tmp_path / "merged.gguf", to="gguf")
    assert gguf_raw(tmp_path / "merged.gguf") == gguf_raw(path)
    assert_one_line_error(run_cli("convert", path, tmp_path / "out", "--dtype", "bf16"), contains=qtype)


def gguf_raw(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def test_a_llama_file_with_experts_gets_no_llama_config(tmp_path: Path) -> None:
    """Mixtral GGUFs are written as llama with stacked experts (ffn_*_exps): read back, the experts keep their GGUF
    names, so no config.json is made (a LlamaForCausalLM config would load the model without its experts)."""
    import transformers

    config = tiny_llama_config()
    state = {k: v for k, v in transformers.LlamaForCausalLM(config).state_dict().items() if ".mlp." not in k}
    experts = {f"blk.{i}.ffn_{kind}_exps.weight": np.ones((4, 128, 64) if kind != "down" else (4, 64, 128), np.float32)
               for i in range(2) for kind in ("gate", "up", "down")}
    path = write_llama_gguf(tmp_path / "moe.gguf", state, config, "F16", extra=experts)
    shardkit.convert(path, tmp_path / "out", dtype="fp32")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert set(experts) <= set(written) and "model.layers.0.self_attn.q_proj.weight" in written
    assert not (tmp_path / "out" / "config.json").exists()
