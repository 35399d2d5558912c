"""Index files and the transformers/diffusers naming conventions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.errors import CheckpointIndexError, SourceNotFoundError
from shardkit.formats.index import (
    Naming,
    add_variant,
    check_shard_name,
    dump_index,
    find_checkpoint,
    load_index,
    naming_from_filename,
)


def test_naming_transformers_diffusers_and_variants() -> None:
    t = Naming()
    assert (t.single(), t.shard(1, 3), t.index()) == (
        "model.safetensors", "model-00001-of-00003.safetensors", "model.safetensors.index.json")
    d = Naming("diffusion_pytorch_model")
    assert (d.single(), d.shard(2, 2), d.index()) == (
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
    )
    v = Naming("diffusion_pytorch_model", "fp16")
    assert (v.single(), v.shard(1, 2), v.index()) == (
        "diffusion_pytorch_model.fp16.safetensors",
        "diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.fp16.json",
    )


def test_naming_matches_what_diffusers_and_transformers_expect() -> None:
    """The library's own helpers give the same names (so from_pretrained finds our files)."""
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, _add_variant
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME as T_INDEX
    from transformers.utils import SAFE_WEIGHTS_NAME as T_SINGLE

    d = Naming("diffusion_pytorch_model", "fp16")
    assert d.single() == _add_variant(SAFETENSORS_WEIGHTS_NAME, "fp16")
    assert d.index() == _add_variant(SAFE_WEIGHTS_INDEX_NAME, "fp16")
    assert (Naming().single(), Naming().index()) == (T_SINGLE, T_INDEX)


def test_add_variant() -> None:
    assert add_variant("model.safetensors", None) == "model.safetensors"
    assert add_variant("model.safetensors", "ema") == "model.ema.safetensors"
    assert add_variant("model.safetensors.index.json", "fp16") == "model.safetensors.index.fp16.json"


@pytest.mark.parametrize("filename, prefix, variant", [
    ("model.safetensors", "model", None),
    ("model-00001-of-00002.safetensors", "model", None),
    ("model.safetensors.index.json", "model", None),
    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model", None),
    ("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model", "fp16"),
    ("diffusion_pytorch_model.fp16-00001-of-00002.safetensors", "diffusion_pytorch_model", "fp16"),
    ("diffusion_pytorch_model.safetensors.index.fp16.json", "diffusion_pytorch_model", "fp16"),
    ("/some/dir/diffusion_pytorch_model.bin", "diffusion_pytorch_model", None),
    ("pytorch_model.bin", "model", None),
    ("sdxl-unet.safetensors", "model", None),
    ("v1-5-pruned-emaonly.ckpt", "model", None),
])
def test_naming_from_filename(filename: str, prefix: str, variant: str | None) -> None:
    naming = naming_from_filename(filename)
    assert (naming.prefix, naming.variant) == (prefix, variant)


# ------------------------------------------------------------------ index files

def _write_index(path: Path, weight_map: object, metadata: object = None) -> Path:
    doc = {"weight_map": weight_map}
    if metadata is not None:
        doc["metadata"] = metadata
    path.write_text(json.dumps(doc))
    return path


def test_load_index_valid(tmp_path: Path) -> None:
    path = _write_index(tmp_path / "model.safetensors.index.json",
                        {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                         "c": "model-00001-of-00002.safetensors"}, {"total_size": 12})
    index = load_index(path)
    assert index.shard_names() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index.shard_paths() == [str(tmp_path / n) for n in index.shard_names()]
    assert index.metadata == {"total_size": 12}
    assert index.folder == str(tmp_path)


@pytest.mark.parametrize("shard, fragment", [
    ("/etc/passwd.safetensors", "absolute"),
    ("../outside.safetensors", "path"),
    ("..", "path"),
    ("sub/model.safetensors", "path"),
    ("sub\\model.safetensors", "path"),
    ("model.bin", "not a .safetensors"),
    ("", "non-empty"),
    (3, "non-empty string"),
    ("a\nb.safetensors", "control"),
])
def test_index_refuses_unsafe_shard_names(tmp_path: Path, shard: object, fragment: str) -> None:
    path = _write_index(tmp_path / "model.safetensors.index.json", {"w": shard})
    with pytest.raises(CheckpointIndexError, match=fragment):
        load_index(path)
    with pytest.raises(CheckpointIndexError):
        check_shard_name(shard, where="x")


@pytest.mark.parametrize("content, fragment", [
    (b"not json", "not a valid"),
    (b"\xff\xfe", "not a valid"),
    (b"[]", "weight_map"),
    (b'{"metadata": {}}', "weight_map"),
    (b'{"weight_map": []}', "weight_map"),
    (b'{"weight_map": {}}', "empty"),
    (b'{"weight_map": {"a": "m.safetensors"}, "metadata": []}', "metadata"),
])
def test_index_refuses_malformed_json(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointIndexError, match=fragment):
        load_index(path)


def test_load_index_missing_or_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError):
        load_index(tmp_path / "nope.json")
    with pytest.raises(CheckpointIndexError, match="directory"):
        load_index(tmp_path)


def test_dump_index_format_matches_transformers() -> None:
    raw = dump_index({"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"},
                     total_size_bytes=123)
    doc = json.loads(raw)
    assert doc == {"metadata": {"total_size": 123},
                   "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    assert list(doc["weight_map"]) == ["a", "b"]
    assert raw.endswith(b"\n")
    assert raw == (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


# ------------------------------------------------------------------ finding checkpoints

def _touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).write_bytes(b"x")


def test_find_checkpoint_prefers_index_then_single_file(tmp_path: Path) -> None:
    _touch(tmp_path, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
           "model.safetensors.index.json", "config.json", "README.md")
    layout = find_checkpoint(tmp_path)
    assert (layout.kind, Path(layout.path).name) == ("index", "model.safetensors.index.json")
    single = tmp_path / "single"
    single.mkdir()
    _touch(single, "diffusion_pytorch_model.safetensors", "config.json")
    layout = find_checkpoint(single)
    assert layout.kind == "file" and layout.naming == Naming("diffusion_pytorch_model")


def test_find_checkpoint_variants(tmp_path: Path) -> None:
    _touch(tmp_path, "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors")
    assert Path(find_checkpoint(tmp_path).path).name == "diffusion_pytorch_model.safetensors"
    layout = find_checkpoint(tmp_path, variant="fp16")
    assert Path(layout.path).name == "diffusion_pytorch_model.fp16.safetensors"
    assert layout.naming.variant == "fp16"
    only_variant = tmp_path / "v"
    only_variant.mkdir()
    _touch(only_variant, "diffusion_pytorch_model.safetensors.index.fp16.json")
    assert find_checkpoint(only_variant).naming.variant == "fp16"


def test_find_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="no .safetensors checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(SourceNotFoundError, match="no such folder"):
        find_checkpoint(tmp_path / "missing")
    _touch(tmp_path, "a.safetensors", "b.safetensors")
    with pytest.raises(CheckpointIndexError, match="several"):
        find_checkpoint(tmp_path)
    _touch(tmp_path, "model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
    with pytest.raises(CheckpointIndexError, match="several index"):
        find_checkpoint(tmp_path)
