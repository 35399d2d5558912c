"""Tensor-parallel slices (shardkit.loading.tensor_parallel, LazyCheckpoint.slice): each rank reads
only its bytes, and what it gets equals slicing the full tensors the way Megatron and vLLM do."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import shardkit
from shardkit.errors import InvalidInputError
from shardkit.loading.tensor_parallel import SliceRule, TensorParallelPlan, rules_for, spec_for

LLAMA = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A real Llama (transformers, random weights) in bf16, saved in 3 shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="300KB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def _expected(full: torch.Tensor, spec, rank: int, world: int) -> torch.Tensor:
    if spec.dim is None:
        return full
    parts = full.split(list(spec.sections), dim=spec.dim) if spec.sections else (full,)
    return torch.cat([p.chunk(world, dim=spec.dim)[rank] for p in parts], dim=spec.dim)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_rules_for_llama_split_columns_rows_and_replicate_norms() -> None:
    rules = rules_for(json.loads(json.dumps(LLAMA)))
    assert spec_for("model.layers.0.self_attn.q_proj.weight", rules).dim == 0
    assert spec_for("model.layers.0.mlp.down_proj.weight", rules).dim == 1
    assert spec_for("model.embed_tokens.weight", rules).dim == 0 and spec_for("lm_head.weight", rules).dim == 0
    assert spec_for("model.layers.0.input_layernorm.weight", rules).dim is None
    assert spec_for("model.layers.0.self_attn.qkv_proj.weight", rules).sections == (128, 64, 64)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_gets_its_slices_equal_to_slicing_the_full_tensors(llama, world) -> None:
    folder, full = llama
    with shardkit.open(folder, read="pread") as ckpt:
        plan = TensorParallelPlan(ckpt, world=world, rules=rules_for(LLAMA))
        for rank in range(world):
            got = plan.read(rank)
            assert sorted(got) == sorted(full)
            for name, tensor in got.items():
                want = _expected(full[name], plan.specs[name], rank, world)
                assert tensor.dtype == want.dtype and torch.equal(tensor, want), (rank, name)


def test_a_tp4_rank_reads_under_30_percent_of_the_checkpoint_counted_by_the_kernel(llama) -> None:
    folder, _ = llama
    with shardkit.open(folder, read="pread") as ckpt:
        total = ckpt.nbytes()
        plan = TensorParallelPlan(ckpt, world=4, rules=rules_for(LLAMA))
        ckpt.open_shards()
        for rank in range(4):
            before = _rchar()
            plan.read(rank)
            read = _rchar() - before
            assert plan.read_bytes(rank) <= 0.30 * total
            assert plan.read_bytes(rank) <= read <= 0.30 * total, (rank, read, total)
        one = TensorParallelPlan(ckpt, world=1, rules=rules_for(LLAMA))
        assert one.read_bytes(0) == total


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_slice_reads_one_tensor_along_any_dim_with_odd_dtypes(tmp_path, dim) -> None:
    torch.manual_seed(1)
    tensors = {"x": torch.randn(4, 6, 8).to(torch.bfloat16), "pad": torch.arange(3, dtype=torch.uint8),
               "f8": torch.randn(8, 12).to(torch.float8_e4m3fn)}
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file(tensors, path)
    with shardkit.open(path, read="mmap") as ckpt:
        for rank in range(2):
            got = ckpt.slice("x", dim, rank, 2)
            assert torch.equal(got, tensors["x"].chunk(2, dim=dim)[rank])
            f8 = ckpt.slice("f8", 1, rank, 4)
            assert torch.equal(f8.view(torch.uint8), tensors["f8"].chunk(4, dim=1)[rank].contiguous().view(torch.uint8))
        assert ckpt.slice("x", dim, 1, 2, dtype=torch.float32).dtype == torch.float32


def test_fused_sections_split_each_part_on_its_own(tmp_path) -> None:
    qkv = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)  # q: 8 rows, k: 4, v: 4
    path = tmp_path / "f.safetensors"
    safetensors.torch.save_file({"layers.0.qkv_proj.weight": qkv}, path)
    with shardkit.open(path) as ckpt:
        got = ckpt.slice("layers.0.qkv_proj.weight", 0, 1, 2, sections=(8, 4, 4))
    q, k, v = qkv.split([8, 4, 4])
    assert torch.equal(got, torch.cat([q[4:], k[2:], v[2:]]))


def test_bad_splits_say_which_tensor_and_what_to_change(tmp_path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(6, 4)}, path)
    with shardkit.open(path) as ckpt:
        with pytest.raises(InvalidInputError, match=r"'w'.*does not split evenly over 4 ranks"):
            ckpt.slice("w", 0, 0, 4)
        with pytest.raises(InvalidInputError, match="rank 4 is outside"):
            ckpt.slice("w", 0, 4, 4)
        with pytest.raises(InvalidInputError, match="no dimension 2"):
            ckpt.slice("w", 2, 0, 2)
        with pytest.raises(InvalidInputError, match="add up to 5"):
            ckpt.slice("w", 0, 0, 2, sections=(4, 1))
        with pytest.raises(InvalidInputError, match="at least 1"):
            TensorParallelPlan(ckpt, world=0, rules=[SliceRule("w", 0)])
