"""save_sharded against the installed huggingface_hub: the same files, tensors, index and values.

Every case is a seeded random state dict (mixed dtypes with float8 and bool, scalars, empty
tensors, tensors over the limit, tied names, views, non-contiguous tensors) and a limit from one
byte to 10 GB. ``save_torch_state_dict`` and ``shardkit.save_sharded`` write it, and both
outputs must list the same files, the same tensor names in each file (read back with
safetensors), the same index ``weight_map`` and ``total_size``, and bit-equal values. Only
``__metadata__`` and the byte order inside a file may differ.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import huggingface_hub.serialization as hub_serialization
import pytest
import torch
from safetensors import safe_open

import shardkit
from shardkit.formats.manifest import MANIFEST_NAME

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
INDEX = "model.safetensors.index.json"
CASES = 240
CHUNKS = 8  # the cases run as CHUNKS tests of CASES // CHUNKS each, so a failure names a small range


def random_tensor(rng: random.Random, *, big: bool = False, shape: tuple[int, ...] | None = None) -> Any:
    """A tensor of a random dtype and shape: scalar, empty, or up to a few hundred elements."""
    dtype = rng.choice(DTYPES)
    if shape is None:
        shape = rng.choice([(), (0,), (2, 0), (rng.randint(1, 9),), (rng.randint(1, 6), rng.randint(1, 6))])
    if big:
        shape = (rng.randint(40, 300),)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype.is_floating_point:
        return values.to(dtype)
    return values.round().clamp(-100, 100).to(dtype)


def random_state_dict(rng: random.Random) -> dict[str, Any]:
    """Fresh tensors, plus names tied to earlier ones in the ways models and users tie them."""
    names = [f"layers.{i}.{part}" for i in range(rng.randint(1, 7)) for part in ("weight", "bias", "scale")]
    rng.shuffle(names)  # insertion order and sorted order differ: the hub plans in insertion order
    state: dict[str, Any] = {}
    for name in names[: rng.randint(1, 14)]:
        owners = [t for t in state.values() if t.numel() > 0 and t.is_contiguous()]
        kind = rng.choices(["new", "big", "same", "reshaped", "reinterpreted", "part", "transposed"],
                           weights=[10, 2, 2, 1, 1, 1, 1])[0]
        if kind == "big":
            state[name] = random_tensor(rng, big=True)
        elif kind == "transposed":  # alone on its storage: the hub writes it contiguous
            state[name] = random_tensor(rng, shape=(rng.randint(2, 5), rng.randint(2, 5))).t()
        elif kind == "new" or not owners:
            state[name] = random_tensor(rng)
        else:
            state[name] = tied_to(rng.choice(owners), kind, rng)
    return state


def tied_to(owner: Any, kind: str, rng: random.Random) -> Any:
    """A tensor sharing ``owner``'s storage: the same object, a reshape, another dtype, or a part."""
    if kind == "same":
        return owner
    if kind == "reshaped":
        return owner.view(-1)
    if kind == "reinterpreted" and owner.dtype != torch.bool and owner.element_size() > 1:
        return owner.view(-1).view(torch.uint8)  # same bytes, another dtype: still one storage
    start = rng.randrange(owner.numel())
    return owner.view(-1)[start:rng.randint(start + 1, owner.numel())]  # the hub drops a partial view


def random_limit(rng: random.Random, state: dict[str, Any]) -> int | str:
    """Mostly limits near the tensors' sizes (many shards), sometimes 1 KB to 10 GB (one shard)."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    roll = rng.random()
    if roll < 0.6:
        return rng.randint(1, max(1, total))
    if roll < 0.8:
        return rng.choice(["1KB", "2KB", "1.5KB", "3KB"])
    return int(10 ** rng.uniform(3, 10))


def hub_save(state: dict[str, Any], folder: Path, limit: int | str) -> bool:
    """The reference; False where the hub refuses the state dict (no name covers a storage)."""
    folder.mkdir()
    try:
        hub_serialization.save_torch_state_dict(dict(state), folder, max_shard_size=limit)  # it mutates its dict
    except RuntimeError as err:
        assert "None is covering the entire storage" in str(err)
        return False
    return True


def read_folder(folder: Path) -> tuple[dict[str, dict[str, Any]], dict | None]:
    """Every safetensors file's tensors by name, and the index (None without one)."""
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files[path.name] = {name: f.get_tensor(name) for name in f.keys()}
    index = folder / INDEX
    return files, json.loads(index.read_text()) if index.exists() else None


