"""``convert --lora``: PEFT LoRA adapters merged into their base as it streams, judged by PEFT's ``merge_and_unload``.

Tiny transformers models (Llama, BERT) from configs with random weights; PEFT attaches LoRAs with random A
and B (several target modules, an embedding, rsLoRA, rank_pattern/alpha_pattern, lora_bias,
modules_to_save), saves them, and merges them itself: shardkit's merge must equal it bit for bit in fp32,
within bf16 rounding in bf16, give the same logits, and load back with ``from_pretrained``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_folder
from helpers_lora import (
    BERT,
    LLAMA,
    assert_within_bf16,
    bert_class,
    llama_class,
    peft_merged,
    save_adapter,
    save_base,
)

import shardkit

pytest.importorskip("peft")

LLAMA_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens"],
              "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3}, "modules_to_save": ["lm_head"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    base = save_base(root / "base", llama_class(), LLAMA)
    return {"root": root, "base": base, "adapter": save_adapter(base, root / "adapter", llama_class(), **LLAMA_LORA)}


def assert_bit_equal_to(got: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    want = model.state_dict()
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    unequal = [k for k in got if not torch.equal(got[k], want[k])]
    assert unequal == [], unequal


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(8).reshape(1, 8) % 64
    with torch.no_grad():
        return model(ids).logits


def test_cli_merge_equals_peft_bit_for_bit_in_fp32(llama: dict[str, Path], run_cli) -> None:
    """q/v/down_proj with rank_pattern and alpha_pattern, an embedding pair, lm_head in modules_to_save."""
    out = llama["root"] / "merged-cli"
    result = run_cli("convert", llama["base"], out, "--lora", llama["adapter"], "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["lora"]
    assert report["adapters"][0]["pairs"] == 7 and report["adapters"][0]["replaced"] == 2  # lm_head, embed base_layer
    reference = peft_merged(llama["base"], [llama["adapter"]], llama_class())
    assert_bit_equal_to(load_folder(out), reference)
    merged = llama_class().from_pretrained(out)
    assert torch.equal(logits(merged), logits(reference))
    assert (out / "config.json").read_text() == (llama["base"] / "config.json").read_text()
    base = load_folder(llama["base"])
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"],
                           load_folder(out)["model.layers.0.self_attn.q_proj.weight"])


def test_cli_prints_what_each_adapter_merged(llama: dict[str, Path], run_cli) -> None:
    result = run_cli("convert", llama["base"], llama["root"] / "merged-text", "--lora", llama["adapter"])
    assert result.exit_code == 0, result.stderr
    assert f"merged {llama['adapter']}: 7 LoRA weight(s), 2 replaced whole (r=4, lora_alpha=8, scale x1)" in result.stdout


def test_api_rslora_and_shards(llama: dict[str, Path]) -> None:
    """rsLoRA (alpha / sqrt(r)) through the Python API, written as several shards with an index."""
    adapter = save_adapter(llama["base"], llama["root"] / "rslora", llama_class(), seed=2, r=8, lora_alpha=4,
                           use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
    out = llama["root"] / "merged-rslora"
    result = shardkit.convert(llama["base"], out, lora=adapter, max_shard_size="20KB")
    assert len(result.plan.shards) > 1 and (out / "model.safetensors.index.json").exists()
    reference = peft_merged(llama["base"], [adapter], llama_class())
    assert_bit_equal_to(load_folder(out), reference)
    assert torch.equal(logits(llama_class().from_pretrained(out)), logits(reference))


def test_two_adapters_merge_in_order_as_peft_does(llama: dict[str, Path]) -> None:
    second = save_adapter(llama["base"], llama["root"] / "second", llama_class(), seed=3, r=2, lora_alpha=2,
                          target_modules=["q_proj", "up_proj"])
    out = llama["root"] / "merged-two"
    shardkit.convert(llama["base"], out, lora=[llama["adapter"], second])
    assert_bit_equal_to(load_folder(out), peft_merged(llama["base"], [llama["adapter"], second], llama_class()))


def test_lora_scale_multiplies_each_adapters_scale(llama: dict[str, Path]) -> None:
    from peft.tuners.lora import LoraLayer

    def doubled(model) -> None:
        for module in model.modules():  # scale_layer() skips embeddings (no lora_A): scale every pair here
            if isinstance(module, LoraLayer):
                for name in module.scaling:
                    module.scaling[name] *= 2.0

    out = llama["root"] / "merged-x2"
    shardkit.convert(llama["base"], out, lora=llama["adapter"], lora_scale=2.0)
    assert_bit_equal_to(load_folder(out), peft_merged(llama["base"], [llama["adapter"]], llama_class(), edit=doubled))
    zero = llama["root"] / "merged-x0"
    shardkit.convert(llama["base"], zero, lora=llama["adapter"], lora_scale=0.0)
    base, got = load_folder(llama["base"]), load_folder(zero)
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])


def test_bf16_output_is_within_bf16_rounding_of_peft(llama: dict[str, Path], run_cli) -> None:
    """An fp32 base written as bf16: the merge in fp32, rounded once; a bf16 base merged in bf16 by PEFT."""
    out = llama["root"] / "merged-bf16"
    assert run_cli("convert", llama["base"], out, "--lora", llama["adapter"], "--dtype", "bf16").exit_code == 0
    got = load_folder(out)
    reference = peft_merged(llama["base"], [llama["adapter"]], llama_class())
    want = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items() if k in got}
    assert all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)  # rounded once from the fp32 merge
    base16 = save_base(llama["root"] / "base-bf16", llama_class(), LLAMA, dtype=torch.bfloat16)
    out16 = llama["root"] / "merged-base-bf16"
    shardkit.convert(base16, out16, lora=llama["adapter"])
    peft16 = peft_merged(base16, [llama["adapter"]], llama_class(), dtype=torch.bfloat16)
    got16 = load_folder(out16)
    assert all(v.dtype == torch.bfloat16 for v in got16.values())
    assert_within_bf16(got16, {k: v for k, v in peft16.state_dict().items() if k in got16})
    merged, judged = logits(llama_class().from_pretrained(out16)).float(), logits(peft16).float()
    assert float((merged - judged).norm() / judged.norm()) < 1e-2  # bf16 forwards of weights a few ulps apart


def test_bert_with_lora_bias_and_a_classifier_in_modules_to_save(tmp_path: Path, run_cli) -> None:
    """SEQ_CLS: PEFT keeps the classifier whole; lora_bias adds lora_B.bias × scale to the base's bias."""
    base = save_base(tmp_path / "bert", bert_class(), BERT)
    adapter = save_adapter(base, tmp_path / "adapter", bert_class(), r=4, lora_alpha=16, task_type="SEQ_CLS",
                           target_modules=["query", "value", "dense"], lora_bias=True)
    out = tmp_path / "merged"
    assert run_cli("convert", base, out, "--lora", adapter).exit_code == 0
    reference = peft_merged(base, [adapter], bert_class())
    got = load_folder(out)
    want = reference.state_dict()
    assert set(got) == set(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert not torch.equal(got["bert.encoder.layer.0.attention.self.query.bias"],
                           load_folder(base)["bert.encoder.layer.0.attention.self.query.bias"])
    merged = bert_class().from_pretrained(out).eval()
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, reference.eval()(ids).logits)


