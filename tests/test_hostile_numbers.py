"""Hostile numbers (issue 30): sizes, counts and shapes from configs and headers are bounded before
anything is allocated or built, and every parse error is one line naming the file and the field.

Each case runs the real CLI under a wall-clock limit and measures its peak RSS (< 1 GiB).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import helpers_boundary as b
import helpers_reliability as h
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> Path:
    """A safetensors file written byte by byte (any dtype, any shape, any data)."""
    header, data, offset = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _fp8(folder: Path, *, qconfig: object, scale: tuple[str, list[int], bytes] | None = None) -> Path:
    """A FineGrainedFP8 checkpoint: one 256×256 fp8 weight with 128×128 float32 block scales."""
    one = struct.pack("<f", 1.0)
    tensors = {"l.weight": ("F8_E4M3", [256, 256], b"\x38" * 65536),
               "l.weight_scale_inv": scale or ("F32", [2, 2], one * 4)}
    _raw(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({"quantization_config": qconfig}))
    return folder


def _fine(block: object) -> dict:
    return {"quant_method": "fp8", "weight_block_size": block}


BLOCKS = {
    "a-billion-rows": ([1_000_000_000, 128], "weight_block_size"),  # before: > 6 GB in 3.6 s
    "two-million-columns": ([128, 2_000_000], "weight_block_size"),  # before: 2.2 GB, rc 0
    "zero": ([0, 128], "weight_block_size"),  # before: ZeroDivisionError
    "not-an-integer": ([1.5, 128], "weight_block_size"),
    "a-string": (["128", 128], "weight_block_size"),
    "booleans": ([True, True], "weight_block_size"),
    "three-numbers": ([128, 128, 128], "weight_block_size"),
}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_hostile_block_sizes_are_refused_before_dequantizing(case: str, tmp_path: Path) -> None:
    block, field = BLOCKS[case]
    src = _fp8(tmp_path / "src", qconfig=_fine(block), scale=("F32", [1, 2], struct.pack("<f", 1.0) * 2))
    line = b.assert_refused(b.run_bounded("split", src, tmp_path / "out", "--dtype", "bf16", "-q"),
                            contains=field)
    assert "config.json" in line
    assert not (tmp_path / "out").exists()


def test_a_block_larger_than_its_weight_covers_the_weight(tmp_path: Path) -> None:
    """A valid but oversized block (65536 rows over 256) is the weight's own size: no allocation grows."""
    from safetensors.torch import load_file

    src = _fp8(tmp_path / "src", qconfig=_fine([65536, 128]), scale=("F32", [1, 2], struct.pack("<f", 2.0) * 2))
    run = b.run_bounded("split", src, tmp_path / "out", "--dtype", "bf16", "-q")
    assert run.returncode == 0, run.stderr
    assert run.peak_rss_bytes < b.MAX_RSS_BYTES
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out["l.weight"].shape == (256, 256) and float(out["l.weight"][0, 0]) == 2.0


SCALES = {
    "zero-by-zero": (("F32", [0, 0], b""), "fits no"),  # before: ZeroDivisionError
    "integer": (("I32", [2, 2], b"\x01\x00\x00\x00" * 4), "scales are"),
    "boolean": (("BOOL", [2, 2], b"\x01" * 4), "scales are"),
    "nan": (("F32", [2, 2], struct.pack("<f", math.nan) * 4), "nan"),
    "inf": (("F32", [2, 2], struct.pack("<f", math.inf) * 4), "infinite"),
}


@pytest.mark.parametrize("case", list(SCALES))
def test_hostile_scales_are_refused(case: str, tmp_path: Path) -> None:
    """Before: a 0×0 scale ended in ZeroDivisionError; NaN/inf, integer and bool scales were accepted silently."""
    scale, expect = SCALES[case]
    src = _fp8(tmp_path / "src", qconfig=_fine([128, 128]), scale=scale)
    line = b.assert_refused(b.run_bounded("split", src, tmp_path / "out", "--dtype", "bf16", "-q"), contains=expect)
    assert "weight_scale_inv" in line
    assert not (tmp_path / "out").exists()


def test_a_list_quantization_config_is_named(tmp_path: Path) -> None:
    """Before: a generic ValueError line naming no file."""
    src = _fp8(tmp_path / "src", qconfig=[["quant_method", "fp8"]])
    line = b.assert_refused(b.run_bounded("split", src, tmp_path / "out", "-q"), contains="quantization_config")
    assert "config.json" in line


def test_a_zero_element_tensor_with_a_dimension_past_64_bits_is_refused(tmp_path: Path) -> None:
    """The reference ``safe_open`` refuses it; before, every shardkit command accepted it."""
    from safetensors import safe_open

    path = _raw(tmp_path / "ckpt" / "model.safetensors", {"w": ("F32", [0, 2**64], b""), "x": ("U8", [1], b"\0")})
    with pytest.raises(Exception):  # noqa: B017, PT011 - the control: the reference reader refuses it
        safe_open(str(path), framework="pt")
    for args, code in ((["info", path], 2), (["split", path, tmp_path / "out", "-q"], 2), (["verify", path], 1)):
        b.assert_refused(b.run_bounded(*args), code=code, contains="2^63")
    assert not (tmp_path / "out").exists()
    import shardkit
    from shardkit.errors import HeaderError

    with pytest.raises(HeaderError, match="2\\^63"):
        shardkit.open(path)