def assert_same_output(ours: Path, theirs: Path, case: str) -> None:
    # shardkit's integrity manifest is the one extra file; loaders ignore it (see test_manifest).
    assert sorted(p.name for p in ours.iterdir() if p.name != MANIFEST_NAME) == \
        sorted(p.name for p in theirs.iterdir()), case
    assert (ours / MANIFEST_NAME).is_file(), case
    our_files, our_index = read_folder(ours)
    their_files, their_index = read_folder(theirs)
    assert {f: sorted(t) for f, t in our_files.items()} == {f: sorted(t) for f, t in their_files.items()}, case
    if their_index is None:
        assert our_index is None, case
    else:
        assert our_index is not None, case
        assert our_index["weight_map"] == their_index["weight_map"], case
        assert our_index["metadata"]["total_size"] == their_index["metadata"]["total_size"], case
    for filename, tensors in their_files.items():
        for name, expected in tensors.items():
            got = our_files[filename][name]
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), f"{case}: {name}"
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), \
                f"{case}: {name} values differ"


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_save_sharded_writes_what_huggingface_hub_writes(tmp_path: Path, chunk: int,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # partial views log a warning each; not the point here
    compared = 0
    per_chunk = CASES // CHUNKS
    for seed in range(chunk * per_chunk, (chunk + 1) * per_chunk):
        rng = random.Random(seed)
        state = random_state_dict(rng)
        limit = random_limit(rng, state)
        case = f"seed {seed}, limit {limit!r}, {[(n, tuple(t.shape), t.dtype) for n, t in state.items()]}"
        if not hub_save(state, tmp_path / f"theirs{seed}", limit):
            continue
        shardkit.save_sharded(state, tmp_path / f"ours{seed}", max_shard_size=limit)
        assert_same_output(tmp_path / f"ours{seed}", tmp_path / f"theirs{seed}", case)
        compared += 1
    assert compared >= per_chunk * 9 // 10, "the generator makes too many state dicts the hub refuses"


# ------------------------------------------------------------------ where the hub has no answer

def test_views_no_name_covers_are_each_written(tmp_path: Path) -> None:
    """The hub refuses a state dict of views of a buffer it does not hold; shardkit writes each view."""
    buffer = torch.arange(10, dtype=torch.float32)
    state = {"first": buffer[:4], "rest": buffer[4:], "again": buffer[:4], "gap": buffer[2:6]}
    assert not hub_save(state, tmp_path / "theirs", 10**9)
    result = shardkit.save_sharded(state, tmp_path / "ours", max_shard_size=24)
    assert result.aliases == {"first": "again"}  # the same view twice is still written once
    files, index = read_folder(tmp_path / "ours")
    assert index is not None and set(index["weight_map"]) == {"again", "rest", "gap"}
    got = {name: t for tensors in files.values() for name, t in tensors.items()}
    for name in ("again", "rest", "gap"):
        assert torch.equal(got[name], state[name]), name


def test_partial_views_are_dropped_with_a_warning_and_only_exact_ties_are_aliases(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weight = torch.randn(4, 3)
    state = {"lm_head.weight": weight, "embed.weight": weight, "first_row": weight[0], "bias": torch.zeros(3)}
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        result = shardkit.save_sharded(state, tmp_path / "ours", max_shard_size="1KB")
    # An alias is served as the kept tensor by loaders: a row of it must not come back as all of it.
    assert result.aliases == {"lm_head.weight": "embed.weight"}
    with shardkit.open(tmp_path / "ours") as ckpt:
        assert ckpt.aliases == {"lm_head.weight": "embed.weight"} and torch.equal(ckpt["embed.weight"], weight)
    assert "first_row" in caplog.text and ".clone()" in caplog.text
    assert hub_save(state, tmp_path / "theirs", "1KB")
    assert_same_output(tmp_path / "ours", tmp_path / "theirs", "partial view")


def test_a_file_source_keeps_each_shard_one_run_of_the_file(tmp_path: Path) -> None:
    """split of a file: an oversized tensor closes the open shard; save_sharded of its tensors follows the hub."""
    from safetensors.torch import save_file

    state = {"a": torch.ones(6), "b_huge": torch.ones(20), "c": torch.ones(3)}  # 24, 80, 12 bytes, in file order
    save_file(state, str(tmp_path / "model.safetensors"))
    from_file = shardkit.split(tmp_path / "model.safetensors", tmp_path / "split", max_shard_size=40)
    assert [s.names for s in from_file.plan.shards] == [("a",), ("b_huge",), ("c",)]
    in_memory = shardkit.save_sharded(state, tmp_path / "saved", max_shard_size=40)
    assert [s.names for s in in_memory.plan.shards] == [("b_huge",), ("a", "c")]
    assert hub_save(state, tmp_path / "theirs", 40)
    assert_same_output(tmp_path / "saved", tmp_path / "theirs", "file tensors in memory")
