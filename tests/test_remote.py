"""``hf://ORG/REPO`` sources against the offline Hub (tests/hub_server.py), through the real client.

Every command runs the real CLI in a subprocess with ``HF_ENDPOINT``/``HF_TOKEN`` pointing at the
server; the server counts the body bytes it sends, so "headers only" is checked by what crossed
the wire. Large repositories are :class:`hub_state.LazyBlob` files: real headers, zeros generated
as sent, so a 12 GB repository costs nothing unless something downloads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_hub import folder_files, hub_env, hub_files, lazy_safetensors, run_shardkit
from hub_state import LazyBlob

pytestmark = pytest.mark.hub

MB = 1_000_000
TENSOR_BYTES = 256 * 256 * 4
GB = 1_000_000_000


def one_error_line(proc, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout  # no partial output
    return lines[0]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SD pipeline folder (real configs, tokenizer, random weights)."""
    from helpers_fit import save_tiny_pipeline

    root = tmp_path_factory.mktemp("remote-pipe")
    save_tiny_pipeline(root / "pipe", root / "scratch")
    return root / "pipe"


def big_sharded(shards: int = 3, shard_gb: int = 4) -> dict:
    """A transformers-style sharded checkpoint of ``shards`` lazily served files of ~``shard_gb`` GB."""
    files, weight_map = {}, {}
    rows = shard_gb * GB // (2 * 8192)
    for n in range(1, shards + 1):
        name = f"model-{n:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{n}.{k}.weight": ("BF16", (rows // 4, 8192)) for k in range(4)}
        files[name] = lazy_safetensors(tensors)
        weight_map.update({t: name for t in tensors})
    total = sum(len(b) - len(b.head) for b in files.values())
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}).encode()
    files["config.json"] = b'{"model_type": "llama"}'
    return files


def test_info_of_a_12gb_repo_reads_headers_only(hub, tmp_path):
    hub.state.add_repo("alice/big", big_sharded())
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "info", "hf://alice/big", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["path"] == "hf://alice/big" and doc["format"] == "safetensors-sharded"
    assert doc["tensor_count"] == 12 and doc["total_bytes"] > 11 * GB
    assert [s["file"] for s in doc["shards"]] == [f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3)]
    assert hub.state.bytes_sent() < 5 * MB
    ranges = [r for m, p, r, _ in hub.state.sent if p.endswith(".safetensors")]
    assert len(ranges) == 3 and all(r.startswith("bytes=0-") for r in ranges)


def test_pipeline_repo_reads_component_headers_and_configs_only(hub, tmp_path):
    files = {"model_index.json": json.dumps({"_class_name": "FluxPipeline", "scheduler": ["diffusers", "X"],
                                             "transformer": ["diffusers", "FluxTransformer2DModel"],
                                             "vae": ["diffusers", "AutoencoderKL"]}).encode(),
             "scheduler/scheduler_config.json": b"{}", "tokenizer/tokenizer.json": b"{" + b" " * 3 * MB + b"}",
             "vae/config.json": b"{}", "vae/diffusion_pytorch_model.safetensors":
             lazy_safetensors({"decoder.w": ("F32", (1000, 1000))}), "transformer/config.json": b"{}"}
    files.update({f"transformer/{k.replace('model', 'diffusion_pytorch_model')}": v
                  for k, v in big_sharded(shards=2).items() if k != "config.json"})
    index = json.loads(files["transformer/diffusion_pytorch_model.safetensors.index.json"])
    index["weight_map"] = {t: s.replace("model", "diffusion_pytorch_model") for t, s in index["weight_map"].items()}
    files["transformer/diffusion_pytorch_model.safetensors.index.json"] = json.dumps(index).encode()
    hub.state.add_repo("alice/flux", files)
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "info", "hf://alice/flux", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "diffusers-pipeline" and list(doc["components"]) == ["transformer", "vae"]
    assert doc["tensor_count"] == 9 and doc["total_bytes"] > 7 * GB
    assert doc["components"]["transformer"]["shards"][0]["file"] == "diffusion_pytorch_model-00001-of-00002.safetensors"
    assert hub.state.bytes_sent() < 1 * MB  # the 3 MB tokenizer.json is not fetched


