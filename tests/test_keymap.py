"""Key selection and renaming: KeyMap (pure), KeyMapSource over real sources, and the CLI options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_bit_equal, assert_one_line_error, leftovers, load_folder, tensor_bytes
from safetensors.torch import save_file

from shardkit.errors import InvalidInputError
from shardkit.sources import open_source
from shardkit.sources.keymap import KeyMap, KeyMapSource, parse_renames
from shardkit.sources.memory import MemorySource


def sd_ckpt_like() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.diffusion_model.conv_in.weight": torch.randn(4, 3, generator=g),
        "model.diffusion_model.out.bias": torch.randn(5, generator=g),
        "first_stage_model.decoder.w": torch.randn(2, 2, generator=g),
        "cond_stage_model.transformer.text_model.emb": torch.randn(6, generator=g),
        "model_ema.decay": torch.tensor(0.9999),
    }


# ----------------------------------------------------------------------------- the name function

def test_map_applies_filters_strip_rename_add_in_order() -> None:
    km = KeyMap(include=("model.*",), exclude=("*.bias",), strip_prefix="model.diffusion_model.",
                rename=(("conv_in.", "input."),), add_prefix="unet.")
    assert km.map("model.diffusion_model.conv_in.weight") == "unet.input.weight"
    assert km.map("model.diffusion_model.out.bias") is None          # excluded
    assert km.map("first_stage_model.decoder.w") is None             # not included
    assert km.map("model.other.w") is None                           # no strip prefix


def test_first_matching_rename_wins_and_renames_do_not_chain() -> None:
    km = KeyMap(rename=(("a.", "b."), ("b.", "c.")))
    assert km.map("a.x") == "b.x"
    assert km.map("b.x") == "c.x"
    assert km.map("exact") == "exact"
    assert KeyMap(rename=(("exact", "renamed"),)).map("exact") == "renamed"


def test_parse_renames() -> None:
    assert parse_renames(["text_model.=model.", "a=b=c"]) == (("text_model.", "model."), ("a", "b=c"))
    assert parse_renames(["drop.="]) == (("drop.", ""),)
    for bad in ("noequals", "=new"):
        with pytest.raises(InvalidInputError, match="OLD=NEW"):
            parse_renames([bad])


# ----------------------------------------------------------------------------- the source wrapper

def test_wrapper_keeps_bytes_and_file_offsets(tmp_path: Path) -> None:
    sd = sd_ckpt_like()
    path = tmp_path / "m.safetensors"
    save_file(sd, str(path))
    with open_source(str(path)) as inner:
        src = KeyMapSource(inner, KeyMap(strip_prefix="model.diffusion_model."))
        entries = src.entries()
        assert sorted(e.name for e in entries) == ["conv_in.weight", "out.bias"]
        assert all(e.file == str(path) for e in entries)  # still copyable kernel-side
        for e in entries:
            assert bytes(src.read(e, 0, e.nbytes)) == tensor_bytes(sd["model.diffusion_model." + e.name])
        assert src.dropped == 3


def test_collision_is_an_error_naming_both() -> None:
    inner = MemorySource({"a.w": torch.zeros(2), "b.w": torch.ones(2)})
    with pytest.raises(InvalidInputError, match=r"'a\.w' and 'b\.w' would both be named 'w'"):
        KeyMapSource(inner, KeyMap(rename=(("a.", ""), ("b.", ""))))


def test_prefix_that_matches_nothing_is_an_error_with_examples() -> None:
    inner = MemorySource(sd_ckpt_like())
    with pytest.raises(InvalidInputError, match="strip_prefix='unet.' matches no tensor name") as e:
        KeyMapSource(inner, KeyMap(strip_prefix="unet."))
    assert "model.diffusion_model.conv_in.weight" in str(e.value)


def test_rename_that_matches_nothing_is_an_error() -> None:
    inner = MemorySource(sd_ckpt_like())
    with pytest.raises(InvalidInputError, match=r"rename=\['nope.=x.'\] matches no tensor name"):
        KeyMapSource(inner, KeyMap(rename=(("nope.", "x."),)))


def test_filters_that_leave_nothing_are_an_error() -> None:
    inner = MemorySource(sd_ckpt_like())
    with pytest.raises(InvalidInputError, match="leave no tensors"):
        KeyMapSource(inner, KeyMap(include=("vae.*",)))
    with pytest.raises(InvalidInputError, match="leave no tensors"):
        KeyMapSource(inner, KeyMap(exclude=("*",)))


def test_aliases_and_alias_metadata_follow_renames() -> None:
    shared = torch.randn(4)
    inner = MemorySource({"enc.emb": shared, "head.w": shared, "enc.x": torch.ones(1)})
    assert inner.aliases() == {"head.w": "enc.emb"}
    src = KeyMapSource(inner, KeyMap(rename=(("enc.", "encoder."),)))
    assert src.aliases() == {"head.w": "encoder.emb"}
    dropped = KeyMapSource(inner, KeyMap(exclude=("head.*",)))
    assert dropped.aliases() == {}


# ----------------------------------------------------------------------------- through the CLI

def test_cli_key_options_end_to_end(tmp_path: Path, run_cli) -> None:
    sd = sd_ckpt_like()
    src = tmp_path / "model.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--exclude", "model_ema.*", "--exclude", "*.bias",
                     "--rename", "model.diffusion_model.=unet.", "--rename", "first_stage_model.=vae.",
                     "--add-prefix", "m.", "--quiet")
    assert result.exit_code == 0, result.stderr
    got = load_folder(out)
    expected = {
        "m.unet.conv_in.weight": sd["model.diffusion_model.conv_in.weight"],
        "m.vae.decoder.w": sd["first_stage_model.decoder.w"],
        "m.cond_stage_model.transformer.text_model.emb": sd["cond_stage_model.transformer.text_model.emb"],
    }
    assert_bit_equal(got, expected)


@pytest.mark.parametrize("args, message", [
    (["--strip-prefix", "nothing."], "matches no tensor name"),
    (["--include", "vae.*"], "leave no tensors"),
    (["--rename", "model.diffusion_model.=", "--rename", "first_stage_model.decoder.=conv_in."],
     "would both be named"),
    (["--rename", "broken"], "expected OLD=NEW"),
])
def test_cli_key_errors_are_one_line_and_write_nothing(tmp_path: Path, run_cli, args, message) -> None:
    sd = sd_ckpt_like()
    sd["first_stage_model.decoder.weight"] = torch.zeros(1)
    src = tmp_path / "model.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", src, out, *args), contains=message)
    assert not out.exists()
    assert leftovers(tmp_path) == []
