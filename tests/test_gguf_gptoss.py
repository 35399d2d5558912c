"""``convert --to gguf`` of gpt-oss (``GptOssForCausalLM``), judged by llama.cpp's own converter on the same folder.

The released checkpoints keep their experts MXFP4 (``X_blocks`` / ``X_scales``, ``quant_method: mxfp4``); llama.cpp's
converter writes them as ggml MXFP4 tensors, the nibbles reordered and ``gate_up_proj`` split into gate (even output
rows) and up (odd), and everything else per ``--outtype``. Every tensor (name, ggml type, dims, bytes) and every
non-``general.*`` key must equal its output, for an MXFP4 folder and for a bf16 one (dense experts, transposed), and
llama.cpp's runtime must run shardkit's file as it runs the converter's. Tiny random models (helpers_gguf).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error
from helpers_gguf import tiny_gpt_oss_folder
from helpers_llama_cpp import gguf_fields, gguf_tensors, run_converter, run_llama_cpp

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_vocab import probe_hash

gguf = pytest.importorskip("gguf")

PRE = "gpt-2"  # the tiny tokenizer hashes to no real model's: both sides are told this name
FAST = [("mxfp4", "q8_0"), ("mxfp4", "f16"), ("bf16", "bf16")]
CASES = FAST + [pytest.param(source, outtype, marks=pytest.mark.slow) for source in ("mxfp4", "bf16")
                for outtype in ("f32", "f16", "bf16", "q8_0") if (source, outtype) not in FAST]
TEXT = "Hello world, the quick brown fox jumps over the lazy dog 123"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptoss")
    return {"mxfp4": tiny_gpt_oss_folder(root / "mxfp4"), "bf16": tiny_gpt_oss_folder(root / "bf16", mxfp4=False)}


@pytest.fixture(scope="module")
def q8_files(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(shardkit's, the converter's) q8_0 GGUF of the MXFP4 folder, made once for the tests that read them."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _convert_both(folders["mxfp4"], tmp_path_factory.mktemp("q8"), "q8_0", monkeypatch)


def _convert_both(folder: Path, tmp_path: Path, outtype: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), PRE)
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype=outtype, pre_fallback=PRE)
    ours = tmp_path / "ours.gguf"
    shardkit.convert(folder, ours, to="gguf", quantize=outtype)
    return ours, reference


@pytest.mark.parametrize(("source", "outtype"), CASES)
def test_every_tensor_and_key_equals_the_converters(source: str, outtype: str, request: pytest.FixtureRequest,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if (source, outtype) == ("mxfp4", "q8_0"):
        ours, reference = request.getfixturevalue("q8_files")
    else:
        ours, reference = _convert_both(request.getfixturevalue("folders")[source], tmp_path, outtype, monkeypatch)
    mine, theirs = gguf_tensors(ours), gguf_tensors(reference)
    assert sorted(mine) == sorted(theirs)
    for name, (kind, dims, data) in theirs.items():
        assert mine[name][:2] == (kind, dims), name
        assert mine[name][2] == data, name
    assert gguf_fields(ours) == gguf_fields(reference)
    kinds = {name: kind for name, (kind, _, _) in mine.items()}
    assert {kinds[f"blk.1.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {
        "MXFP4" if source == "mxfp4" else outtype.upper()}
    assert mine["blk.0.ffn_gate_exps.weight"][1] == (64, 96, 4)  # (in, 2 × 96 / 2, experts): gate_up_proj split
    assert shardkit.info(ours).quantization["architecture"] == "gpt-oss"
    file_type = gguf.GGUFReader(str(reference)).fields["general.file_type"].contents()
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == file_type  # MOSTLY_MXFP4_MOE for f16


def test_mxfp4_experts_keep_their_values(folders: dict[str, Path], q8_files: tuple[Path, Path]) -> None:
    """The ggml MXFP4 experts dequantize (gguf-py) to exactly what transformers dequantizes from the checkpoint's
    blocks and scales: gate from the even output rows of gate_up_proj, up from the odd ones."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(folders["mxfp4"] / "model.safetensors")
    reader = gguf.GGUFReader(str(q8_files[0]))
    written = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors}
    for layer in range(2):
        hf = f"model.layers.{layer}.mlp.experts."
        dense = {p: convert_moe_packed_tensors(state[hf + p + "_blocks"], state[hf + p + "_scales"], dtype=torch.float32)
                 for p in ("gate_up_proj", "down_proj")}  # (E, in, out), as transformers runs it
        expected = {"gate": dense["gate_up_proj"][..., ::2], "up": dense["gate_up_proj"][..., 1::2],
                    "down": dense["down_proj"]}
        for part, values in expected.items():
            got = written[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert np.array_equal(got.reshape(values.transpose(1, 2).shape), values.transpose(1, 2).numpy()), part


def test_a_config_as_openai_ships_it_gives_the_converters_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """openai/gpt-oss-20b's config.json: ``rope_scaling`` (yarn, ``truncate``) and a top-level ``rope_theta``."""
    folder = tiny_gpt_oss_folder(tmp_path / "legacy", legacy_config=True)
    ours, reference = _convert_both(folder, tmp_path, "q8_0", monkeypatch)
    fields = gguf_fields(ours)
    assert fields == gguf_fields(reference)
    assert fields["gpt-oss.rope.scaling.type"][1] == "yarn" and fields["gpt-oss.rope.freq_base"][1] == 150000.0
    assert fields["gpt-oss.attention.sliding_window"][1] == 32 and fields["gpt-oss.expert_feed_forward_length"][1] == 96


def test_llama_cpp_runs_our_file_as_it_runs_the_converters(folders: dict[str, Path],
                                                           q8_files: tuple[Path, Path]) -> None:
    import transformers

    folder = folders["mxfp4"]
    ours, reference = q8_files
    theirs, got = run_llama_cpp(reference, "generate", TEXT), run_llama_cpp(ours, "generate", TEXT)
    assert got == theirs and len(got["generated"]) == 8
    assert got["prompt"] == transformers.AutoTokenizer.from_pretrained(folder).encode(TEXT)


def test_an_mxfp4_pair_missing_its_scales_is_one_line(folders: dict[str, Path], tmp_path: Path, run_cli) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json",):  # no tokenizer: the pair is refused before any vocabulary is read
        (folder / name).write_bytes((folders["mxfp4"] / name).read_bytes())
    state = load_file(folders["mxfp4"] / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, folder / "model.safetensors")
    line = assert_one_line_error(run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf"), code=2,
                                 contains="blk.1.ffn_down_exps.weight")
    assert "MXFP4" in line and not (tmp_path / "x.gguf").exists()
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"


def test_a_gpt_oss_gguf_requantized_keeps_its_mxfp4_experts(q8_files: tuple[Path, Path], tmp_path: Path) -> None:
    """GGUF → GGUF with another type: the Q8_0 tensors are rewritten, the MXFP4 experts copied as they are."""
    again = tmp_path / "f16.gguf"
    shardkit.convert(q8_files[0], again, to="gguf", quantize="f16")
    before, after = gguf_tensors(q8_files[0]), gguf_tensors(again)
    assert sorted(after) == sorted(before)
    for name, (kind, dims, data) in before.items():
        if kind == "MXFP4":
            assert after[name] == (kind, dims, data), name
    assert after["token_embd.weight"][0] == "F16" and after["blk.0.attn_sinks.weight"][0] == "F32"
