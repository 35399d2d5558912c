"""``recover`` of a parent prefix settles a child's killed write (issue 41, item 2), on the real SeaweedFS.

A write journal names its objects relative to its own folder. Before, ``recover s3://B/models``
resolved the names of ``models/a/.shardkit-write-*.json`` against ``models/``: it deleted
unrelated objects there that happened to share a name, and left the killed write's orphans in
``models/a/``. The write here is really killed (SIGKILL at a fault point of its upload).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from helpers_s3 import multipart_source, paused_cli

from shardkit.stores.transaction import JOURNAL_PREFIX

FIRST_PART = f"store:sent:model-00001-of-00002.safetensors:{16 << 20}"  # an upload open, nothing whole
SECOND_SHARD = f"store:sent:model-00002-of-00002.safetensors:{8 << 20}"  # the first shard whole, unpublished
UNRELATED = {  # objects of the parent prefix no journal there names; two share the killed write's names
    "models/model.safetensors": b"the parent's own single file",
    "models/b/model.safetensors": b"a sibling checkpoint",
    "models/model-00001-of-00002.safetensors": b"same name as the child's first shard",
    "models/model-00002-of-00002.safetensors": b"same name as the child's second shard",
    "models/config.json": b"{}",
    "modelsx/a/model-00001-of-00002.safetensors": b"outside the prefix",
}


@pytest.fixture
def source(tmp_path) -> Path:
    """One ~40 MB safetensors file: two shards of 20 MB, each by multipart upload."""
    return multipart_source(tmp_path)


@pytest.mark.parametrize("point", [FIRST_PART, SECOND_SHARD], ids=["upload-open", "shard-whole"])
def test_recover_of_the_parent_removes_the_childs_orphans_and_nothing_else(s3_env, source, tmp_path, run_cli,
                                                                          point: str) -> None:
    for key, data in UNRELATED.items():
        s3_env.put(key, data)
    child = f"s3://{s3_env.bucket}/models/a"
    proc = paused_cli(s3_env, point, ["split", str(source), child, "--max-shard-size", "20MB"], tmp_path / "go")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    left = s3_env.keys("models/a/")
    journals = [k for k in left if k.rpartition("/")[2].startswith(JOURNAL_PREFIX)]
    assert len(journals) == 1, left
    assert "model-00001-of-00002.safetensors" in json.loads(s3_env.get(journals[0]))["created"]
    if point == SECOND_SHARD:
        assert "models/a/model-00001-of-00002.safetensors" in left, "a whole shard, named by no index"
    else:
        assert any(k.startswith("models/a/") for k in s3_env.uploads()), "the killed write's upload is open"

    result = run_cli("recover", f"s3://{s3_env.bucket}/models")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert s3_env.keys("models/a/") == [], "the child's orphans and its journal are gone"
    assert s3_env.uploads() == [], "its open upload was aborted"
    for key, data in UNRELATED.items():
        assert s3_env.get(key) == data, f"{key} was touched"
    assert sorted(s3_env.keys()) == sorted(UNRELATED)
    assert f"s3://{s3_env.bucket}/models/a/{JOURNAL_PREFIX}" in result.stdout
    assert f"s3://{s3_env.bucket}/models/model-0000" not in result.stdout
