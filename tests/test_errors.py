"""Errors and warnings made of parts: the Python text callers see, the structure the CLI renders from."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

import shardkit
from shardkit.cli.flags import message_words
from shardkit.errors import (
    FitError,
    InvalidInputError,
    Option,
    OutputExistsError,
    ShardkitError,
    ShardkitWarning,
    VerificationError,
    join_parts,
    parts_of,
)


@pytest.mark.parametrize("option, text", [
    (Option("overwrite", True), "overwrite=True"),
    (Option("cache", False), "cache=False"),
    (Option("config"), "config=..."),
    (Option("to", "gguf"), "to='gguf'"),
    (Option("task", 3), "task=3"),
    (Option("exclude", ["model_ema.*"]), "exclude=['model_ema.*']"),
    (Option("dtype", "bf16", choices=("fp16", "fp32")), "dtype='bf16', 'fp16' or 'fp32'"),
    (Option("device_map", "cpu", choices=("cuda",)), "device_map='cpu' or 'cuda'"),
])
def test_an_option_is_written_as_its_python_parameter(option: Option, text: str) -> None:
    assert str(option) == text


def test_an_error_is_its_python_text_and_keeps_its_parts() -> None:
    error = OutputExistsError("out/ exists; pass ", Option("overwrite", True), " to replace it")
    assert str(error) == "out/ exists; pass overwrite=True to replace it"
    assert error.args == (str(error),) and error.parts[1] == Option("overwrite", True)
    assert isinstance(error, FileExistsError) and error.errno is None  # one argument: no errno parsed from the parts
    with pytest.raises(OutputExistsError, match=r"pass overwrite=True to"):
        raise error


def test_a_plain_message_is_one_part() -> None:
    error = InvalidInputError("no such file")
    assert error.parts == ("no such file",) and str(error) == "no such file" and message_words(error) == "no such file"


def test_an_error_pickles_with_its_parts_and_fields() -> None:
    for error in (OutputExistsError("pass ", Option("overwrite", True)),
                  VerificationError("or pass ", Option("verify", False), findings=["a.safetensors: bad crc"]),
                  FitError("at least ", Option("gpu", "8GB"), min_gpu_bytes=8 * 10**9)):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and copy.parts == error.parts
        assert copy.__dict__ == error.__dict__


def test_a_wrapped_error_keeps_the_parts_of_the_error_it_wraps() -> None:
    inner = InvalidInputError("casting to fp8 loses precision; pass ", Option("allow_lossy", True))
    outer = InvalidInputError("layerwise casting: ", *parts_of(inner))
    assert str(outer) == "layerwise casting: casting to fp8 loses precision; pass allow_lossy=True"
    assert message_words(outer) == "layerwise casting: casting to fp8 loses precision; pass --allow-lossy"
    assert parts_of(KeyError("w")) == ("'w'",)  # another library's error: its text


def test_a_warning_is_made_of_parts_too() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(ShardkitWarning("out/ exists: the real run needs ", Option("overwrite", True)), stacklevel=1)
    [record] = caught
    assert record.category is ShardkitWarning and str(record.message) == "out/ exists: the real run needs overwrite=True"
    assert isinstance(record.message, ShardkitWarning)
    assert message_words(record.message) == "out/ exists: the real run needs --overwrite"


def test_the_parts_join_to_the_text() -> None:
    parts = ("give ", Option("dtype", "bf16", choices=("fp16",)), " or drop ", Option("to"))
    assert join_parts(parts) == str(ShardkitError(*parts)) == "give dtype='bf16' or 'fp16' or drop to=..."
    assert message_words(ShardkitError(*parts)) == "give --dtype bf16 or fp16 or drop --to"


def test_the_cli_names_the_flags_of_a_real_refusal(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """One with choices: a ggml type asked of split is refused naming convert's ``--to gguf`` and the choices."""
    import torch

    src = tmp_path / "src"
    shardkit.save_sharded({"w": torch.zeros(8)}, src)
    with pytest.raises(InvalidInputError, match=r"quantize='fp8-block', 'fp8-channel', 'fp8-tensor', 'nvfp4' or 'mxfp4'"):
        shardkit.split(src, tmp_path / "out", quantize="q8_0")
    result = run_cli("split", str(src), str(tmp_path / "out"), "--quantize", "q8_0")
    assert result.exit_code == 2, result.stderr
    assert ("error: --quantize q8_0 is a GGUF type, which only convert writes, with --to gguf and an OUTPUT ending in "
            ".gguf (safetensors outputs take --quantize fp8-block, fp8-channel, fp8-tensor, nvfp4 or mxfp4)"
            in result.stderr), result.stderr


def test_the_cli_help_names_flags_from_the_field_help(run_cli: Callable[..., CliResult]) -> None:
    from shardkit.sharding.options import WriteOptions

    manifest = next(f for f in WriteOptions.__dataclass_fields__.values() if f.name == "manifest")
    assert "manifest=False skips" in manifest.metadata["help"]  # the docs' table reads the Python text
    result = run_cli("split", "--help")
    assert "--no-manifest skips" in " ".join(result.stdout.split()), result.stdout
