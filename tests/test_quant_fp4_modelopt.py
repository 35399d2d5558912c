"""NVIDIA ModelOpt NVFP4 judged by ModelOpt itself: a tiny Llama quantized with ``mtq.NVFP4_DEFAULT_CFG`` and
written by ModelOpt's ``export_hf_checkpoint`` is named by ``info`` and dequantized by ``convert --dtype bf16``
bit-equal to ModelOpt's own ``NVFP4QTensor.dequantize``.

ModelOpt runs in a child process (it registers its quantized modules when imported), which writes the
checkpoint and ModelOpt's dequantization of every packed weight beside it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardkit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                                reason="nvidia-modelopt is not installed (the dev extra has it)")

_EXPORT = r"""
import sys, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.qtensor import NVFP4QTensor
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, architectures=["LlamaForCausalLM"])
model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=out)
state = load_file(out + "/model.safetensors")
reference = {}
for key, packed in state.items():
    if key.endswith(".weight") and packed.dtype == torch.uint8:
        name = key.removesuffix(".weight")
        shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
        reference[key] = NVFP4QTensor(shape, torch.bfloat16, packed).dequantize(
            dtype=torch.bfloat16, scale=state[name + ".weight_scale"], double_scale=state[name + ".weight_scale_2"],
            block_sizes={-1: 16})
save_file(reference, out + ".reference.safetensors")
"""


@pytest.fixture(scope="module")
def modelopt_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("modelopt") / "llama-nvfp4"
    proc = subprocess.run([sys.executable, "-c", _EXPORT, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_info_names_a_modelopt_export(modelopt_export: Path, run_cli) -> None:
    assert json.loads((modelopt_export / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    described = shardkit.info(modelopt_export).quantization
    assert described is not None and "ModelOpt" in described["description"], described
    result = run_cli("info", modelopt_export)
    assert result.exit_code == 0 and "NVIDIA ModelOpt NVFP4" in result.stdout, result.stderr


def test_convert_dequantizes_bit_equal_to_modelopt(modelopt_export: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli("convert", modelopt_export, tmp_path / "bf16", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    reference = load_file(f"{modelopt_export}.reference.safetensors")
    out = load_file(tmp_path / "bf16" / "model.safetensors")
    assert len(reference) == 14  # 7 linear layers x 2 decoder layers, all NVFP4
    for key, want in reference.items():
        assert out[key].dtype == torch.bfloat16 and torch.equal(out[key], want), key
    assert not [k for k in out if k.endswith(("_scale", "_scale_2", "input_scale"))]
    assert not (tmp_path / "bf16" / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
