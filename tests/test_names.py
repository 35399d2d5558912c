"""formats.names: the one set of checkpoint file-name rules, and resolving a listing to its checkpoint.

A table of listings (what a folder, an ``hf://`` tree or an object-store prefix holds) and what
they resolve to; each row is checked on the bare names and on a real folder through every place
that resolves one (loaders' ``find_checkpoint``, verify's ``resolve_layout``, push's families), so
the places cannot drift apart again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.errors import CheckpointIndexError, SourceNotFoundError
from shardkit.formats.index import find_checkpoint
from shardkit.formats.names import (
    family_files,
    is_index_file,
    library_naming,
    named_file_kind,
    parse_weight_name,
    resolve_index_name,
    resolve_names,
)

SHARDS_2 = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
D = "diffusion_pytorch_model"

# (listing, variant, expected kind, expected name, expected naming (prefix, variant))
RESOLVED = [
    pytest.param(["model.safetensors"], None, "file", "model.safetensors", ("model", None), id="single"),
    pytest.param(["config.json", "model.safetensors.index.json", *SHARDS_2], None, "index",
                 "model.safetensors.index.json", ("model", None), id="transformers-sharded"),
    pytest.param([f"{D}.safetensors.index.json", f"{D}-00001-of-00002.safetensors", f"{D}-00002-of-00002.safetensors"],
                 None, "index", f"{D}.safetensors.index.json", (D, None), id="diffusers-sharded"),
    pytest.param([f"{D}.safetensors", f"{D}.fp16.safetensors"], None, "file", f"{D}.safetensors", (D, None),
                 id="plain-preferred-to-variant"),
    pytest.param([f"{D}.safetensors", f"{D}.fp16.safetensors"], "fp16", "file", f"{D}.fp16.safetensors", (D, "fp16"),
                 id="variant-chosen"),
    pytest.param([f"{D}.safetensors.index.fp16.json", f"{D}.fp16-00001-of-00002.safetensors"], None, "index",
                 f"{D}.safetensors.index.fp16.json", (D, "fp16"), id="only-a-variant-index"),
    # The case the copies disagreed on: verify took model.v2's index for a second plain index ("several"),
    # the loaders for a variant with the variant "v2.safetensors.index.json", push for no checkpoint at all.
    pytest.param(["model.safetensors.index.json", "model.v2.safetensors.index.json", *SHARDS_2], None, "index",
                 "model.safetensors.index.json", ("model", None), id="v2-index-beside-plain"),
    pytest.param(["model.safetensors.index.json", "model.v2.safetensors.index.json"], "v2", "index",
                 "model.v2.safetensors.index.json", ("model", "v2"), id="v2-index-chosen"),
    pytest.param(["model.fp16.safetensors.index.json", "model.fp16-00001-of-00002.safetensors"], "fp16", "index",
                 "model.fp16.safetensors.index.json", ("model", "fp16"), id="variant-before-extension-index"),
    # A variant index of a name no library writes: still a variant (verify's rule), not a second plain index.
    pytest.param(["foo.safetensors.index.json", "foo.safetensors.index.fp16.json"], None, "index",
                 "foo.safetensors.index.json", ("model", None), id="explicit-variant-unknown-prefix"),
    pytest.param(["sd_xl_base_1.0.safetensors", "model_index.json", "README.md"], None, "file",
                 "sd_xl_base_1.0.safetensors", ("model", None), id="dotted-single-is-no-variant"),
    pytest.param(["model.safetensors", ".model.safetensors.swp", ".model-00001-of-00002.safetensors", "sub/x.safetensors"],
                 None, "file", "model.safetensors", ("model", None), id="hidden-and-nested-ignored"),
    # Hostile names are never candidates (nor printed raw): before, "several .safetensors files (model.safetensors,
    # evil<newline>.safetensors)" broke the one-line error in two.
    pytest.param(["model.safetensors", "evil\n.safetensors", "x\x1b[2J.safetensors.index.json"], None, "file",
                 "model.safetensors", ("model", None), id="hostile-names-beside-a-checkpoint"),
    pytest.param(["model.safetensors", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin"], None,
                 "file", "model.safetensors", ("model", None), id="pickles-are-another-ext"),
]


@pytest.mark.parametrize("names, variant, kind, name, naming", RESOLVED)
def test_listing_resolves(names: list[str], variant: str | None, kind: str, name: str,
                          naming: tuple[str, str | None]) -> None:
    found = resolve_names(names, where="repo", variant=variant)
    assert (found.kind, found.name, (found.naming.prefix, found.naming.variant)) == (kind, name, naming)
    assert found.problems == ()
    lenient = resolve_names(names, where="repo", variant=variant, strict=False)
    assert (lenient.kind, lenient.name) == (kind, name)
    assert all("control characters" in p.message and "\n" not in p.file for p in lenient.problems)


def _folder(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for n in names:
        if "/" not in n:
            (folder / n).write_bytes(b"")
    return folder


@pytest.mark.parametrize("names, variant, kind, name, naming", RESOLVED)
def test_every_folder_resolver_agrees(tmp_path: Path, names: list[str], variant: str | None, kind: str, name: str,
                                      naming: tuple[str, str | None]) -> None:
    """Loaders (find_checkpoint) and verify (resolve_layout) pick the same file for the same folder."""
    from shardkit.checking.structure import resolve_layout

    folder = _folder(tmp_path, names)
    layout = find_checkpoint(folder, variant=variant)
    assert (layout.kind, Path(layout.path).name) == (kind, name)
    if variant is None:
        checked = resolve_layout(str(folder))
        assert (checked.index, checked.files) == ((name, []) if kind == "index" else (None, [name]))


# (listing, error type, words in the message)
REFUSED = [
    pytest.param([], SourceNotFoundError, "no .safetensors checkpoint", id="empty"),
    pytest.param(["config.json", "model_index.json", "model.bin"], SourceNotFoundError, "no .safetensors", id="none"),
    pytest.param(["a.safetensors", "b.safetensors"], CheckpointIndexError, "several .safetensors files", id="two-singles"),
    pytest.param(["model.safetensors.index.json", f"{D}.safetensors.index.json"], CheckpointIndexError,
                 "several index files", id="two-plain-indexes"),
    pytest.param([f"{D}.safetensors.index.fp16.json", f"{D}.safetensors.index.ema.json"], CheckpointIndexError,
                 "several index files", id="two-variant-indexes"),
    pytest.param(SHARDS_2, CheckpointIndexError, "no index file (model.safetensors.index.json)", id="shards-no-index"),
    pytest.param(["evil\n.safetensors"], CheckpointIndexError, "control characters", id="only-a-hostile-name"),
    pytest.param(["x\x1b[2J-00001-of-00002.safetensors"], CheckpointIndexError, "control characters",
                 id="only-a-hostile-shard"),
]


@pytest.mark.parametrize("names, error, words", REFUSED)
def test_strict_refuses_in_one_line(names: list[str], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=None) as raised:
        resolve_names(names, where="repo")
    message = str(raised.value)
    assert words in message and message.startswith("repo: ") and "\n" not in message and "\x1b" not in message


def test_lenient_records_shards_without_index_and_hostile_names() -> None:
    found = resolve_names([*SHARDS_2, "evil\n-00001-of-00002.safetensors"], where="repo", strict=False)
    assert (found.kind, found.shards) == ("shards", tuple(SHARDS_2))
    files = [p.file for p in found.problems]
    assert files == ["'evil\\n-00001-of-00002.safetensors'", SHARDS_2[0]]
    assert "control characters" in found.problems[0].message and "no index file" in found.problems[1].message
    assert all("\n" not in p.file + p.message for p in found.problems)
    # Ambiguity is not a finding: which checkpoint to check is the caller's choice, in both modes.
    with pytest.raises(CheckpointIndexError, match="several"):
        resolve_names(["a.safetensors", "b.safetensors"], where="repo", strict=False)


@pytest.mark.parametrize("name, kind, stem, variant", [
    ("model.safetensors", "single", "model", None),
    ("model-00001-of-00003.safetensors", "shard", "model", None),
    ("model.safetensors.index.json", "index", "model", None),
    ("model.safetensors.index.fp16.json", "index", "model.fp16", "fp16"),
    ("model.fp16.safetensors.index.json", "index", "model.fp16", "fp16"),
    ("model.v2.safetensors.index.json", "index", "model.v2", "v2"),
    (f"{D}.fp16-00002-of-00002.safetensors", "shard", f"{D}.fp16", "fp16"),
    ("pytorch_model.bin.index.json", "index", "pytorch_model", None),
    ("sd_xl_base_1.0.safetensors", "single", "sd_xl_base_1.0", None),
    ("model_index.json", None, None, None),
    ("config.json", None, None, None),
    ("model.gguf", None, None, None),
    ("tokenizer.index.json", None, None, None),
])
def test_parse_weight_name(name: str, kind: str | None, stem: str | None, variant: str | None) -> None:
    parsed = parse_weight_name(name)
    assert (parsed.kind, parsed.stem, parsed.variant) == (kind, stem, variant) if parsed else kind is None
    assert is_index_file(name) == (kind == "index")


def test_both_ways_of_writing_a_variant_index_are_one_family() -> None:
    a, b = parse_weight_name("model.fp16.safetensors.index.json"), parse_weight_name("model.safetensors.index.fp16.json")
    assert a is not None and b is not None and a.stem == b.stem == "model.fp16"
    assert library_naming(a.name) == library_naming(b.name) == library_naming("model.fp16-00001-of-00002.safetensors")
    listing = ["model.fp16-00001-of-00002.safetensors", "model-00001-of-00002.safetensors", "model.fp16.safetensors"]
    assert family_files(listing, "model.fp16") == ["model.fp16-00001-of-00002.safetensors"]


def test_push_families_follow_the_rules() -> None:
    """A pushed variant-first index replaces its family's stale remote shards (push saw no family before)."""
    from shardkit.hub.commits import RemoteFile, checkpoint_family, stale_files

    assert checkpoint_family("unet/model.fp16.safetensors.index.json") == ("unet", "model.fp16", True)
    assert checkpoint_family("model.v2.safetensors.index.json") == ("", "model.v2", True)
    assert checkpoint_family("pytorch_model.bin.index.json") is None  # pickles: never deleted by a push

    class Local:
        def __init__(self, path: str) -> None:
            self.path_in_repo = path

    local = [Local("model.fp16.safetensors.index.json"), Local("model.fp16-00001-of-00001.safetensors")]
    remote = {p: RemoteFile(1, "b", None) for p in ["model.fp16-00001-of-00002.safetensors",
                                                    "model.fp16-00002-of-00002.safetensors",
                                                    "model-00001-of-00002.safetensors"]}
    assert stale_files(local, remote) == ["model.fp16-00001-of-00002.safetensors",  # type: ignore[arg-type]
                                          "model.fp16-00002-of-00002.safetensors"]