@pytest.mark.parametrize("shape", [[2**64 - 1, 0], [0, 2**63], [2**63, 0, 5]])
def test_a_zero_element_shape_with_a_dimension_past_63_bits_is_refused(shape: list[int], tmp_path: Path) -> None:
    """Issue 41: every dimension below 2^63 whatever the product. Before, [2**64-1, 0] passed info and verify
    (the reference reader takes it: its sizes are unsigned), then ``shardkit.open(...)[name]`` raised a raw
    TypeError from torch, whose sizes are signed 64-bit."""
    path = _raw(tmp_path / "ckpt" / "model.safetensors", {"w": ("F32", shape, b""), "x": ("U8", [1], b"\0")})
    for args, code in ((["info", path], 2), (["split", path, tmp_path / "out", "-q"], 2), (["verify", path], 1)):
        b.assert_refused(b.run_bounded(*args), code=code, contains="2^63")
    assert not (tmp_path / "out").exists()
    import shardkit
    from shardkit.errors import HeaderError

    with pytest.raises(HeaderError, match="2\\^63"):
        shardkit.open(path)
    with pytest.raises(HeaderError, match="2\\^63"):
        shardkit.info(path)


def _manifested(tmp_path: Path) -> Path:
    import shardkit

    src = h.write_checkpoint(tmp_path / "src", h.make_tensors(4, total_bytes=4000))
    shardkit.split(src, tmp_path / "ckpt", max_shard_size="2KB")
    return tmp_path / "ckpt"


MANIFESTS = {
    "size-1e400": lambda doc: _first(doc).update(size_bytes=1e400),  # before: OverflowError
    "deep-nesting": None,  # before: RecursionError
    "size-5000-digits": None,
}


def _first(doc: dict) -> dict:
    return next(iter(doc["files"].values()))


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_hostile_manifest_numbers_are_one_finding_naming_the_manifest(case: str, tmp_path: Path) -> None:
    folder = _manifested(tmp_path)
    path = folder / "shardkit.manifest.json"
    if case == "deep-nesting":
        path.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "size-5000-digits":
        text = path.read_text()
        path.write_text(text.replace('"size_bytes":', '"size_bytes":' + "9" * 5000 + ', "x":', 1))
    else:
        doc = json.loads(path.read_text())
        MANIFESTS[case](doc)  # type: ignore[misc]
        path.write_text(json.dumps(doc).replace("Infinity", "1e400"))
    run = b.run_bounded("verify", folder)
    b.assert_refused(run, code=1)
    assert "shardkit.manifest.json" in run.stdout + run.stderr
    assert "Error" not in run.stdout.replace("ManifestError", "")


def test_an_index_total_size_of_5000_digits_names_the_index(tmp_path: Path) -> None:
    folder = _manifested(tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size":', '"total_size": ' + "9" * 5000 + ', "x":', 1))
    for command, code in (("verify", 1), ("info", 2)):
        run = b.run_bounded(command, folder)
        b.assert_refused(run, code=code)
        assert "model.safetensors.index.json" in run.stdout + run.stderr


@pytest.fixture(scope="module")
def unet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import tiny_unet

    folder = tmp_path_factory.mktemp("unet") / "unet"
    tiny_unet().save_pretrained(str(folder))
    return folder


CONFIGS = {
    "layers-per-block-1e7": ({"layers_per_block": 10**7}, "layers_per_block"),
    "100k-block-types": ({"down_block_types": ["DownBlock2D"] * 100_000, "up_block_types": ["UpBlock2D"] * 100_000,
                          "block_out_channels": [32] * 100_000, "only_cross_attention": False,
                          "attention_head_dim": 8}, "block_types"),
    "transformer-layers-list": ({"transformer_layers_per_block": [1, 10**7]}, "transformer_layers_per_block"),
    "infinite-float": ({"norm_eps": 1e400}, "norm_eps"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_hostile_config_counts_are_refused_before_building(case: str, unet_folder: Path, tmp_path: Path) -> None:
    """Before: convert --to single-file built the model from such a config and grew past 2.9 GB."""
    import shutil

    folder = tmp_path / "unet"
    shutil.copytree(unet_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    changes, field = CONFIGS[case]
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config).replace("Infinity", "1e400"))
    env = {**h.clean_env(), "HF_HUB_OFFLINE": "1"}
    line = b.assert_refused(b.run_bounded("convert", folder, tmp_path / "model.safetensors", "--to", "single-file",
                                          env=env), contains=field)
    assert "config.json" in line
    if case == "layers-per-block-1e7":  # plan builds the skeleton from the same config
        b.assert_refused(b.run_bounded("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB",
                                       env=env), contains=field)
    assert not (tmp_path / "model.safetensors").exists()


_JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                     | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                     max_leaves=20)
_KEYS = st.sampled_from(["layers_per_block", "num_hidden_layers", "down_block_types", "weight_block_size",
                         "quantization_config", "block_out_channels", "depth", "quant_method", "hidden_size"])


@settings(max_examples=200, deadline=None)
@given(config=st.dictionaries(_KEYS, _JSON, max_size=5), qconfig=st.dictionaries(_KEYS, _JSON, max_size=3))
def test_fuzzed_configs_end_in_one_shardkit_error_or_pass(config: dict, qconfig: dict) -> None:
    """Any config: the bound checks and the layout finder either accept it or raise one InvalidInputError."""
    from shardkit.errors import InvalidInputError
    from shardkit.formats.header import TensorEntry
    from shardkit.formats.layout import check_config_numbers
    from shardkit.layouts.fp8 import find_layout

    entries = [TensorEntry("l.weight", "F8_E4M3", (256, 256), 65536),
               TensorEntry("l.weight_scale_inv", "F32", (2, 2), 16)]
    for doc in (config, {**config, "quantization_config": qconfig}):
        try:
            check_config_numbers(doc, where="config.json")
        except InvalidInputError as e:
            assert "\n" not in str(e) and "config.json" in str(e)
        try:
            find_layout(entries, config=doc, where="ckpt")
        except InvalidInputError as e:
            assert "\n" not in str(e) and "ckpt" in str(e)
