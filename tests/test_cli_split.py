"""``shardkit split`` on the command line: output, options, and every bad input of issue 2."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import (
    SHARDKIT_BIN,
    assert_bit_equal,
    assert_one_line_error,
    invoke_cli,
    leftovers,
    load_folder,
    make_state_dict,
    raw_header,
    snapshot,
    write_raw_safetensors,
)

from shardkit.formats.header import MAX_HEADER_BYTES


def _good_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(make_state_dict(["F32", "I64", "BF16"], shapes=[(30,), (5, 5)]), str(path))
    return path


# ------------------------------------------------------------------ happy paths

def test_split_prints_a_summary_and_writes_shards(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    out = tmp_path / "out"
    result = run_cli("split", src, out, "--max-shard-size", "200B")
    assert result.exit_code == 0, result.stderr
    assert "model-00001-of-" in result.stdout and "model.safetensors.index.json" in result.stdout
    assert "wrote" in result.stdout and str(out) in result.stdout
    from safetensors.torch import load_file

    assert_bit_equal(load_folder(out), load_file(str(src)))


def test_dry_run_warns_when_the_real_run_would_need_overwrite(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "README.md").write_text("keep me")
    result = run_cli("split", src, out, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "needs --overwrite" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    quiet = run_cli("split", src, out, "--dry-run", "--overwrite")
    assert "needs --overwrite" not in quiet.stderr


def test_dry_run_prints_the_plan_and_writes_nothing(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    before = snapshot(tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", "200B", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert snapshot(tmp_path) == before
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("would write")
    shard_lines = [line for line in lines if line.startswith("  model-")]
    assert shard_lines and all("tensors" in line and "B" in line for line in shard_lines)


def test_json_summary(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", "200B", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["index"] == "model.safetensors.index.json"
    assert doc["dry_run"] is False and doc["max_shard_bytes"] == 200
    assert [s["file"] for s in doc["shards"]] == sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert sum(s["bytes"] for s in doc["shards"]) == doc["total_bytes"]
    dry = json.loads(run_cli("split", src, tmp_path / "out2", "--json", "--dry-run").stdout)
    assert dry["dry_run"] is True and len(dry["shards"]) == 1 and dry["index"] is None


def test_quiet_prints_nothing_and_progress_shows_only_on_request_off_a_terminal(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    quiet = run_cli("split", src, tmp_path / "q", "--max-shard-size", "200B", "-q")
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""
    plain = run_cli("split", src, tmp_path / "p", "--max-shard-size", "200B")
    assert plain.exit_code == 0 and "%|" not in plain.stderr  # not a terminal: no bar
    loud = run_cli("split", src, tmp_path / "l", "--max-shard-size", "200B", "--progress")
    assert "split:" in loud.stderr and "%|" in loud.stderr  # the tqdm bar, in bytes


def test_help_has_examples_and_units(run_cli) -> None:
    result = run_cli("split", "--help")
    assert result.exit_code == 0
    for text in ("Examples:", "shardkit split", "--max-shard-size", "--dry-run", "--overwrite", "GiB", "10"):
        assert text in result.stdout
    top = run_cli("--help")
    assert "split" in top.stdout and "Examples" in top.stdout


def test_dtype_and_naming_options(run_cli, tmp_path: Path) -> None:
    import torch

    src = _good_file(tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--dtype", "bf16", "--name", "diffusion_pytorch_model",
                     "--variant", "bf16", "-q")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["diffusion_pytorch_model.bf16.safetensors",
                                                                    "shardkit.manifest.json"]
    loaded = load_folder(tmp_path / "out")
    assert loaded["layers.F32.0"].dtype == torch.bfloat16 and loaded["layers.I64.0"].dtype == torch.int64


def test_in_place_reshard_with_overwrite(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    ckpt = tmp_path / "ckpt"
    assert run_cli("split", src, ckpt, "--max-shard-size", "100B", "-q").exit_code == 0
    refused = run_cli("split", ckpt, ckpt, "--max-shard-size", "400B")
    assert_one_line_error(refused, contains="--overwrite")
    result = run_cli("split", ckpt, ckpt, "--max-shard-size", "400B", "--overwrite", "-q")
    assert result.exit_code == 0, result.stderr
    from safetensors.torch import load_file

    assert_bit_equal(load_folder(ckpt), load_file(str(src)))
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------ bad inputs

def _entry(dtype: str = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def _raw(header: object, data: bytes = b"\0" * 8, **kw: object) -> Callable[[Path], Path]:
    return lambda tmp: write_raw_safetensors(tmp / "bad.safetensors", header, data, **kw)


def _truncated(tmp: Path) -> Path:
    path = _good_file(tmp)
    path.write_bytes(path.read_bytes()[:-7])
    return path


def _empty_folder(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    (tmp / "empty" / "config.json").write_text("{}")
    return tmp / "empty"


def _sharded(tmp: Path, mutate: Callable[[Path, dict], None]) -> Path:
    import shardkit

    shardkit.split(_good_file(tmp), tmp / "ckpt", max_shard_size=150)
    index_path = tmp / "ckpt" / "model.safetensors.index.json"
    doc = json.loads(index_path.read_text())
    mutate(tmp / "ckpt", doc["weight_map"])
    index_path.write_text(json.dumps(doc))
    return tmp / "ckpt"


def _dup_across_shards(folder: Path, wm: dict) -> None:
    from safetensors.torch import load_file, save_file

    first, second = sorted(set(wm.values()))[:2]
    both = {**load_file(str(folder / second)), **load_file(str(folder / first))}
    save_file(both, str(folder / second))


def _move_to_another_shard(folder: Path, wm: dict) -> None:
    name = next(iter(wm))
    wm[name] = next(shard for shard in sorted(set(wm.values())) if shard != wm[name])


def _missing_from_index(folder: Path, wm: dict) -> None:
    del wm[sorted(wm)[0]]


def _pickle_with(tmp: Path, extra: object) -> Path:
    import torch

    path = tmp / "model.pt"
    torch.save({"w": torch.zeros(2), "extra": extra}, path)
    return path


BAD_SOURCES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing source": (lambda tmp: tmp / "nope.safetensors", "no such"),
    "folder with no checkpoint": (_empty_folder, "no checkpoint"),
    "truncated file": (_truncated, "truncated"),
    "header past EOF": (_raw({"a": _entry()}, length=4096), "past the end"),
    "header over 100 MB": (_raw({"a": _entry()}, length=MAX_HEADER_BYTES + 8), "limit"),
    "header not UTF-8": (_raw(b'{"\xff": 1}'), "utf-8"),
    "header not JSON": (_raw(b"{nope"), "json"),
    "header not an object": (_raw(b"[]"), "'{'"),
    "entry missing fields": (_raw({"a": {"dtype": "F32", "shape": [2]}}), "missing"),
    "entry ill-typed": (_raw({"a": _entry(offsets="0-8")}), "data_offsets"),
    "unknown dtype": (_raw({"a": _entry(dtype="F7")}), "unknown dtype"),
    "negative shape": (_raw({"a": _entry(shape=[-2])}), "shape"),
    "non-integer shape": (_raw({"a": _entry(shape=[2.5])}), "shape"),
    "offsets out of bounds": (_raw({"a": _entry(shape=(4,), offsets=(0, 16))}), "truncated"),
    "offsets overlapping": (_raw({"a": _entry(), "b": _entry(shape=(1,), offsets=(4, 8))}), "overlaps"),
    "offsets with a gap": (_raw({"a": _entry(shape=(1,), offsets=(4, 8))}), "gap"),
    "offsets reversed": (_raw({"a": _entry(shape=(0,), offsets=(8, 0))}), "reversed"),
    "size not matching shape": (_raw({"a": _entry(shape=(3,))}), "needs 12"),
    "same tensor in two shards": (lambda tmp: _sharded(tmp, _dup_across_shards), "both"),
    "index names a missing shard": (
        lambda tmp: _sharded(tmp, lambda f, wm: wm.update({next(iter(wm)): "model-00099-of-00099.safetensors"})),
        "does not exist"),
    "index absolute path": (
        lambda tmp: _sharded(tmp, lambda f, wm: wm.update({next(iter(wm)): str(f / wm[next(iter(wm))])})),
        "absolute"),
    "index dot dot": (
        lambda tmp: _sharded(tmp, lambda f, wm: wm.update({next(iter(wm)): "../model.safetensors"})), "path"),
    "tensor not in its shard": (
        lambda tmp: _sharded(tmp, _move_to_another_shard),
        "not in its shard"),
    "shard tensor missing from index": (lambda tmp: _sharded(tmp, _missing_from_index), "missing from the index"),
    "pickle with non-tensor objects": (lambda tmp: _pickle_with(tmp, {"step": 3}), "not tensors"),
    "pickle with a non-allowlisted class": (lambda tmp: _pickle_with(tmp, ValueError("x")), "refused to unpickle"),
    "not a checkpoint file": (lambda tmp: (tmp / "notes.txt", (tmp / "notes.txt").write_text("hi"))[0],
                              "unsupported"),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_gets_one_line_error_and_no_output(run_cli, tmp_path: Path, case: str) -> None:
    build, fragment = BAD_SOURCES[case]
    src = build(tmp_path)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    result = run_cli("split", src, out, "--max-shard-size", "100B")
    line = assert_one_line_error(result, contains=fragment)
    assert line.startswith("error: ")
    assert not out.exists()
    assert snapshot(tmp_path) == before, "nothing written, source untouched"


@pytest.mark.parametrize("size", ["5XB", "0", "-1GB", "abc", "1.5.2GB", ""])
def test_bad_max_shard_size(run_cli, tmp_path: Path, size: str) -> None:
    src = _good_file(tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", size)
    assert_one_line_error(result, contains="--max-shard-size")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--dtype", "int4"], "--dtype"),
    (["--dtype", "fp8_e4m3"], "--allow-lossy"),
    (["--name", "a/b"], "--name"),
    (["--key", "nope"], None),  # a key on a safetensors source is ignored
])
def test_bad_options(run_cli, tmp_path: Path, args: list[str], fragment: str | None) -> None:
    src = _good_file(tmp_path)
    result = run_cli("split", src, tmp_path / "out", *args)
    if fragment is None:
        assert result.exit_code == 0
        return
    assert_one_line_error(result, contains=fragment)
    assert not (tmp_path / "out").exists()


def test_usage_errors_are_one_line(run_cli) -> None:
    assert_one_line_error(run_cli("split", "only-one-arg"), contains="missing argument")
    assert_one_line_error(run_cli("nosuchcommand"), contains="no such command")


def test_output_already_exists(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    assert_one_line_error(run_cli("split", src, out), contains="exists")
    assert (out / "model.safetensors").read_bytes() == b"precious"
    afile = tmp_path / "file"
    afile.write_text("x")
    assert_one_line_error(run_cli("split", src, afile), contains="is a file")
    assert afile.read_text() == "x"


def test_malicious_pickle_payload_never_runs(run_cli, tmp_path: Path) -> None:
    import torch

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "payload": Payload()}, path)
    result = run_cli("split", path, tmp_path / "out")
    assert_one_line_error(result, contains="never executes pickled code")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    # and the payload is real: a plain torch.load would run it
    torch.load(path, weights_only=False)
    assert marker.exists()


# ------------------------------------------------------------------ real processes: full disk, kill, Ctrl-C

def _limit_file_size(max_bytes: int) -> Callable[[], None]:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed

    return preexec


def _sparse_source(path: Path, n_tensors: int, tensor_bytes: int) -> Path:
    doc, size = raw_header([(f"t.{i:03d}", "F32", [tensor_bytes // 4], tensor_bytes) for i in range(n_tensors)])
    write_raw_safetensors(path, doc, pad=True)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) + size)
    return path


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_disk_full_mid_write_leaves_nothing(run_shardkit, tmp_path: Path, dtype: str | None) -> None:
    src = _sparse_source(tmp_path / "src.safetensors", 8, 256 * 1024)
    out = tmp_path / "out"
    args = ["split", src, out, "--max-shard-size", "600KB", "-q"] + (["--dtype", dtype] if dtype else [])
    done = run_shardkit(*args, preexec_fn=_limit_file_size(300_000))
    assert_one_line_error(done, contains="too large")
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_disk_full_during_in_place_reshard_keeps_the_old_checkpoint(run_shardkit, tmp_path: Path) -> None:
    src = _sparse_source(tmp_path / "src.safetensors", 8, 256 * 1024)
    ckpt = tmp_path / "ckpt"
    assert run_shardkit("split", src, ckpt, "--max-shard-size", "600KB", "-q").returncode == 0
    before = snapshot(ckpt)
    done = run_shardkit("split", ckpt, ckpt, "--max-shard-size", "2MB", "--overwrite", "-q",
                        preexec_fn=_limit_file_size(700_000))
    assert_one_line_error(done, contains="too large")
    assert snapshot(ckpt) == before
    assert leftovers(tmp_path) == []


def _start_and_kill_mid_write(args: list[object], staging_parent: Path, sig: int,
                              tmp_marker: str, *, signals: Path) -> subprocess.Popen:
    """Start the CLI, let it stop at its first write into a shard, check that a partly written
    temporary shard is on disk, then send ``sig``.

    The pause is the ``write`` fault point (``shardkit/_faults.py``): the process signals it is
    there and waits for a file that never comes, so the signal always lands mid-write, however
    slow or loaded the machine. (Polling for the temporary file instead raced the writer: a fast
    or lucky run published before the signal was sent, and exited 0.) SIGINT is reset to its
    default in the child: a test run started in the background (``&`` in a script) ignores
    SIGINT, the child would inherit that, and Python then installs no KeyboardInterrupt handler.
    """
    signals.mkdir()  # the pause's signal files: in the test's own folder, outside the staging area
    go = signals / "go"
    env = {**os.environ, "SHARDKIT_FAULT_WAIT_AT": "write", "SHARDKIT_FAULT_WAIT_FILE": str(go)}
    proc = subprocess.Popen([SHARDKIT_BIN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not any(signals.glob("go.ready.*")):
            assert proc.poll() is None, f"the process ended before its first write: {proc.communicate()}"
            assert time.monotonic() < deadline, "the process never reached its first write"
            time.sleep(0.01)
        writing = [p for p in staging_parent.rglob("*.safetensors") if tmp_marker in str(p) and p.stat().st_size]
        assert writing, "paused at a write, but no partly written temporary shard is on disk"
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc


def test_sigkill_mid_write_publishes_nothing_and_next_run_cleans_up(tmp_path: Path) -> None:
    src = _sparse_source(tmp_path / "src.safetensors", 6, 12 * 2**20)  # 72 MB
    out = tmp_path / "out"
    args = ["split", src, out, "--max-shard-size", "20MB", "--dtype", "bf16", "-q"]
    proc = _start_and_kill_mid_write(args, tmp_path, signal.SIGKILL, ".out.shardkit-tmp-", signals=tmp_path / "signals")
    assert proc.returncode == -signal.SIGKILL, "the process finished before it could be killed"
    assert not out.exists()
    assert any(".shardkit-tmp-" in name for name in os.listdir(tmp_path)), "staging of the killed run"
    done = subprocess.run([SHARDKIT_BIN, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == []
    assert len(list(out.glob("*.safetensors"))) == 2  # 6 × 6 MB in bf16, 20 MB shards


def test_sigkill_during_in_place_reshard_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    src = _sparse_source(tmp_path / "src.safetensors", 6, 12 * 2**20)
    ckpt = tmp_path / "ckpt"
    subprocess.run([SHARDKIT_BIN, "split", src, ckpt, "--max-shard-size", "30MB", "-q"], check=True)
    before = snapshot(ckpt)
    args = ["split", ckpt, ckpt, "--max-shard-size", "20MB", "--dtype", "bf16", "--overwrite", "-q"]
    proc = _start_and_kill_mid_write(args, ckpt, signal.SIGKILL, ".shardkit-tmp-", signals=tmp_path / "signals")
    assert proc.returncode == -signal.SIGKILL
    assert {k: v for k, v in snapshot(ckpt).items() if ".shardkit-" not in k} == before
    import shardkit

    shardkit.split(ckpt, tmp_path / "check", max_shard_size="1GB")  # the old checkpoint still reads cleanly
    assert leftovers(ckpt), "reading a folder (the source of a split elsewhere) never changes it"
    shardkit.recover(ckpt)
    assert leftovers(ckpt) == [], "recover removed the dead writer's temporaries"


def test_ctrl_c_mid_write_exits_130_and_leaves_nothing(tmp_path: Path) -> None:
    src = _sparse_source(tmp_path / "src.safetensors", 6, 12 * 2**20)
    out = tmp_path / "out"
    args = ["split", src, out, "--max-shard-size", "20MB", "--dtype", "bf16", "-q"]
    proc = _start_and_kill_mid_write(args, tmp_path, signal.SIGINT, ".out.shardkit-tmp-", signals=tmp_path / "signals")
    assert proc.returncode == 130, proc.stderr.read()
    assert "interrupted" in proc.stderr.read()
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_pickle_sources_on_the_command_line(run_cli, tmp_path: Path) -> None:
    import torch

    tensors = make_state_dict(["F32", "I64", "BF16"], shapes=[(30,)])
    torch.save({"ema": tensors, "state_dict": make_state_dict(["F32"])}, tmp_path / "model.ckpt")
    result = run_cli("split", tmp_path / "model.ckpt", tmp_path / "ema", "--key", "ema", "-q")
    assert result.exit_code == 0, result.stderr
    assert_bit_equal(load_folder(tmp_path / "ema"), tensors)
    torch.save(tensors, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    result = run_cli("split", tmp_path / "legacy.bin", tmp_path / "legacy", "-q")
    assert result.exit_code == 0
    assert result.error_lines == [line for line in result.error_lines if line.startswith("warning: ")]
    assert len(result.error_lines) == 1 and "legacy" in result.error_lines[0]
    assert_bit_equal(load_folder(tmp_path / "legacy"), tensors)
    missing = run_cli("split", tmp_path / "model.ckpt", tmp_path / "x", "--key", "nope")
    assert_one_line_error(missing, contains="key 'nope' not found")


@pytest.mark.parametrize("command", ["split", "convert"])
@pytest.mark.parametrize("inside", ["sub", "sub/deeper", "./sub"])
def test_output_inside_the_source_folder_is_refused_and_nothing_is_written(command: str, inside: str,
                                                                           tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(folder / "model.safetensors"))
    before = sorted(p.name for p in folder.rglob("*"))
    result = invoke_cli(command, folder, folder / inside, "--max-shard-size", "100B")
    assert_one_line_error(result, code=2, contains="inside the source folder")
    assert sorted(p.name for p in folder.rglob("*")) == before
    same = invoke_cli(command, folder, folder, "--max-shard-size", "100B", "--overwrite", "-q")
    assert same.exit_code == 0, same.stderr  # in place is still allowed


# ------------------------------------------------------------------ sizes in the wrong unit (issue 14, item 4)

def test_bare_number_under_a_megabyte_warns_with_the_unit_to_add(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", "5000", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "--max-shard-size 5000 has no unit and means 5000 bytes" in result.stderr
    assert "--max-shard-size 5000MB" in result.stderr
    quiet = run_cli("split", src, tmp_path / "out2", "--max-shard-size", "5MB", "--dry-run")
    assert "no unit" not in quiet.stderr


def test_a_plan_of_more_than_a_thousand_shards_warns_in_dry_run_too(run_cli, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "many.safetensors"
    save_file({f"t{i}": torch.zeros(4) for i in range(1002)}, str(src))
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", "16B", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "the plan has 1002 shards" in result.stderr and "unit you meant" in result.stderr
    assert not (tmp_path / "out").exists()
    fewer = run_cli("split", src, tmp_path / "out", "--max-shard-size", "1KB", "--dry-run")
    assert "shards of at most" not in fewer.stderr


# ------------------------------------------------------------------ OUTPUT ending in .safetensors (issue 14, item 8)

@pytest.mark.parametrize("command", ["split", "convert"])
def test_output_ending_in_safetensors_writes_one_file(run_cli, tmp_path: Path, command: str) -> None:
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "x.bin"
    state = {"a": torch.randn(10), "b": torch.arange(6)}
    torch.save(state, src)
    out = tmp_path / "out.safetensors"
    result = run_cli(command, src, out)
    assert result.exit_code == 0, result.stderr
    assert out.is_file(), "a file, not a folder called out.safetensors"
    assert_bit_equal(load_file(str(out)), state)
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "x.bin"]
    again = run_cli(command, src, out)
    assert_one_line_error(again, contains="--overwrite")
    assert run_cli(command, src, out, "--overwrite").exit_code == 0


def test_output_file_that_needs_several_shards_is_refused_with_both_fixes(run_cli, tmp_path: Path) -> None:
    src = _good_file(tmp_path)
    before = snapshot(tmp_path)
    result = run_cli("split", src, tmp_path / "one.safetensors", "--max-shard-size", "200B")
    line = assert_one_line_error(result, contains="names one file")
    assert "one/" in line and "--max-shard-size" in line
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)
    needed = line.rsplit("--max-shard-size ", 1)[1].split()[0]
    assert run_cli("split", src, tmp_path / "one.safetensors", "--max-shard-size", needed).exit_code == 0
    assert (tmp_path / "one.safetensors").is_file()


def test_split_with_a_gguf_quantize_names_the_convert_command(tmp_path: Path) -> None:
    """split has no --to: a GGUF type says which command writes it, and nothing is written."""
    result = invoke_cli("split", _good_file(tmp_path), tmp_path / "out", "--quantize", "q8_0")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--quantize q8_0 is a GGUF type, which only convert writes, with --to gguf" in result.stderr
    assert not (tmp_path / "out").exists()
