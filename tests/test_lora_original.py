"""A LoRA pair placed on rows of a fused base tensor (``plan_merge(placements=...)``, ``LowRank.row0``): merged band
by band equal to the product added to those rows whole, whatever the band and placement boundaries, swapped halves
included; the Flux placements traced from diffusers' conversion (Flux.1's width, shapes only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardkit.errors import InvalidInputError
from shardkit.formats.header import TensorEntry
from shardkit.layouts.adapters import peft_keys
from shardkit.sharding import lora
from shardkit.sharding.lora_adapter import Adapter
from shardkit.sharding.lora_original import FLUX_WIDTH, Placement, original_placements
from shardkit.sources import open_source

ROWS, COLS, RANK = 8, 16, 2


def adapter(modules: list[tuple[str, int]], generator: torch.Generator) -> Adapter:
    tensors = {}
    for module, rows in modules:
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, COLS, generator=generator)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator)
    return Adapter("a", {"r": RANK, "lora_alpha": 4}, tensors, peft_keys(tensors, where="a"))


@pytest.mark.parametrize("band_rows, whole", [(3, True), (3, False), (5, False), (64, True)])
def test_placed_pairs_add_to_their_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, band_rows: int,
                                        whole: bool) -> None:
    """q, k, v on thirds of ``qkv``; ``norm`` on ``ada`` with its halves swapped (diffusers' scale, shift)."""
    monkeypatch.setattr(lora, "BAND_BYTES", band_rows * COLS * 4)
    monkeypatch.setattr(lora, "WHOLE_DELTA_BYTES", 2**30 if whole else 0)
    g = torch.Generator().manual_seed(0)
    base = {"qkv.weight": torch.randn(3 * ROWS, COLS, generator=g), "ada.weight": torch.randn(2 * ROWS, COLS, generator=g),
            "other.weight": torch.randn(ROWS, COLS, generator=g)}
    save_file(base, tmp_path / "base.safetensors")
    made = adapter([("q", ROWS), ("k", ROWS), ("v", ROWS), ("norm", 2 * ROWS)], g)
    placements = {f"{m}.weight": (Placement("qkv.weight", i * ROWS, 0, ROWS),) for i, m in enumerate("qkv")}
    placements["norm.weight"] = (Placement("ada.weight", ROWS, 0, ROWS), Placement("ada.weight", 0, ROWS, ROWS))
    want = {k: v.clone() for k, v in base.items()}
    for i, m in enumerate("qkv"):
        t = made.tensors
        want["qkv.weight"][i * ROWS:(i + 1) * ROWS] += 2.0 * (t[f"base_model.model.{m}.lora_B.weight"]
                                                            @ t[f"base_model.model.{m}.lora_A.weight"])
    delta = 2.0 * (made.tensors["base_model.model.norm.lora_B.weight"] @ made.tensors["base_model.model.norm.lora_A.weight"])
    want["ada.weight"] += torch.cat([delta[ROWS:], delta[:ROWS]])
    with open_source(str(tmp_path / "base.safetensors")) as src:
        merged = lora.LoraSource(src, [made], placements=placements)
        assert sorted(merged.plan.updates) == ["ada.weight", "qkv.weight"]
        for entry in merged.entries():
            got = torch.frombuffer(bytearray(b"".join(merged.chunks(entry, 1 << 20))), dtype=torch.float32)
            torch.testing.assert_close(got.reshape(entry.shape), want[entry.name], rtol=1e-6, atol=1e-6)
            begin, end = 5 * COLS * 4 + 8, min(entry.nbytes, 13 * COLS * 4)  # rows 5..12, from within a row
            part = torch.frombuffer(bytearray(merged.read(entry, begin, end)), dtype=torch.float32)
            torch.testing.assert_close(part, want[entry.name].reshape(-1)[begin // 4:end // 4], rtol=1e-6, atol=1e-6)


def test_a_pair_that_does_not_fill_its_placement_is_refused(tmp_path: Path) -> None:
    save_file({"qkv.weight": torch.zeros(3 * ROWS, COLS)}, tmp_path / "base.safetensors")
    made = adapter([("q", ROWS + 1)], torch.Generator().manual_seed(0))
    with open_source(str(tmp_path / "base.safetensors")) as src, pytest.raises(InvalidInputError, match="has 9 rows"):
        lora.LoraSource(src, [made], placements={"q.weight": (Placement("qkv.weight", 0, 0, ROWS),)})


def test_flux_placements_are_diffusers_rows_of_the_bfl_tensors() -> None:
    """Traced on shapes only (meta tensors): one double and one single block at Flux.1's width."""
    w, mlp = FLUX_WIDTH, 4 * FLUX_WIDTH
    shapes = {"img_in.weight": (w, 64), "img_in.bias": (w,), "txt_in.weight": (w, 64), "txt_in.bias": (w,),
              "final_layer.linear.weight": (64, w), "final_layer.linear.bias": (64,),
              "final_layer.adaLN_modulation.1.weight": (2 * w, w), "final_layer.adaLN_modulation.1.bias": (2 * w,)}
    for side in ("time_in", "vector_in"):
        shapes.update({f"{side}.in_layer.weight": (w, 256), f"{side}.in_layer.bias": (w,),
                       f"{side}.out_layer.weight": (w, w), f"{side}.out_layer.bias": (w,)})
    for part in ("img", "txt"):
        for name, shape in (("mod.lin", (6 * w, w)), ("attn.qkv", (3 * w, w)), ("attn.proj", (w, w)),
                            ("mlp.0", (mlp, w)), ("mlp.2", (w, mlp))):
            shapes[f"double_blocks.0.{part}_{name}.weight"], shapes[f"double_blocks.0.{part}_{name}.bias"] = \
                shape, shape[:1]
        for norm in ("query", "key"):
            shapes[f"double_blocks.0.{part}_attn.norm.{norm}_norm.scale"] = (128,)
    for name, shape in (("linear1", (3 * w + mlp, w)), ("linear2", (w, w + mlp)), ("modulation.lin", (3 * w, w))):
        shapes[f"single_blocks.0.{name}.weight"], shapes[f"single_blocks.0.{name}.bias"] = shape, shape[:1]
    shapes.update({"single_blocks.0.norm.query_norm.scale": (128,), "single_blocks.0.norm.key_norm.scale": (128,)})
    entries = [TensorEntry(n, "BF16", s, 2 * torch.Size(s).numel()) for n, s in shapes.items()]
    placed = original_placements(entries, where="flux")
    assert placed["transformer_blocks.0.attn.to_k.weight"] == (Placement("double_blocks.0.img_attn.qkv.weight", w, 0, w),)
    assert placed["transformer_blocks.0.attn.add_v_proj.weight"] == (
        Placement("double_blocks.0.txt_attn.qkv.weight", 2 * w, 0, w),)
    assert placed["single_transformer_blocks.0.proj_mlp.weight"] == (
        Placement("single_blocks.0.linear1.weight", 3 * w, 0, mlp),)
    assert set(placed["norm_out.linear.weight"]) == {Placement("final_layer.adaLN_modulation.1.weight", 0, w, w),
                                                     Placement("final_layer.adaLN_modulation.1.weight", w, 0, w)}
    assert placed["x_embedder.weight"] == (Placement("img_in.weight", 0, 0, w),)
    comfy = [TensorEntry("model.diffusion_model." + e.name, e.dtype, e.shape, e.nbytes) for e in entries]
    assert original_placements(comfy, where="comfy")["single_transformer_blocks.0.attn.to_v.weight"] == (
        Placement("model.diffusion_model.single_blocks.0.linear1.weight", 2 * w, 0, w),)  # ComfyUI's names kept
    with pytest.raises(InvalidInputError, match="of width 32"):
        original_placements([TensorEntry("img_in.weight", "BF16", (32, 64), 4096),
                             TensorEntry("double_blocks.0.img_attn.qkv.weight", "BF16", (96, 32), 6144)], where="tiny")