def test_dry_run_checks_and_writes_nothing(llama: dict[str, Path], run_cli) -> None:
    out = llama["root"] / "dry"
    result = run_cli("convert", llama["base"], out, "--lora", llama["adapter"], "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["lora"]["tensors"] == 8
    assert not out.exists()


def test_keymap_applies_after_the_merge(llama: dict[str, Path]) -> None:
    """The adapter names the base as stored; --strip-prefix and friends rename the merged tensors after."""
    out = llama["root"] / "stripped"
    shardkit.convert(llama["base"], out, lora=llama["adapter"], strip_prefix="model.")
    reference = peft_merged(llama["base"], [llama["adapter"]], llama_class()).state_dict()
    got = load_folder(out)
    assert torch.equal(got["layers.0.self_attn.q_proj.weight"], reference["model.layers.0.self_attn.q_proj.weight"])


def _big_base(folder: Path, layers: int) -> tuple[Path, Path]:
    """``layers`` fp32 weights of 8192x4096 (128 MiB each: above the whole-delta bound, merged in bands) and
    a rank-16 PEFT LoRA on every one of them."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    (folder / "base").mkdir(parents=True)
    (folder / "adapter").mkdir()
    save_file({f"layers.{i}.proj.weight": torch.randn(8192, 4096, generator=g) for i in range(layers)},
              folder / "base" / "model.safetensors")
    pairs = {}
    for i in range(layers):
        pairs[f"base_model.model.layers.{i}.proj.lora_A.weight"] = torch.randn(16, 4096, generator=g)
        pairs[f"base_model.model.layers.{i}.proj.lora_B.weight"] = torch.randn(8192, 16, generator=g)
    save_file(pairs, folder / "adapter" / "adapter_model.safetensors")
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["proj"]}))
    return folder / "base", folder / "adapter"


def _peak_rss(*args: object) -> int:
    import subprocess
    import sys

    run = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    shardkit_bin = Path(sys.executable).with_name("shardkit")
    done = subprocess.run([sys.executable, "-c", run, str(shardkit_bin), *map(str, args), "-q"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def test_peak_rss_does_not_grow_with_the_base(tmp_path: Path) -> None:
    """One 128 MiB weight or three (384 MiB): the merging process's peak RSS is the same, the adapter held,
    the base streamed a band of rows at a time (no timing asserted)."""
    peaks = {}
    for layers in (1, 3):
        base, adapter = _big_base(tmp_path / str(layers), layers)
        peaks[layers] = _peak_rss("convert", base, tmp_path / f"out-{layers}", "--lora", adapter, "--dtype", "bf16")
        shutil.rmtree(tmp_path / f"out-{layers}")
    base_bytes = 3 * 8192 * 4096 * 4
    assert peaks[3] - peaks[1] < 48 * 2**20, peaks  # three times the base, no more memory
    assert peaks[3] < 300 * 2**20 + base_bytes // 2, peaks  # torch itself is ~230 MB of it


def test_an_fp8_base_merges_into_bf16_and_back_into_fp8(llama: dict[str, Path], run_cli) -> None:
    """A FineGrainedFP8 base: dequantized to float32 beneath the merge (weight × scale), the LoRA added, written in
    bf16 without quantization_config; or quantized again with --quantize. No dtype: refused, naming both."""
    wide = save_base(llama["root"] / "base-128", llama_class(), {**LLAMA, "hidden_size": 128, "intermediate_size": 256})
    fp8 = llama["root"] / "fp8"  # q/o_proj and the MLP in 128x128 blocks; k/v_proj (64 rows) kept
    assert run_cli("convert", wide, fp8, "--quantize", "fp8-block").exit_code == 0
    plain = llama["root"] / "fp8-dequantized"
    assert run_cli("convert", fp8, plain, "--dtype", "fp32").exit_code == 0
    adapter = save_adapter(plain, llama["root"] / "fp8-adapter", llama_class(), seed=7, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    out = llama["root"] / "fp8-merged"
    result = run_cli("convert", fp8, out, "--lora", adapter, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stderr
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert json.loads(result.stdout)["quantization"]["dequantized"].startswith("fp8")
    reference = peft_merged(plain, [adapter], llama_class()).state_dict()
    got = load_folder(out)
    assert all(torch.equal(got[k], reference[k].to(torch.bfloat16)) for k in got)  # fp32 merge, rounded once
    llama_class().from_pretrained(out)

    again = llama["root"] / "fp8-merged-fp8"
    result = run_cli("convert", fp8, again, "--lora", adapter, "--quantize", "fp8-block", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads((again / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    back = llama["root"] / "fp8-merged-back"
    assert run_cli("convert", again, back, "--dtype", "fp32").exit_code == 0
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(load_folder(back)[name], reference[name], rtol=0.07, atol=0.02)  # e4m3: 3 bits

    refused = run_cli("convert", fp8, llama["root"] / "fp8-no-dtype", "--lora", adapter)
    assert refused.exit_code == 2 and "dtype='bf16'" in refused.stderr.replace("--dtype bf16", "dtype='bf16'")
    assert not (llama["root"] / "fp8-no-dtype").exists()


def test_gpt2_conv1d_with_fan_in_fan_out(tmp_path: Path) -> None:
    """GPT-2 stores its projections as Conv1D (in, out): PEFT's fan_in_fan_out pairs merge transposed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    adapter = save_adapter(tmp_path / "gpt2", tmp_path / "adapter", GPT2LMHeadModel, r=4, lora_alpha=8,
                           target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    shardkit.convert(tmp_path / "gpt2", tmp_path / "merged", lora=adapter)
    reference = peft_merged(tmp_path / "gpt2", [adapter], GPT2LMHeadModel)
    assert_bit_equal_to(load_folder(tmp_path / "merged"), reference)
    assert torch.equal(logits(GPT2LMHeadModel.from_pretrained(tmp_path / "merged")), logits(reference))


def test_banded_deltas_match_peft_within_float32_rounding(llama: dict[str, Path], monkeypatch) -> None:
    """Deltas above the whole-product bound are added band by band (fused addmm): equal to PEFT's merge within
    float32 rounding, embeddings (transposed) included; bands of 3 rows here, so every tensor has several."""
    from shardkit.sharding import lora

    monkeypatch.setattr(lora, "WHOLE_DELTA_BYTES", 0)
    monkeypatch.setattr(lora, "BAND_BYTES", 3 * 64 * 4)
    out = llama["root"] / "merged-banded"
    shardkit.convert(llama["base"], out, lora=llama["adapter"])
    want = peft_merged(llama["base"], [llama["adapter"]], llama_class()).state_dict()
    got = load_folder(out)
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(got["model.embed_tokens.weight"], load_folder(llama["base"])["model.embed_tokens.weight"])


def test_dora_merges_as_peft_merges_it(llama: dict[str, Path], run_cli) -> None:
    """DoRA: W + ΔW rescaled per output row to the magnitude vector; bit-equal to PEFT's merge in fp32."""
    adapter = save_adapter(llama["base"], llama["root"] / "dora", llama_class(), seed=9, r=4, lora_alpha=8,
                           use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    out = llama["root"] / "merged-dora"
    assert run_cli("convert", llama["base"], out, "--lora", adapter).exit_code == 0
    reference = peft_merged(llama["base"], [adapter], llama_class())
    assert_bit_equal_to(load_folder(out), reference)
    assert torch.equal(logits(llama_class().from_pretrained(out)), logits(reference))


def test_an_adapter_saved_as_a_pickle(llama: dict[str, Path], tmp_path: Path) -> None:
    """adapter_model.bin (safe_serialization=False) is read with weights_only=True and merges the same."""
    from safetensors.torch import load_file

    adapter = Path(shutil.copytree(llama["adapter"], tmp_path / "bin-adapter"))
    torch.save(load_file(adapter / "adapter_model.safetensors"), adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    shardkit.convert(llama["base"], tmp_path / "out", lora=adapter)
    shardkit.convert(llama["base"], tmp_path / "ref", lora=llama["adapter"])
    got, want = load_folder(tmp_path / "out"), load_folder(tmp_path / "ref")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_a_base_in_a_bucket_merges_into_a_bucket(llama: dict[str, Path], s3_env, run_cli, tmp_path: Path) -> None:
    """``s3://`` on both sides: the base read by range, the merged shards streamed up; the same bytes as a local merge."""
    for path in llama["base"].iterdir():
        s3_env.put(f"base/{path.name}", path.read_bytes())
    result = run_cli("convert", f"s3://{s3_env.bucket}/base", f"s3://{s3_env.bucket}/merged", "--lora", llama["adapter"])
    assert result.exit_code == 0, result.stderr
    local = tmp_path / "local"
    shardkit.convert(llama["base"], local, lora=llama["adapter"])
    assert s3_env.get("merged/model.safetensors") == (local / "model.safetensors").read_bytes()


def test_an_adapter_in_a_bucket_merges_as_a_local_one(llama: dict[str, Path], s3_env, run_cli, tmp_path: Path) -> None:
    """``--lora s3://...``: adapter_config.json mirrored, the weights read by range; a missing one is one line."""
    from conftest import assert_one_line_error

    for path in llama["adapter"].iterdir():
        s3_env.put(f"adapter/{path.name}", path.read_bytes())
    out = tmp_path / "merged"
    result = run_cli("convert", llama["base"], out, "--lora", f"s3://{s3_env.bucket}/adapter")
    assert result.exit_code == 0, result.stderr
    assert f"merged s3://{s3_env.bucket}/adapter: 7 LoRA weight(s)" in result.stdout
    shardkit.convert(llama["base"], tmp_path / "local", lora=llama["adapter"])
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert_one_line_error(run_cli("convert", llama["base"], tmp_path / "x", "--lora", f"s3://{s3_env.bucket}/nothing"))
    assert not (tmp_path / "x").exists()


def test_an_adapter_on_the_hub_merges_as_a_local_one(llama: dict[str, Path], hub, tmp_path: Path) -> None:
    """``--lora hf://ORG/REPO`` (the offline Hub): the adapter read through the HF cache, as a model is."""
    from helpers_hub import hub_env, hub_files, run_shardkit

    hub.state.add_repo("alice/adapter", hub_files(llama["adapter"]))
    out = tmp_path / "merged"
    done = run_shardkit(hub_env(hub, tmp_path / "home"), "convert", llama["base"], out, "--lora", "hf://alice/adapter")
    assert done.returncode == 0, done.stderr
    shardkit.convert(llama["base"], tmp_path / "local", lora=llama["adapter"])
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
