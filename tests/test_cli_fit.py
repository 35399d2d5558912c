"""``shardkit fit`` on a tiny pipeline folder: table, JSON, impossible budgets, bad input."""

from __future__ import annotations

import json
import re
import shutil

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
    return f"{margin.budget_for(int(peak), gpu=True)}B"


def test_fit_json_ranks_every_candidate(folder) -> None:
    gpu = budget_holding(folder, "model_offload+fp8")
    code, out, _ = run("fit", str(folder), "--gpu", gpu, "--cpu", "1GB", "--reserve", "1B", "--json")
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
    code, out, _ = run("fit", str(folder), "--gpu", gpu, "--gpu", gpu, "--reserve", "1B", "--height", "32")
    assert code == 0
    workload, header = out.splitlines()[:2]
    assert workload.startswith("workload: 32x") and "batch 1" in workload
    assert "cuda:0" in header and "cuda:1" in header and "fits" in header
    chosen = next(line for line in out.splitlines() if line.startswith("->"))
    assert "components balanced across GPUs" in chosen and chosen.rstrip().endswith("yes")
    assert "chosen: components balanced across GPUs" in out


def test_impossible_budget_exits_2_with_the_smallest_budget(folder) -> None:
    code, out, err = run("fit", str(folder), "--gpu", "1MB", "--cpu", "1GB", "--reserve", "1B")
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


@pytest.mark.parametrize("budget", [["--gpu", "1MB"], ["--gpu", "1MB", "--cpu", "1MB"], ["--cpu", "1MB"],
                                    ["--max-memory", "0=1MB,1=1MB,cpu=1GB"]])
def test_the_smallest_budget_is_printed_as_flags_that_fit(folder, budget) -> None:
    """Rounded up and pasteable: rerunning with exactly the printed flags exits 0 (issue 14, item 6)."""
    code, _, err = run("fit", str(folder), *budget)
    assert code == 2
    first = re.search(r"the smallest budget that would fit is ((?:--(?:gpu|cpu) \S+ ?)+)", err)
    assert first, err
    flags = first.group(1).split()
    assert all(re.fullmatch(r"\d+(\.\d\d)?[KMGT]?B", value) for value in flags[1::2]), flags
    kept = [] if "--max-memory" in budget else [a for i, a in enumerate(budget)
                                                if a == "--cpu" or (i and budget[i - 1] == "--cpu")]
    if "--cpu" in flags:
        kept = []
    code, out, err = run("fit", str(folder), *flags, *kept, "-q")
    assert code == 0, err
    assert out.strip() and len(out.splitlines()) == 1


def test_the_printed_flag_is_the_smallest_at_its_precision(folder) -> None:
    code, _, err = run("fit", str(folder), "--gpu", "1MB", "--cpu", "1GB", "--reserve", "1B")
    value = re.search(r"--gpu (\d+\.\d\d)MB", err)
    assert code == 2 and value, err
    lower = f"{float(value.group(1)) - 0.01:.2f}MB"
    code, _, err = run("fit", str(folder), "--gpu", lower, "--cpu", "1GB", "--reserve", "1B")
    assert code == 2 and f"--gpu {value.group(1)}MB" in err


def test_max_memory_is_the_same_budget_as_gpu_and_cpu(folder) -> None:
    gpu = budget_holding(folder, "model_offload+fp8")
    _, by_flags, _ = run("fit", str(folder), "--gpu", gpu, "--cpu", "1GB", "--reserve", "1B", "--json")
    _, by_map, _ = run("fit", str(folder), "--max-memory", f"0={gpu},cpu=1GB", "--reserve", "1B", "--json")
    _, mixed, _ = run("fit", str(folder), "--max-memory", "cpu=1GB", "--gpu", gpu, "--reserve", "1B", "--json")
    assert json.loads(by_flags) == json.loads(by_map) == json.loads(mixed)
    code, _, err = run("fit", str(folder), "--max-memory", "0=2GB", "--gpu", "1GB")
    assert code == 2 and "GPU 0 is given twice" in err and len(err.strip().splitlines()) == 1


def test_dtype_takes_the_compute_subset_of_the_shard_dtypes(folder) -> None:
    from shardkit.cli.common import _SHARD_OPTIONS
    from shardkit.cli.fit import COMPUTE_DTYPES

    shard_choices = _SHARD_OPTIONS["dtype"](lambda: None).__click_params__[0].type.choices
    assert set(COMPUTE_DTYPES) <= set(shard_choices)
    base = ["fit", str(folder), "--gpu", "10GB", "--json"]
    assert json.loads(run(*base, "--dtype", "bf16")[1]) == json.loads(run(*base, "--dtype", "bfloat16")[1])
    code, _, err = run(*base, "--dtype", "fp8_e4m3")
    assert code == 2 and "not a compute dtype" in err and "bf16, fp16, fp32" in err


