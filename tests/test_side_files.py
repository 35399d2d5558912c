"""Every other file and subfolder travels with the weights (formats/side_files.py): a sentence-transformers
folder split, converted or resharded in place still loads with ``SentenceTransformer``; VCS and cache
folders stay behind; links out of the folder and special files are refused with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error, invoke_cli, leftovers, snapshot
from helpers_compare import assert_outputs_close

import shardkit

SENTENCES = ["hello world", "the cat sat", "a b c d e"]
_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "hello", "world", "the",
          "cat", "sat"]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A sentence-transformers folder saved by its own classes: a tiny random BERT (tokenizer from a local
    vocab file), mean Pooling and Normalize modules; plus the files a Hub clone carries."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root = tmp_path_factory.mktemp("st")
    base = root / "base"
    base.mkdir()
    (base / "vocab.txt").write_text("\n".join(_VOCAB) + "\n")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(_VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=64)
    BertModel(config).save_pretrained(base)
    BertTokenizerFast(vocab_file=str(base / "vocab.txt")).save_pretrained(base)
    transformer = models.Transformer(str(base), max_seq_length=32)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    folder = root / "model"
    model.save(str(folder))
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download.lock").write_text("")
    assert (folder / "1_Pooling" / "config.json").is_file() and (folder / "2_Normalize").is_dir()
    return folder, _embed(folder)


def _embed(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_tensor=True)


def _tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


EXPECTED_COPIES = {".gitattributes", "1_Pooling/config.json", "2_Normalize/config.json", "README.md", "config.json",
                   "config_sentence_transformers.json", "modules.json", "sentence_bert_config.json",
                   "tokenizer.json", "tokenizer_config.json"}


def test_split_copies_subfolders_and_dotfiles_and_loads_with_sentence_transformers(st_folder, tmp_path: Path) -> None:
    folder, want = st_folder
    out = tmp_path / "out"
    result = invoke_cli("split", folder, out, "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    copied = set(doc["copied"])
    assert EXPECTED_COPIES <= copied, EXPECTED_COPIES - copied
    assert not any(name.startswith((".git/", ".cache/")) for name in copied), copied
    assert len(doc["shards"]) > 1 and copied <= _tree(out)
    assert not (out / ".git").exists() and not (out / ".cache").exists() and not (out / "model.safetensors").exists()
    assert (out / "1_Pooling" / "config.json").read_bytes() == (folder / "1_Pooling" / "config.json").read_bytes()
    assert_outputs_close(_embed(out), want)

    text = invoke_cli("split", folder, tmp_path / "text", "--max-shard-size", "20KB")
    assert text.exit_code == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if "other file(s)" in line)
    assert line.startswith(f"copied {len(copied)} other file(s): .gitattributes, 1_Pooling/config.json"), line


def test_convert_copies_the_folder_layout_too(st_folder, tmp_path: Path) -> None:
    folder, want = st_folder
    out = tmp_path / "converted"
    result = invoke_cli("convert", folder, out, "--max-shard-size", "30KB", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert EXPECTED_COPIES <= set(doc["copied"]) and (out / "2_Normalize" / "config.json").is_file()
    assert len(doc["shards"]) > 1
    assert_outputs_close(_embed(out), want)


def test_in_place_reshard_keeps_every_other_file(st_folder, tmp_path: Path) -> None:
    import shutil

    folder, want = st_folder
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    before = snapshot(ckpt)
    result = invoke_cli("split", ckpt, ckpt, "--max-shard-size", "20KB", "--overwrite", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["copied"] == []  # nothing to copy: they stay where they are
    after = snapshot(ckpt)
    for name in EXPECTED_COPIES | {".git/HEAD", ".cache/huggingface/download.lock"}:
        assert after[name] == before[name], name
    assert "model.safetensors" not in after and "model.safetensors.index.json" in after
    assert not leftovers(ckpt)
    assert_outputs_close(_embed(ckpt), want)


def test_pipeline_split_copies_dotfiles_but_not_git(tmp_path: Path) -> None:
    from helpers_pipeline import build_tiny_sd_pipeline

    build_tiny_sd_pipeline(tmp_path).save_pretrained(tmp_path / "sd")
    (tmp_path / "sd" / ".gitattributes").write_text("*.bin filter=lfs\n")
    (tmp_path / "sd" / ".git").mkdir()
    (tmp_path / "sd" / ".git" / "config").write_text("[core]\n")
    result = shardkit.split(tmp_path / "sd", tmp_path / "out", max_shard_size="200KB")
    assert ".gitattributes" in result.copied and "scheduler/scheduler_config.json" in result.copied
    assert (tmp_path / "out" / ".gitattributes").is_file() and not (tmp_path / "out" / ".git").exists()
    assert not any(name.startswith("unet/diffusion_pytorch_model") for name in result.copied)


def _small_folder(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(64, 64)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("kind", ["link-outside", "link-to-folder", "fifo"])
def test_links_out_of_the_folder_and_special_files_are_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    folder = _small_folder(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    bad = folder / "sub" / "bad"
    if kind == "link-outside":
        bad.symlink_to(secret)
    elif kind == "link-to-folder":
        bad.symlink_to(tmp_path)
    else:
        os.mkfifo(bad)
    before = snapshot(folder)
    out = tmp_path / "out"
    result = invoke_cli("split", folder, out, "--max-shard-size", "4KB")
    line = assert_one_line_error(result, code=2, contains=str(bad))
    assert "outside" in line if kind == "link-outside" else True
    assert not out.exists() and not leftovers(tmp_path) and snapshot(folder) == before


def test_a_link_inside_the_folder_is_copied_as_the_file_it_names(tmp_path: Path) -> None:
    folder = _small_folder(tmp_path)
    (folder / "sub" / "alias.json").symlink_to(folder / "config.json")
    result = shardkit.split(folder, tmp_path / "out", max_shard_size="4KB")
    assert result.copied == ["config.json", "sub/alias.json"]
    copied = tmp_path / "out" / "sub" / "alias.json"
    assert not copied.is_symlink() and copied.read_text() == "{}"


def test_a_side_file_swapped_for_a_fifo_after_listing_is_refused_unread(tmp_path):
    """copy_side_file opens through a checked descriptor: a FIFO (swapped in after the listing) never blocks."""
    import os

    import pytest

    from shardkit.errors import ShardkitError
    from shardkit.sharding.flush import BackgroundSync, copy_side_file

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    with BackgroundSync() as sync, pytest.raises(ShardkitError, match="FIFO"):
        copy_side_file(str(fifo), str(tmp_path / "copy.json"), sync=sync)
    assert not (tmp_path / "copy.json").exists()


def test_overwriting_another_model_removes_its_side_files_but_nothing_edited_or_unlisted(tmp_path: Path) -> None:
    """A folder written by shardkit for model A, overwritten by model B: A's generation_config.json
    (listed in A's manifest, unchanged) goes; a file the user edited or added since stays."""
    a, b = _small_folder(tmp_path), tmp_path / "b"
    (a / "generation_config.json").write_text('{"max_length": 20}')
    (a / "tokenizer_config.json").write_text("{}")
    b.mkdir()
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(8, 8)}, str(b / "model.safetensors"))
    (b / "config.json").write_text('{"model": "b"}')
    out = tmp_path / "out"
    assert invoke_cli("split", a, out, "-q").exit_code == 0
    (out / "tokenizer_config.json").write_text('{"edited": true}')   # the user's edit: kept
    (out / "notes.txt").write_text("mine")                            # not listed: kept
    result = invoke_cli("split", b, out, "--overwrite", "-q")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == \
        ["config.json", "model.safetensors", "notes.txt", "shardkit.manifest.json", "tokenizer_config.json"]
    assert (out / "config.json").read_text() == '{"model": "b"}'
    again = invoke_cli("split", out, out, "--max-shard-size", "100B", "--overwrite", "-q")  # in place: all stay
    assert again.exit_code == 0, again.stderr
    assert {"config.json", "notes.txt", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert invoke_cli("verify", out, "-q").exit_code == 0
