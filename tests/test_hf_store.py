"""``hf://`` as the second store behind shardkit.stores' interface: the generic header mirror, ranged reads
and RangeFile work on a repository of the offline Hub exactly as on a bucket."""

from __future__ import annotations

import json

import pytest
from helpers_hub import hub_env, run_python

pytestmark = pytest.mark.hub

CODE = r"""
import json, os, sys, tempfile
from shardkit.api.stores import store_mirror
from shardkit.formats.names import is_config_file
from shardkit.stores import RangeRequest, RemoteObject, open_store, read_ranges
from shardkit.stores.hf import HfStore
from shardkit.stores.mirror import build_header_mirror

def tree(root):
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            p = os.path.join(folder, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out

with HfStore("hf://alice/ckpt") as store:
    objects = store.list_objects()
    root = tempfile.mkdtemp()
    mirror = build_header_mirror(store, root, objects, whole=is_config_file)
    shard = store.stat("model-00002-of-00002.safetensors")
    whole = bytearray(shard.size_bytes)
    read_ranges(store, [RangeRequest(shard.name, 0, memoryview(whole))], threads=4, part_bytes=100_000)
    piece = bytearray(10)
    RemoteObject(store, shard).read_into(1000, memoryview(piece))
    with store_mirror("hf://alice/ckpt") as reference:
        same = tree(reference.root) == tree(root)
    with open_store("hf://alice/ckpt") as opened:
        same_store = isinstance(opened, HfStore) and opened.list_objects() == objects
    print(json.dumps({"names": [o.name for o in objects], "url": str(store.url), "same": same, "same_store": same_store,
                      "fetched": mirror.fetched_bytes, "whole": whole.hex(), "piece": piece.hex()}))
"""


def test_the_generic_mirror_and_reads_work_on_a_hub_repository(hub, tmp_path) -> None:  # noqa: F811
    from conftest import make_state_dict
    from safetensors.torch import save

    shards = {f"model-0000{n}-of-00002.safetensors": save(make_state_dict(["F32", "I8"], shapes=[(300, 200)], seed=n))
              for n in (1, 2)}
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    files = {**shards, "model.safetensors.index.json": json.dumps(index).encode(), "config.json": b"{}"}
    hub.state.add_repo("alice/ckpt", files)
    proc = run_python(CODE, hub_env(hub, tmp_path / "home"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["names"] == sorted([*files, ".gitattributes"]) and got["url"] == "hf://alice/ckpt"
    assert got["same"], "the header mirror built by hand equals the one every location gets"
    assert got["same_store"], "open_store('hf://...') opens the same store"
    second = shards["model-00002-of-00002.safetensors"]
    assert bytes.fromhex(got["whole"]) == second and bytes.fromhex(got["piece"]) == second[1000:1010]
    assert got["fetched"] < sum(map(len, shards.values())) / 2