@pytest.mark.slow
def test_info_and_fit_of_a_pipeline_repo_match_the_local_folder(hub, tmp_path, pipeline):
    hub.state.add_repo("alice/pipe", folder_files(pipeline))
    env = hub_env(hub, tmp_path / "home")
    for args in (["info", "--json"], ["fit", "--gpu", "16GB", "--gpu", "16GB", "--json"]):
        remote = run_shardkit(env, args[0], "hf://alice/pipe", *args[1:])
        local = run_shardkit(env, args[0], pipeline, *args[1:])
        assert remote.returncode == 0 and local.returncode == 0, (remote.stderr, local.stderr)
        got, want = json.loads(remote.stdout), json.loads(local.stdout)
        if args[0] == "info":
            assert got.pop("path") == "hf://alice/pipe" and want.pop("path") == str(pipeline)
            for doc in (got, want, *got["components"].values(), *want["components"].values()):
                doc.pop("shared_bytes", None)
                for shard in doc["shards"]:
                    shard.pop("shared_bytes")
        assert got == want
    weights = [p for m, p, _, _ in hub.state.sent if m == "GET" and "/resolve/" in p]
    assert not any(p.endswith(("vocab.json", "merges.txt", ".bin")) for p in weights), weights
    table = run_shardkit(env, "info", "hf://alice/pipe/unet")
    assert table.returncode == 0 and table.stdout.startswith("hf://alice/pipe/unet\n"), table.stdout
    plan = ["--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB", "--cpu", "4GB", "--json"]
    remote = run_shardkit(env, "plan", "hf://alice/pipe/unet", *plan)
    local = run_shardkit(env, "plan", pipeline / "unet", *plan)
    assert remote.returncode == 0 and local.returncode == 0, (remote.stderr, local.stderr)
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got.pop("checkpoint") == "hf://alice/pipe/unet" and want.pop("checkpoint") == str(pipeline / "unet")
    assert got == want
    # one first range per weight file per command (info, fit: 3 files; info, plan of unet: 1), no other data
    assert hub.state.bytes_sent(r"\.safetensors$") == (3 + 3 + 1 + 1) * 64 * 1024


@pytest.mark.parametrize("extra", [0, 1], ids=["at-boundary", "one-past"])
def test_header_ending_exactly_at_the_first_range(hub, tmp_path, extra):
    from shardkit.stores.mirror import FIRST_RANGE_BYTES

    blob = lazy_safetensors({"w": ("F32", (1000, 1000))}, header_total_bytes=FIRST_RANGE_BYTES + extra)
    hub.state.add_repo("alice/edge", {"model.safetensors": blob})
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "info", "hf://alice/edge", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parameter_count"] == 1_000_000
    gets = [r for m, p, r, _ in hub.state.sent if p.endswith("model.safetensors") and m == "GET"]
    assert gets == [f"bytes=0-{FIRST_RANGE_BYTES - 1}"] + ([f"bytes={FIRST_RANGE_BYTES}-{FIRST_RANGE_BYTES}"] if extra else [])
    assert hub.state.bytes_sent(r"model\.safetensors$") == FIRST_RANGE_BYTES + extra


def test_private_repo_needs_the_token(hub, tmp_path):
    hub.state.add_repo("alice/secret", {"model.safetensors": lazy_safetensors({"w": ("F16", (8, 8))})}, private=True)
    without = run_shardkit(hub_env(hub, tmp_path / "anon", token=None), "info", "hf://alice/secret")
    assert "repository alice/secret not found" in one_error_line(without)
    env = hub_env(hub, tmp_path / "home", token=None)
    with_flag = run_shardkit(env, "info", "hf://alice/secret", "--token", "hf_test_token", "-q")
    assert with_flag.returncode == 0 and "64 parameters" in with_flag.stdout, with_flag.stderr
    login = hub_env(hub, tmp_path / "login", token=None)
    (tmp_path / "login" / "token").write_text("hf_test_token")  # what `hf auth login` stores
    stored = run_shardkit(login, "verify", "hf://alice/secret", "-q")
    assert stored.returncode == 0 and stored.stdout == "", stored.stderr


