"""``convert BASE out.gguf --to gguf --lora ADAPTER``: the adapter merged as the base streams into the GGUF writer,
judged against the GGUF of the merged safetensors folder (itself judged by PEFT in tests/test_lora.py) and PEFT."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_gguf import gguf_dequantized, llama_cpp_permute, llama_gguf_name, read_gguf_tensors, tiny_llama_folder
from helpers_lora import llama_class, peft_merged, save_adapter

import shardkit

pytest.importorskip("peft")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-gguf")
    base = tiny_llama_folder(root / "base")
    adapter = save_adapter(base, root / "adapter", llama_class(), r=4, lora_alpha=8,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    return {"root": root, "base": base, "adapter": adapter}


@pytest.mark.parametrize("quantize", ["q8_0", "f32"])
def test_a_merge_into_gguf_equals_the_gguf_of_the_merged_folder(llama: dict[str, Path], run_cli, quantize: str) -> None:
    """Every tensor's type and bytes equal: the merged rows go through the same quantizer as a merged checkpoint's."""
    root = llama["root"]
    direct = root / f"direct-{quantize}.gguf"
    result = run_cli("convert", llama["base"], direct, "--to", "gguf", "--quantize", quantize, "--lora", llama["adapter"])
    assert result.exit_code == 0, result.stderr
    assert f"merged {llama['adapter']}: 10 LoRA weight(s)" in result.stdout  # 5 modules x 2 layers
    shardkit.convert(llama["base"], root / f"merged-{quantize}", lora=llama["adapter"])
    shardkit.convert(root / f"merged-{quantize}", root / f"folder-{quantize}.gguf", to="gguf", quantize=quantize)
    shardkit.convert(llama["base"], root / f"base-{quantize}.gguf", to="gguf", quantize=quantize)
    got, want = read_gguf_tensors(direct), read_gguf_tensors(root / f"folder-{quantize}.gguf")
    assert got.keys() == want.keys()
    assert [n for n in got if got[n][0] != want[n][0] or not np.array_equal(got[n][1], want[n][1])] == []
    before = read_gguf_tensors(root / f"base-{quantize}.gguf")
    assert sum(not np.array_equal(got[n][1], before[n][1]) for n in got) == 10


def test_the_f32_gguf_holds_peft_s_merge(llama: dict[str, Path]) -> None:
    """Dequantized (f32: exactly), every weight equals PEFT's merge_and_unload, q/k permuted as llama.cpp lays them."""
    out = llama["root"] / "peft-judged.gguf"
    result = shardkit.convert(llama["base"], out, to="gguf", quantize="f32", lora=llama["adapter"])
    assert result.to_dict()["lora"]["tensors"] == 10
    merged = peft_merged(llama["base"], [llama["adapter"]], llama_class()).state_dict()
    tensors = gguf_dequantized(out)
    for name, value in merged.items():
        if name == "lm_head.weight" and llama_gguf_name(name) not in tensors:
            continue  # tied to the embedding
        value = value.float()
        if ".q_proj." in name or ".k_proj." in name:
            heads = 4 if ".q_proj." in name else 2
            value = llama_cpp_permute(value, heads)
        got = torch.from_numpy(np.array(tensors[llama_gguf_name(name)])).reshape(value.shape)
        assert torch.equal(got, value), name
