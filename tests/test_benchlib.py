"""The benchmarks' shared runner and builders (scripts/benchlib.py, scripts/build_checkpoint.py), and a
tiny end-to-end run of the benchmarks that build their own inputs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import benchlib  # noqa: E402
import build_checkpoint  # noqa: E402


def test_rounds_rotate_the_case_order_and_drop_none() -> None:
    seen: list[tuple[str, int]] = []

    def one(key: str, r: int) -> dict[str, int] | None:
        seen.append((key, r))
        return None if key == "b" and r == 1 else {"r": r}

    results = benchlib.rounds(["a", "b", "c"], 3, one)
    assert [k for k, _ in seen] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert results == {"a": [{"r": 0}, {"r": 1}, {"r": 2}], "b": [{"r": 0}, {"r": 2}], "c": [{"r": 0}, {"r": 1}, {"r": 2}]}


def test_shell_cases_are_timed_in_fresh_processes_with_their_cleanup(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [benchlib.Case("floor", "true"),
             benchlib.Case("write", f"mkdir {out} && head -c 1000 /dev/zero > {out}/x", "t", [str(out)])]
    benchlib.run_interleaved(cases, runs=2, log=lambda line: None)
    assert [len(c.times) for c in cases] == [2, 2] and all(rss > 0 for c in cases for rss in c.rss_mb)
    assert not out.exists()  # removed before each run (mkdir would fail) and after the last
    table = benchlib.table(cases, floor="floor")
    assert table.splitlines()[:2] == ["| case | median s | × floor | peak RSS MB | target |", "|---|---:|---:|---:|---|"]
    assert table.splitlines()[2].startswith("| floor | ") and "| 1.00× |" in table.splitlines()[2]


def test_cases_record_the_cpu_seconds_of_their_process_tree(tmp_path: Path) -> None:
    burn = f"{sys.executable} -c 'import time\nwhile time.process_time() < 0.3: pass'"
    usage = benchlib.measure(f"{burn} & {burn}; wait")  # two children, both counted
    assert usage.cpu_s >= 0.6 and usage.rss_mb > 0 and usage.seconds > 0
    assert benchlib.measure("true").cpu_s < 0.6
    cases = [benchlib.Case("burn", burn), benchlib.Case("idle", "sleep 0.01")]
    benchlib.run_interleaved(cases, runs=2, log=lambda line: None)
    assert len(cases[0].cpu_s) == 2 and min(cases[0].cpu_s) >= 0.3 and max(cases[1].cpu_s) < 0.3


def test_rounds_record_the_load_average_of_each_round() -> None:
    loads: list[tuple[float, float]] = []
    results = benchlib.rounds(["a", "b"], 2, lambda key, r: {"r": r}, loads=loads)
    assert results == {"a": [{"r": 0}, {"r": 1}], "b": [{"r": 0}, {"r": 1}]}
    assert len(loads) == 2 and all(a >= 0 and b >= 0 for a, b in loads)


def test_shell_bench_reports_each_table_against_its_own_first_case(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    tables = {"one (1 B)": [benchlib.Case("floor a", "true"), benchlib.Case("a", "true", "t")],
              "two": [benchlib.Case("floor b", "true"), benchlib.Case("b", "true")]}
    benchlib.shell_bench("title", tables, runs=1, output=str(report), note="note line")
    lines = report.read_text().splitlines()
    assert lines[0] == "title; each write followed by sync; median of 1 run(s), cases interleaved"
    assert lines[1].startswith("machine: ") and lines[2].startswith("load average (1 min) at the start/end of each")
    assert lines[3] == "note line" and lines[4] == ""
    assert lines[5] == "one (1 B):" and lines[6].startswith("| case | median s | × floor |")
    assert lines[8].startswith("| floor a | ") and "| 1.00× |" in lines[8] and lines[9].endswith("| t |")
    assert lines[11] == "two:" and lines[14].startswith("| floor b | ") and "| 1.00× |" in lines[14]


def test_rounds_print_a_line_per_run_and_say_which_failed(capsys: pytest.CaptureFixture[str]) -> None:
    results = benchlib.rounds([("local", "a"), ("fuse", "b")], 1, lambda key, r: {"error": "no"} if key[1] == "b" else
                              {"s": 1.5}, line=lambda d: f"{d['s']} s")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  run 1/1 local a: 1.5 s, load ") and lines[1].startswith("  run 1/1 fuse b: FAILED no")
    assert results[("fuse", "b")] == [{"error": "no"}]


def test_report_head_and_the_only_filter() -> None:
    head = benchlib.report_head("what", runs=3, loads=[(1.0, 2.5)], notes=["a note"]).splitlines()
    assert head[0] == "what; median of 3 run(s), cases interleaved" and head[1].startswith("machine: ")
    assert head[2].endswith(": 1.0/2.5") and head[3:] == ["a note", ""]
    assert benchlib.picked(["cp (floor)", "shardkit split", "hub"], ["split", "floor"]) == ["cp (floor)",
                                                                                             "shardkit split"]
    assert benchlib.picked(["a", "b"], []) == ["a", "b"]
    args = benchlib.parser("doc", work="w", only=True).parse_args(["--only", "x", "--only", "y"])
    assert (args.runs, args.work, args.only, args.output) == (3, "w", ["x", "y"], None)
    assert not hasattr(benchlib.parser("doc", runs=None, output=False).parse_args([]), "runs")


def test_a_python_case_runs_in_its_own_process_and_returns_one_json_line(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\nimport benchlib\n"
                      "benchlib.serve_child({'add': lambda a, b: {'sum': int(a) + int(b)}})\nprint('parent')\n")
    assert benchlib.child(str(script), "--child", "add", "2", "3") == {"sum": 5}
    parent = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert parent.stdout == "parent\n"


def test_measure_fails_with_the_commands_stderr() -> None:
    with pytest.raises(SystemExit, match="went wrong"):
        benchlib.measure("echo went wrong >&2; exit 3")


def test_tree_bytes_and_median_of(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "x").write_bytes(b"12345")
    (tmp_path / "d" / "e" / "y").write_bytes(b"123")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "x")
    assert benchlib.tree_bytes(str(tmp_path / "d")) == 8 and benchlib.tree_bytes(str(tmp_path / "d" / "x")) == 5
    assert benchlib.tree_bytes(str(tmp_path / "missing")) == 0
    assert benchlib.med([{"s": 1.0}, {"error": "x"}, {"s": 3.0}], "s") == 2.0
    assert benchlib.med([{"error": "x"}], "s") is None


def test_a_failing_child_is_an_error_or_a_miss(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nif sys.argv[1] == 'ok': print(json.dumps({'x': 1}))\nelse: sys.exit('bad input')\n")
    assert benchlib.child(str(script), "ok") == {"x": 1}
    assert benchlib.child(str(script), "no", check=False) == {"error": "bad input"}
    with pytest.raises(SystemExit, match="bad input"):
        benchlib.child(str(script), "no")


def test_build_random_writes_the_size_asked_in_shards(tmp_path: Path) -> None:
    names = build_checkpoint.build_random(str(tmp_path / "ck"), size_bytes=5 << 20, shard_bytes=2 << 20,
                                          tensor_bytes=1 << 20, dtype="F16", manifest=False)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    state: dict[str, torch.Tensor] = {}
    for name in names[:3]:
        state.update(load_file(tmp_path / "ck" / name))
    assert sorted(state) == [f"layers.{i:04d}.weight" for i in range(5)]
    assert sum(t.nbytes for t in state.values()) == 5 << 20
    again = build_checkpoint.build_random(str(tmp_path / "again"), size_bytes=5 << 20, shard_bytes=2 << 20,
                                          tensor_bytes=1 << 20, dtype="F16", manifest=False)
    assert all((tmp_path / "ck" / n).read_bytes() == (tmp_path / "again" / n).read_bytes() for n in again)  # seeded


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["bench_convert.py", "--tiny"], ["bench_split.py", "--size", "tiny"]])
def test_a_benchmark_runs_end_to_end_on_a_tiny_unet(tmp_path: Path, argv: list[str]) -> None:
    report = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(SCRIPTS / argv[0]), *argv[1:], "--runs", "1", "--work",
                           str(tmp_path / "work"), "--output", str(report)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(SCRIPTS.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    text = report.read_text()
    assert "| case | median s | × floor | peak RSS MB | target |" in text and "(floor" in text


def test_the_gguf_out_llama_has_the_shape_of_the_earlier_measurement() -> None:
    import bench_convert

    def bf16_bytes(layers: int) -> int:
        return sum(2 * math.prod(shape) for shape in bench_convert.llama_shapes(layers).values())

    assert bf16_bytes(10) == 1_143_033_856  # 10 layers of 2048: the 1.14 GB Llama of docs/quantized.md
    assert bf16_bytes(20) - bf16_bytes(10) == 10 * (bf16_bytes(1) - bf16_bytes(0))  # every layer alike
    assert sorted(bench_convert.llama_shapes(1))[:3] == ["lm_head.weight", "model.embed_tokens.weight",
                                                         "model.layers.0.input_layernorm.weight"]


@pytest.mark.slow
def test_the_gguf_out_sweep_finds_shardkit_and_the_converter_equal(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_llama_cpp import llama_cpp_converter

    llama_cpp_converter()  # skips, saying why, where it cannot be had
    report = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_convert.py"), "--groups", "gguf-out", "--sizes", "1",
                           "--runs", "1", "--work", str(tmp_path / "work"), "--output", str(report)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(SCRIPTS.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    row = report.read_text().splitlines()[-1]
    assert row.startswith("| 1 (0.35 GB) |") and row.endswith(("| tensors and keys |", "| identical |")), row
    assert os.listdir(tmp_path / "work") == []  # the folder and both outputs deleted