@pytest.mark.parametrize("spec, expected", [
    ("hf://bob/gated", "is gated"),
    ("hf://alice/liar", "header length 10000000000 is impossible"),
    pytest.param("hf://alice/nope", "repository alice/nope not found", marks=pytest.mark.slow),
    pytest.param("hf://alice/ok@v9", "revision 'v9' not found", marks=pytest.mark.slow),
    pytest.param("hf://alice/ok/unet", "no folder 'unet'", marks=pytest.mark.slow),
    pytest.param("hf://alice/short", "tensors end at byte 4000080 but the file has 1080 bytes", marks=pytest.mark.slow),
], ids=["gated", "lying-header", "missing-repo", "missing-revision", "missing-subfolder", "lying-offsets"])
def test_inaccessible_or_broken_repos_are_one_line_errors(hub, tmp_path, spec, expected):
    weights = {"model.safetensors": lazy_safetensors({"w": ("F16", (8, 8))})}
    hub.state.add_repo("bob/gated", weights, gated=True)
    honest = lazy_safetensors({"w": ("F16", (8, 8))})
    liar = LazyBlob((10 * GB).to_bytes(8, "little") + honest.head[8:], honest.size)
    hub.state.add_repo("alice/liar", {"model.safetensors": liar})
    hub.state.add_repo("alice/ok", weights)
    big = lazy_safetensors({"w": ("F32", (1000, 1000))})
    hub.state.add_repo("alice/short", {"model.safetensors": LazyBlob(big.head, len(big.head) + 1000)})
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "home"), "info", spec))
    assert line.startswith(f"error: {spec}") and expected in line, line


_RAISES = """
import sys, shardkit
try:
    shardkit.info(sys.argv[1])
except shardkit.errors.ShardkitError as e:
    print(type(e).__name__, e.exit_code, "shardkit-remote-" in str(e), str(e), sep="|")
"""


def test_errors_from_the_mirror_keep_their_type_and_name_the_spec(hub, tmp_path):
    """A HeaderError read through an hf:// mirror stays a HeaderError (only the temporary path is renamed)."""
    from helpers_hub import run_python

    big = lazy_safetensors({"w": ("F32", (1000, 1000))})
    hub.state.add_repo("alice/short", {"model.safetensors": LazyBlob(big.head, len(big.head) + 1000)})
    out = run_python(_RAISES, hub_env(hub, tmp_path / "home"), "hf://alice/short").stdout.strip()
    kind, code, temp_named, text = out.split("|", 3)
    assert (kind, code, temp_named) == ("HeaderError", "2", "False"), out
    assert text.startswith("hf://alice/short/model.safetensors") and "but the file has 1080 bytes" in text, out


def test_pickle_only_repo_names_the_file_and_fetches_nothing(hub, tmp_path):
    hub.state.add_repo("alice/old", {"pytorch_model.bin": b"\0" * 4096, "config.json": b"{}"})
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "home"), "info", "hf://alice/old"))
    assert "pickle weights only (pytorch_model.bin" in line and "hf download alice/old pytorch_model.bin" in line
    assert not any(p.endswith(".bin") for _, p, _, _ in hub.state.sent)


@pytest.mark.parametrize("status", [503, pytest.param(0, marks=pytest.mark.slow)], ids=["5xx", "cut-mid-body"])
def test_network_failures_are_retried_then_one_line(hub, tmp_path, status):
    hub.state.add_repo("alice/flaky", {"model.safetensors": lazy_safetensors({"w": ("F16", (8, 8))})})
    env = hub_env(hub, tmp_path / "home")
    hub.state.inject("GET", r"/resolve/.*model\.safetensors$", status, times=2)
    proc = run_shardkit(env, "info", "hf://alice/flaky", "-q")
    assert proc.returncode == 0 and "64 parameters" in proc.stdout, proc.stderr
    hub.state.inject("GET", r"/resolve/.*model\.safetensors$", status, times=None)
    line = one_error_line(run_shardkit(env, "info", "hf://alice/flaky", "-q"))
    assert line.startswith("error: hf://alice/flaky: ") and "retries" in line, line


