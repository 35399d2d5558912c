"""``shardkit fit`` on a tiny pipeline folder: table, JSON, impossible budgets, bad input."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    from helpers_fit import save_tiny_pipeline

    root = tmp_path_factory.mktemp("cli-fit")
    save_tiny_pipeline(root / "pipe", root / "scratch")
    return root / "pipe"


def run(*args: object) -> tuple[int, str, str]:
    from conftest import invoke_cli

    result = invoke_cli(*args)
    return result.exit_code, result.stdout, result.stderr


def budget_holding(folder, name: str, gpus: int = 1) -> str:
    """The per-GPU budget (bytes, as the CLI takes it) that just holds candidate ``name``'s peak."""
    from shardkit.fitting.autofit import Margin, fit

    margin = Margin(0.1, 1)
    roomy = fit(folder, gpu=["10GB"] * gpus, margin=margin)
    peak = max(next(c for c in roomy.candidates if c.name == name).peaks.gpu)
    return str(margin.budget_for(int(peak), gpu=True))


def test_fit_json_ranks_every_candidate(folder) -> None:
    gpu = budget_holding(folder, "model_offload+fp8")
    code, out, _ = run("fit", str(folder), "--gpu", gpu, "--cpu", "1GB", "--reserve", "1", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["chosen"]["name"] == "model_offload+fp8"
    assert data["setup"]["offload"] == "model"
    names = [c["name"] for c in data["candidates"]]
    assert names.index("gpu") < names.index("model_offload") < names.index("sequential")
    speeds = [c["speed"] for c in data["candidates"]]
    assert speeds == sorted(speeds)
    gpu = next(c for c in data["candidates"] if c["name"] == "gpu")
    assert not gpu["fits"] and "cuda:0 would need" in gpu["reason"]
    assert {c["name"] for c in data["components"]} == {"text_encoder", "unet", "vae"}
    assert data["why"][0].startswith("all on one GPU (1.00x): cuda:0 would need")


def test_fit_table_for_two_gpus(folder) -> None:
    gpu = budget_holding(folder, "balanced", gpus=2)
    code, out, _ = run("fit", str(folder), "--gpu", gpu, "--gpu", gpu, "--reserve", "1", "--height", "32")
    assert code == 0
    header = out.splitlines()[0]
    assert "cuda:0" in header and "cuda:1" in header and "fits" in header
    chosen = next(line for line in out.splitlines() if line.startswith("->"))
    assert "components balanced across GPUs" in chosen and chosen.rstrip().endswith("yes")
    assert "chosen: components balanced across GPUs" in out


def test_impossible_budget_exits_2_with_the_smallest_budget(folder) -> None:
    code, out, err = run("fit", str(folder), "--gpu", "1MB", "--cpu", "1GB", "--reserve", "1")
    assert code == 2 and out == ""
    assert err.startswith("error: no setup fits the budget") and "smallest budget that would fit is --gpu" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--gpu", "lots"], "Invalid value for '--gpu'"),
    (["--gpu", "1GB", "--height", "0"], "--height"),
])
def test_bad_input_is_one_line(folder, args, message) -> None:
    code, _, err = run("fit", str(folder), *args)
    assert code == 2 and message in err


def test_missing_folder_and_no_budget(tmp_path) -> None:
    code, _, err = run("fit", str(tmp_path / "nope"), "--gpu", "1GB")
    assert code == 2 and "no such folder" in err
    code, _, err = run("fit", str(tmp_path), "--gpu", "1GB")
    assert code == 2 and err.startswith("error:")