def test_named_files() -> None:
    assert named_file_kind("model.safetensors") == "file"
    assert named_file_kind("model.safetensors.index.json") == named_file_kind("my_index.json") == "index"
    assert named_file_kind("pytorch_model.bin.index.json") is None and named_file_kind("w.bin") is None


def test_pickle_index_choice() -> None:
    assert resolve_index_name(["pytorch_model.bin.index.json", "model.safetensors"], where="f", ext="bin") \
        == "pytorch_model.bin.index.json"
    assert resolve_index_name(["pytorch_model.bin"], where="f", ext="bin") is None
    with pytest.raises(CheckpointIndexError, match="several index files"):
        resolve_index_name(["pytorch_model.bin.index.fp16.json", "pytorch_model.bin.index.ema.json"], where="f",
                           ext="bin")


def test_variant_index_folder_opens_and_verifies(tmp_path: Path) -> None:
    """End to end: a folder with a plain and a v2 index loads and verifies the plain checkpoint."""
    import torch

    import shardkit
    from shardkit.checking.verify import verify

    folder = tmp_path / "m"
    shardkit.split({"a": torch.ones(64), "b": torch.zeros(64)}, folder, max_shard_size="300B")
    index = folder / "model.safetensors.index.json"
    (folder / "model.v2.safetensors.index.json").write_bytes(index.read_bytes())
    with shardkit.open(folder) as ckpt:
        assert sorted(ckpt) == ["a", "b"]
    assert verify(folder).ok  # before: "several index files", exit 2
    with shardkit.open(folder, variant="v2") as ckpt:  # before: "no .safetensors checkpoint" for variant v2
        assert sorted(ckpt) == ["a", "b"]