def write_safetensors(path: Path, count: int = 8, seed: int = 0) -> Path:
    """``count`` F32 tensors of 256 KiB with seeded random bytes (no torch)."""
    import random

    from shardkit.formats.header import TensorEntry, build_header

    rng = random.Random(seed)
    entries = [TensorEntry(f"layer.{i}.weight", "F32", (256, 256), TENSOR_BYTES) for i in range(count)]
    head, _ = build_header(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + rng.randbytes(sum(e.nbytes for e in entries)))
    return path


def split_folder(tmp_path: Path, name: str, max_shard_size: str) -> Path:
    import shardkit

    source = write_safetensors(tmp_path / f"{name}-src" / "model.safetensors")
    shardkit.split(source, tmp_path / name, max_shard_size=max_shard_size)
    (tmp_path / name / "config.json").write_text('{"model_type": "tiny"}')
    return tmp_path / name


def test_verify_remote_checks_structure_without_tensor_data(hub, tmp_path):
    hub.state.add_repo("alice/big", big_sharded())
    files = big_sharded()
    del files["model-00002-of-00003.safetensors"]
    hub.state.add_repo("alice/holey", files)
    env = hub_env(hub, tmp_path / "home")
    ok = run_shardkit(env, "verify", "hf://alice/big")
    assert ok.returncode == 0, ok.stderr
    assert "structure of hf://alice/big: 3 weight file(s), 12 tensor(s)" in ok.stdout
    assert hub.state.bytes_sent() < 5 * MB
    holey = run_shardkit(env, "verify", "hf://alice/holey", "--json")
    assert holey.returncode == 1
    findings = json.loads(holey.stdout)["findings"]
    assert any(f["file"] == "model-00002-of-00003.safetensors" and f["message"].startswith("missing") for f in findings)


def test_verify_against_remote_decides_from_oids_and_reads_only_differing_tensors(hub, tmp_path):
    from shardkit.stores.mirror import FIRST_RANGE_BYTES

    folder = split_folder(tmp_path, "out", "600KB")
    for name, text in ((".gitattributes", "*.safetensors filter=lfs\n"), ("README.md", "# tiny\n"),
                       ("tokenizer.json", "{}")):
        (folder / name).write_text(text)
    hub.state.add_repo("alice/tiny", {k: v for k, v in folder_files(folder).items() if k != "shardkit.manifest.json"})
    env = hub_env(hub, tmp_path / "home")
    same = run_shardkit(env, "verify", folder, "--against", "hf://alice/tiny", "--json")
    assert same.returncode == 0, same.stdout + same.stderr
    doc = json.loads(same.stdout)
    assert doc["tensors_compared"] == 8 and all(f["checked"] == "hub-oid" for f in doc["files"])
    headers_only = hub.state.bytes_sent(r"\.safetensors$")
    assert headers_only == 4 * FIRST_RANGE_BYTES  # one first range per shard, no other tensor data
    compared = {f["name"] for f in doc["files"]}
    assert compared == {f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)} | {
        "model.safetensors.index.json", "config.json"}
    assert set(doc["not_compared"]) == {"README.md", "tokenizer.json", ".gitattributes", "shardkit.manifest.json"}
    assert doc["not_compared"]["README.md"].startswith("not a weight, index or config file")
    assert doc["not_compared"]["shardkit.manifest.json"].endswith("only here")
    text = run_shardkit(env, "verify", folder, "--against", "hf://alice/tiny")
    assert text.returncode == 0, text.stdout + text.stderr
    assert "compared: config.json, model-00001-of-00004.safetensors" in text.stdout
    assert "not compared: .gitattributes, README.md, tokenizer.json (not weights, indexes or configs); " \
           "shardkit.manifest.json (shardkit's own record" in text.stdout
    assert "ok: 6 file(s) compared with hf://alice/tiny" in text.stdout and "4 other file(s) not compared" in text.stdout

    shard = folder / "model-00002-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the shard's last tensor
    shard.write_bytes(bytes(data))
    before = hub.state.bytes_sent(r"\.safetensors$")
    changed = run_shardkit(env, "verify", folder, "--against", "hf://alice/tiny", "--json")
    assert changed.returncode == 1
    findings = json.loads(changed.stdout)["findings"]
    assert [(f["file"], f["tensor"]) for f in findings] == [(shard.name, "layer.3.weight")], findings
    assert f"at byte {TENSOR_BYTES - 1} of the tensor" in findings[0]["message"]
    fetched = hub.state.bytes_sent(r"\.safetensors$") - before - headers_only
    assert fetched == 2 * TENSOR_BYTES  # the two tensors of the changed shard, nothing else

    resharded = split_folder(tmp_path, "other", "1100KB")
    other = run_shardkit(env, "verify", resharded, "--against", "hf://alice/tiny")
    assert other.returncode == 1  # different shard files: named, but every tensor still compared equal
    assert "8 tensor(s)" not in other.stdout and "extra file" in other.stdout and "tensor '" not in other.stdout


