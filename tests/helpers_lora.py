"""Tiny models and PEFT LoRA adapters for tests/test_lora*.py: PEFT builds, saves and merges them (the judge)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
BERT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 32, "num_labels": 3}


def llama_class() -> type:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


def bert_class() -> type:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification


def save_base(folder: Path, cls: type, config: dict[str, Any], *, dtype: torch.dtype = torch.float32,
              seed: int = 0) -> Path:
    """A model of ``cls`` from ``config`` with random weights, saved by transformers."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    kind = "llama" if "Llama" in cls.__name__ else "bert"
    model = cls(AutoConfig.for_model(kind, **config)).to(dtype)
    model.save_pretrained(folder)
    return folder


def save_adapter(base: Path, folder: Path, cls: type, *, seed: int = 1, dtype: torch.dtype | None = None,
                 **lora: Any) -> Path:
    """A PEFT LoRA on ``base`` with random A and B (and perturbed ``modules_to_save``), saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(cls.from_pretrained(base), LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name or "lora_B" in name and name.endswith("bias"):
                param.add_(torch.randn_like(param))
            elif "lora_magnitude_vector" in name:  # DoRA: magnitudes away from the base's own norms
                param.mul_(1 + 0.1 * torch.randn_like(param))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return folder


def peft_merged(base: Path, adapters: Sequence[Path], cls: type, *, dtype: torch.dtype | None = None,
                edit: Callable[[Any], None] | None = None) -> Any:
    """PEFT's own merge: the base with every adapter loaded, then ``merge_and_unload`` (in order)."""
    from peft import PeftModel

    model = cls.from_pretrained(base, dtype=dtype) if dtype is not None else cls.from_pretrained(base)
    peft = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        peft.load_adapter(path, adapter_name=f"a{i}")
    if edit is not None:
        edit(peft)
    return peft.merge_and_unload(adapter_names=[f"a{i}" for i in range(len(adapters))])


def edit_config(adapter: Path, **changes: Any) -> None:
    """Change fields of a saved adapter's ``adapter_config.json``."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def assert_within_bf16(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``want`` in ``got``, within two bf16 ulps (PEFT rounds the delta to bf16, then the sum)."""
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, value in want.items():
        torch.testing.assert_close(got[name].float(), value.float(), rtol=2**-6, atol=1e-5, msg=name)


FLUX = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8]}
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
                "proj_out", "norm1.linear", "norm1_context.linear", "norm.linear", "ff.net.0.proj", "ff_context.net.2",
                "norm_out.linear", "x_embedder", "context_embedder"]


def save_flux(folder: Path, config: dict[str, Any], *, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A FluxTransformer2DModel from ``config`` with random weights (N(0, 0.02): fast at any width), saved by diffusers."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model = model.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(folder)
    return folder


def save_flux_diffusers_lora(base: Path, folder: Path, *, targets: Sequence[str] = tuple(FLUX_TARGETS), rank: int = 4,
                             alpha: int = 8, seed: int = 1) -> Path:
    """A LoRA on a Flux transformer attached by PEFT (random A and B), saved by ``FluxPipeline.save_lora_weights``
    (keys ``transformer.M.lora_A.weight``, the LoraConfig in the header); returns the file."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = FluxTransformer2DModel.from_pretrained(base)
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(model),
                                   transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
    return folder / "pytorch_lora_weights.safetensors"


def save_flux_kohya_lora(path: Path, shapes: dict[str, tuple[int, ...]], *, rank: int = 4, seed: int = 2,
                         skip: Sequence[str] = ()) -> Path:
    """A kohya Flux LoRA (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, ``.lora_up.weight``,
    ``.alpha``) on every 2-D weight of an original (BFL) Flux transformer of these shapes, but those named in ``skip``."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        module = name.removeprefix("model.diffusion_model.").removesuffix(".weight")
        if not name.endswith(".weight") or len(shape) != 2 or any(s in module for s in skip):
            continue
        key = "lora_unet_" + module.replace(".", "_")
        out[key + ".lora_down.weight"] = torch.randn(rank, shape[1], generator=generator) * 0.1
        out[key + ".lora_up.weight"] = torch.randn(shape[0], rank, generator=generator) * 0.05
        out[key + ".alpha"] = torch.tensor(float(rank * 2))  # scale 2
    save_file(out, path)
    return path


def flux_fused(base: Path, lora: Path, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """diffusers' own merge: a FluxPipeline around the transformer (no other component),
    ``load_lora_weights`` + ``fuse_lora`` + ``unload_lora_weights``; the transformer's weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(base, **({"torch_dtype": dtype} if dtype is not None else {}))
    pipe = FluxPipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return model.state_dict()


def cast_lora_file(path: Path, dtype: torch.dtype) -> Path:
    """The LoRA file rewritten in ``dtype`` (as trainers save them: bf16), its header metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k).to(dtype) for k in f.keys()}, f.metadata()
    save_file(tensors, path, metadata=metadata)
    return path


def assert_within_bf16_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                             base: dict[str, torch.Tensor]) -> None:
    """Within two bf16 roundings at each tensor's scale (max |W| + max |ΔW|): diffusers rounds the delta to bf16
    before it adds it, so where W and ΔW cancel its error is ΔW's rounding, not the result's."""
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, value in want.items():
        scale = base[name].float().abs().max() + (value.float() - base[name].float()).abs().max()
        torch.testing.assert_close(got[name].float(), value.float(), rtol=0, atol=float(scale) * 2**-7, msg=name)