def test_verify_reports_what_the_loaders_refuse_in_an_index(tmp_path: Path) -> None:
    """One index rule set: a non-object ``metadata`` makes the loaders refuse the index, so verify reports it."""
    import json

    import torch

    import shardkit
    from shardkit.checking.verify import verify

    folder = tmp_path / "m"
    shardkit.split({"a": torch.ones(64), "b": torch.zeros(64)}, folder, max_shard_size="300B")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"] = ["not", "an", "object"]
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointIndexError, match="'metadata' must be an object"):
        shardkit.open(folder)
    messages = [f.message for f in verify(folder).findings]
    assert "'metadata' must be an object" in messages


def test_verify_reports_a_hostile_weight_name_in_one_line(tmp_path: Path) -> None:
    """Lenient: verify names the hostile file (escaped) and checks the real checkpoint; the loaders ignore it."""
    import torch

    import shardkit
    from shardkit.checking.verify import verify

    folder = tmp_path / "m"
    shardkit.split({"a": torch.ones(64), "b": torch.zeros(64)}, folder, max_shard_size="300B")
    (folder / "model\n-00001-of-00002.safetensors").write_bytes(b"")
    with shardkit.open(folder) as ckpt:
        assert sorted(ckpt) == ["a", "b"]
    findings = [f for f in verify(folder).findings if "control characters" in f.message]
    assert [f.file for f in findings] == ["'model\\n-00001-of-00002.safetensors'"]
    assert all("\n" not in str(f) for f in findings)