def test_split_of_a_repo_goes_through_the_cache_and_equals_a_local_split(hub, tmp_path):
    import shardkit

    folder = split_folder(tmp_path, "src", "600KB")
    hub.state.add_repo("alice/tiny", {**hub_files(folder), "pytorch_model.bin": b"\0" * 64})
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "remote-out", "--max-shard-size", "1100KB", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.split(folder, tmp_path / "local-out", max_shard_size="1100KB")
    got, want = folder_files(tmp_path / "remote-out"), folder_files(tmp_path / "local-out")
    assert got == want and len(got) >= 3
    assert list((tmp_path / "home" / "hub").glob("models--alice--tiny/snapshots/*/model-00001-of-00004.safetensors"))
    assert not any(p.endswith(".bin") for _, p, _, _ in hub.state.sent)  # pickles are never fetched


@pytest.mark.slow
def test_the_offline_hub_answers_paths_info_and_hf_filesystem_range_reads(hub, tmp_path):
    from helpers_hub import run_python

    blob = lazy_safetensors({"w": ("F32", (1000, 1000))})
    hub.state.add_repo("alice/fs", {"sub/model.safetensors": blob, "config.json": b"{}"})
    code = """
import sys
from huggingface_hub import HfApi, HfFileSystem
infos = HfApi().get_paths_info("alice/fs", ["sub/model.safetensors", "sub", "nope"])
print(sorted((type(i).__name__, i.path) for i in infos))
with HfFileSystem().open("alice/fs/sub/model.safetensors", "rb", block_size=4096) as f:
    f.seek(8); print(f.read(8))
"""
    out = run_python(code, hub_env(hub, tmp_path / "home")).stdout.splitlines()
    assert out[0] == "[('RepoFile', 'sub/model.safetensors'), ('RepoFolder', 'sub')]"
    assert out[1] == repr(blob.head[8:16])
    assert hub.state.bytes_sent(r"model\\.safetensors$") < 64 * 1024


@pytest.mark.slow
def test_reshard_a_hub_repo_in_one_command(hub, tmp_path):
    """split hf:// → push → snapshot_download is bit-equal to a local split of the same files."""
    from helpers_hub import download

    import shardkit

    folder = split_folder(tmp_path, "src", "600KB")
    hub.state.add_repo("alice/tiny", hub_files(folder))  # the local source holds the Hub's .gitattributes too
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "out", "--max-shard-size", "1100KB",
                        "--push-to", "alice/tiny-1100KB", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.split(folder, tmp_path / "local-out", max_shard_size="1100KB")
    got = folder_files(download(env, "alice/tiny-1100KB", tmp_path / "downloaded"))
    want = folder_files(tmp_path / "local-out")
    assert got[".gitattributes"] == want[".gitattributes"]  # the Hub's own, carried through the split
    assert {k: v for k, v in got.items() if not k.startswith(".")} == {k: v for k, v in want.items()
                                                                       if not k.startswith(".")}
