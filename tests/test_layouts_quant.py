"""layouts/quant.py: every quantized layout of the registry is read and written through one interface.

Each quantized strategy writes a weight band by band (as :class:`~shardkit.sources.quantized.QuantizedSource`
does), the reader's own recognition finds the layout written, and the registry's dequantizer for it gives
the weight back (as :class:`~shardkit.sources.dequantized.DequantizedSource` and the runtime do).
"""

from __future__ import annotations

import pytest
import torch

import shardkit.layouts.fp4_math as fp4_math
import shardkit.layouts.fp8_math as fp8_math
from shardkit.errors import InvalidInputError
from shardkit.formats.header import TensorEntry
from shardkit.layouts import registry
from shardkit.layouts.fp8_math import state_dict_entries, tensor_from_bytes
from shardkit.layouts.quant import (
    QuantizedTable,
    QuantStrategy,
    TensorsReader,
    band_bytes,
    dense_tensor,
    quantized_table,
)

QUANTIZED = ("fp8-tensor", "fp8-channel", "fp8-block", "nvfp4", "mxfp4")
CLOSE = {"fp8-tensor": 0.08, "fp8-channel": 0.08, "fp8-block": 0.08, "nvfp4": 0.2, "mxfp4": 0.25}  # relative error


def _plain(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small bf16 model: linear weights (NVFP4, fp8), gpt-oss experts (MXFP4), a norm and an embedding (kept)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (64, 256), "model.layers.0.input_layernorm.weight": (256,),
              "model.layers.0.self_attn.q_proj.weight": (256, 256), "model.layers.0.mlp.up_proj.weight": (384, 256),
              "model.layers.0.mlp.experts.gate_up_proj": (2, 64, 96), "model.layers.0.mlp.experts.down_proj": (2, 96, 64)}
    return {name: (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16) for name, shape in shapes.items()}


def _quantize(strategy: QuantStrategy, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                                     QuantizedTable]:
    """``tensors`` as ``strategy`` writes them, band by band through the interface."""
    reader = TensorsReader(tensors.__getitem__)
    table = quantized_table(strategy, state_dict_entries(tensors))
    out = {e.name: tensors[e.name] for e in table.entries if e.name in tensors}
    for target in table.targets:
        prepared = strategy.prepare(reader, target)
        bands = [strategy.quantize_band(band, target, prepared) for band in strategy.source_bands(reader, target)]
        raw = [b"".join(bytes(band_bytes(q)) for q, _ in bands),
               *strategy.side_bytes(target, [scale for _, scale in bands], prepared)]
        for entry, data in zip(target.written, raw, strict=True):
            assert len(data) == entry.nbytes, entry.name
            out[entry.name] = tensor_from_bytes(data, entry.dtype, entry.shape)
    return out, table


def test_the_quantized_layouts_are_the_registrys_quant_strategies() -> None:
    assert {layout.name for layout in registry.LAYOUTS if isinstance(layout.strategy, QuantStrategy)} == set(QUANTIZED)
    for name in QUANTIZED:
        found: object = registry.quant_strategy(name)
        assert found is registry.registered(name).strategy
    with pytest.raises(InvalidInputError, match="quantize='peft-lora': expected one of fp8-tensor.*mxfp4"):
        registry.quant_strategy("peft-lora")


@pytest.mark.parametrize("name", QUANTIZED)
def test_what_a_strategy_writes_its_reader_finds_and_gives_back(name: str) -> None:
    strategy = registry.quant_strategy(name)
    plain = _plain()
    written, table = _quantize(strategy, plain)
    assert table.targets and "model.embed_tokens" in table.kept
    entries = state_dict_entries(written)
    layout = registry.find_quant_layout(entries, config={"quantization_config": strategy.quantization_config(table.kept)},
                                        where=name)
    assert layout is not None and not getattr(layout, "problems", ())
    weights = registry.dequantizer(layout, entries)
    assert sorted(w.name for w in weights.weights()) == sorted(t.source.name for t in table.targets)
    reader = TensorsReader(written.__getitem__)
    for weight in weights.weights():
        want = plain[weight.name].float()
        got = dense_tensor(weights, reader, weight, torch.float32)
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < CLOSE[name], weight.name