def test_exclude_names_strategies_and_refuses_anything_else(folder) -> None:
    from shardkit.fitting.peaks import STRATEGIES

    _, help_text, _ = run("fit", "--help")
    flat = " ".join(help_text.split())
    assert all(s.name.split("_")[0] in flat for s in STRATEGIES) and "strategy name starts with" in flat
    code, out, _ = run("fit", str(folder), "--gpu", "10GB", "--exclude", "gpu", "--exclude", "fp8", "-q")
    assert code == 0 and out.strip() == "balanced" or out.strip() not in ("gpu", "gpu+fp8"), out
    code, _, err = run("fit", str(folder), "--gpu", "10GB", "--exclude", "unet")
    assert code == 2 and "matches no setup" in err


def test_quiet_prints_the_chosen_setup_only(folder) -> None:
    code, out, err = run("fit", str(folder), "--gpu", "10GB", "-q")
    assert code == 0 and out == "gpu\n" and err == ""


def test_guessed_components_are_named_on_stderr_and_in_json(folder, tmp_path) -> None:
    """A UNet folder without config.json: guessed from its tensors, said so (issue 14, item 7)."""
    unet = tmp_path / "med-unet"
    shutil.copytree(folder / "unet", unet)
    base = ["fit", str(folder / "unet"), "--gpu", "10GB", "--json", "--height", "256", "--width", "256"]
    with_config = json.loads(run(*base)[1])
    (unet / "config.json").unlink()
    code, out, err = run("fit", unet, *base[2:])
    assert code == 0
    warning = [line for line in err.splitlines() if line.startswith("warning: med-unet: no config.json")]
    assert len(warning) == 1 and "UNet" in warning[0] and "block_out_channels" in warning[0], err
    doc = json.loads(out)
    guessed = doc["components"][0]
    assert guessed["role"] == "denoiser" and guessed["guessed"] and doc["guessed"][0].startswith("med-unet: ")
    # The shapes give back what the config said, so the all-on-one-GPU peak (weights + plain
    # activations) is the same; without a config the role alone would have priced it as a text encoder.
    assert not with_config["guessed"] and not with_config["components"][0]["guessed"]
    peaks = [next(c["peak_bytes"] for c in d["candidates"] if c["name"] == "gpu") for d in (doc, with_config)]
    assert peaks[0] == peaks[1]
    code, out, err = run("fit", unet, "--gpu", "10GB")
    assert code == 0 and out.startswith("workload: 1024x1024, batch 1") and "guessed: med-unet" in out


def test_fit_on_a_file_says_it_needs_a_folder(run_cli, tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    result = run_cli("fit", tmp_path / "x.safetensors", "--gpu", "1GB")
    assert result.exit_code == 2 and "is a file; fit reads a pipeline or component folder" in result.stderr
    assert "no such" not in result.stderr


def test_a_model_class_that_cannot_be_built_is_a_note_not_a_silent_guess(folder, tmp_path) -> None:
    """A class the library lacks (a newer diffusers, a custom pipeline): planned from the headers, and said so."""
    pipe = tmp_path / "pipe"
    shutil.copytree(folder, pipe)
    index = json.loads((pipe / "model_index.json").read_text())
    index["unet"] = ["diffusers", "UNetFromTheFuture"]
    (pipe / "model_index.json").write_text(json.dumps(index))
    code, out, err = run("fit", pipe, "--gpu", "10GB", "--json")
    assert code == 0, err
    notes = [n for c in json.loads(out)["components"] for n in c["notes"] if "model not built" in n]
    assert len(notes) == 1 and "UNetFromTheFuture" in notes[0] and "headers alone" in notes[0], notes
    code, out, err = run("fit", pipe, "--gpu", "10GB")
    assert code == 0 and "note: unet: model not built (" in out, out


def test_a_bug_while_building_the_model_is_not_swallowed(folder, monkeypatch) -> None:
    """Only the expected failures (missing class or package, a refused config) become a note."""
    from shardkit.fitting.autofit import fit
    from shardkit.loading import skeleton

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(skeleton, "build_skeleton", broken)
    with pytest.raises(ZeroDivisionError):
        fit(folder, gpu=["10GB"])


def test_fit_on_a_text_model_says_what_fit_covers_and_what_to_use(tmp_path) -> None:
    """A sentence-transformers-style BERT folder is no diffusion pipeline: one line naming it and
    the command that plans any model's placement, exit 2, and that command works."""
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                         vocab_size=500)).save_pretrained(tmp_path / "bert")
    code, out, err = run("fit", tmp_path / "bert", "--gpu", "8GB", "--cpu", "24GB")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "a bert model on its own" in err and "use plan with --model transformers:BertModel" in err
    code, out, err = run("plan", tmp_path / "bert", "--model", "transformers:BertModel", "--gpu", "1MB")
    assert code == 0, err
