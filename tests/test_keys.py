"""Key matching (loading/keys.py): what the model class itself ignores is ignored, as transformers and
diffusers do; with strict=False the warning says exactly which keys were missing, unexpected or mis-shaped;
the strict error says what the CLI can do (``shardkit plan --no-strict``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, invoke_cli, realign, tiny_bert_config
from helpers_compare import assert_outputs_close

import shardkit
from shardkit.errors import KeyMismatchError, ShardkitWarning


def _bert_with_legacy_position_ids(folder: Path) -> torch.nn.Module:
    """A BertModel saved by transformers, then given the ``embeddings.position_ids`` tensor that older
    transformers saved (a persistent buffer then) and many Hub checkpoints still hold."""
    from safetensors.torch import load_file, save_file
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(tiny_bert_config()).eval()
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    assert "embeddings.position_ids" not in state  # transformers no longer saves it...
    state["embeddings.position_ids"] = torch.arange(16).unsqueeze(0)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = BertModel.from_pretrained(folder).eval()  # ...and loads it without a word
    assert torch.equal(loaded.embeddings.word_embeddings.weight, model.embeddings.word_embeddings.weight)
    return model


def test_bert_with_legacy_position_ids_loads_with_defaults(tmp_path: Path) -> None:
    from transformers import BertModel

    model = _bert_with_legacy_position_ids(tmp_path / "bert")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardkitWarning)
        loaded = shardkit.load_model(BertModel, tmp_path / "bert")
    ids = torch.tensor([[2, 5, 9, 17, 33, 3]])
    with torch.no_grad():
        assert_outputs_close(realign(loaded)(ids).last_hidden_state, realign(model)(ids).last_hidden_state)
    assert torch.equal(loaded.embeddings.position_ids, torch.arange(16).unsqueeze(0))


def test_plan_accepts_the_legacy_checkpoint_with_defaults(tmp_path: Path) -> None:
    _bert_with_legacy_position_ids(tmp_path / "bert")
    result = invoke_cli("plan", tmp_path / "bert", "--model", "transformers:BertModel", "--max-memory", "cpu=1GB")
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr


class _Legacy(torch.nn.Module):
    """A model whose class lists the checkpoint tensors it does not need, as diffusers models may."""

    _keys_to_ignore_on_load_unexpected = [r"^old_head\."]
    _keys_to_ignore_on_load_missing = [r"^extra\."]

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Linear(4, 4)


def test_the_class_ignore_lists_are_honoured(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    body = torch.nn.Linear(4, 4)
    save_file({"body.weight": body.weight.detach(), "body.bias": body.bias.detach(),
               "old_head.weight": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardkitWarning)
        model = shardkit.load_model(_Legacy, tmp_path)
    assert torch.equal(model.body.weight, body.weight)


def test_no_strict_warning_names_only_what_happened(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    body = torch.nn.Linear(4, 4)
    save_file({"body.weight": body.weight.detach(), "body.bias": body.bias.detach(), "stray.weight": torch.ones(3)},
              tmp_path / "model.safetensors")
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)

    with pytest.raises(KeyMismatchError, match="strict=False") as err:
        shardkit.load_model(Model, tmp_path)
    assert "strict=False" in str(err.value) and "(Python)" not in str(err.value)
    with pytest.warns(ShardkitWarning) as caught:
        shardkit.load_model(Model, tmp_path, strict=False)
    message = str(caught[0].message)
    assert "1 key(s) unexpected: stray.weight" in message and "unexpected tensors are not loaded" in message
    assert "missing" not in message and "zeros" not in message


def test_plan_no_strict(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import BertModel

    torch.manual_seed(0)
    BertModel(tiny_bert_config()).save_pretrained(tmp_path / "bert")
    state = load_file(tmp_path / "bert" / "model.safetensors")
    del state["pooler.dense.bias"]
    save_file(state, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    args = ["plan", tmp_path / "bert", "--model", "transformers:BertModel", "--max-memory", "cpu=1GB"]
    line = assert_one_line_error(invoke_cli(*args), code=2, contains="pooler.dense.bias")
    assert "--no-strict" in line and "(Python)" not in line
    result = invoke_cli(*args, "--no-strict")
    assert result.exit_code == 0, result.stderr
    assert "1 key(s) missing from the checkpoint: pooler.dense.bias" in result.stderr
    assert "missing tensors are zeros" in result.stderr and "unexpected" not in result.stderr
