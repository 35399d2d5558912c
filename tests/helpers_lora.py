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