@pytest.mark.parametrize("name", ["fp8-block", "fp8-channel", "nvfp4", "mxfp4"])
def test_bands_from_an_offset_are_the_tail_of_all_bands(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranged read starts at the band holding its first byte: the same values as the whole tensor's bands."""
    monkeypatch.setattr(fp8_math, "BAND_BYTES", 128 * 256 * 4)  # 128 rows of 256 columns a band
    monkeypatch.setattr(fp4_math, "BAND_BYTES", 4096)  # a few rows / groups of 32 a band
    strategy = registry.quant_strategy(name)
    written, _ = _quantize(strategy, _plain())
    entries = state_dict_entries(written)
    layout = registry.find_quant_layout(entries, config={"quantization_config": strategy.quantization_config([])})
    assert layout is not None
    weights = registry.dequantizer(layout, entries)
    reader = TensorsReader(written.__getitem__)
    for weight in weights.weights():
        whole = dense_tensor(weights, reader, weight, torch.bfloat16).reshape(-1)
        bands = list(weights.dense_bands(reader, weight, torch.bfloat16))
        assert len(bands) > 1, weight.name
        first = whole.numel() * 2 // 3
        tail = list(weights.dense_bands(reader, weight, torch.bfloat16, first=first))
        assert 0 < len(tail) < len(bands) and tail[0][0] <= first
        for offset, band in tail:
            assert torch.equal(whole[offset:offset + band.numel()], band.reshape(-1)), (weight.name, offset)


def test_a_layout_no_strategy_reads_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = registry.quant_strategy("mxfp4")
    written, _ = _quantize(strategy, _plain())
    entries = state_dict_entries(written)
    layout = registry.find_quant_layout(entries, config={"quantization_config": strategy.quantization_config([])})
    assert layout is not None
    monkeypatch.setattr(registry, "LAYOUTS", tuple(entry for entry in registry.LAYOUTS if entry.name != "mxfp4"))
    with pytest.raises(InvalidInputError, match="gpt-oss MXFP4: no layout of the registry reads it"):
        registry.dequantizer(layout, entries)


def test_a_plain_table_is_written_as_it_is() -> None:
    entry = TensorEntry("model.norm.weight", "BF16", (8,), 16)
    for name in QUANTIZED:
        table = quantized_table(registry.quant_strategy(name), [entry])
        assert table == QuantizedTable((entry,), (), ())


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_band_a_strategy_quantizes_is_within_the_band_bound_and_the_bytes_are_the_whole_tensors(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The band size bounds the float32 temporaries of quantizing (MXFP4 too: rows of one expert, not the whole
    expert), and cutting a weight into bands changes no byte written."""
    strategy = registry.quant_strategy(name)
    monkeypatch.setattr(fp8_math, "BAND_BYTES", 2**40)
    monkeypatch.setattr(fp4_math, "BAND_BYTES", 2**40)
    whole, _ = _quantize(strategy, _plain())
    bound = 128 * 256 * 4 if name.startswith("fp8") else 4096  # fp8: one 128-row block of 256 columns a band
    monkeypatch.setattr(fp8_math, "BAND_BYTES", 128 * 256 * 4)
    monkeypatch.setattr(fp4_math, "BAND_BYTES", 4096)
    plain = _plain()
    reader = TensorsReader(plain.__getitem__)
    for target in quantized_table(strategy, state_dict_entries(plain)).targets:
        bands = list(strategy.source_bands(reader, target))
        assert len(bands) > 1 and max(b.numel() * 4 for b in bands) <= bound, (target.source.name, [b.shape for b in bands])
    banded, _ = _quantize(strategy, plain)
    assert banded.keys() == whole.keys()
    for key, tensor in whole.items():
        assert torch.equal(banded[key].view(torch.uint8), tensor.view(torch.uint8)), key
