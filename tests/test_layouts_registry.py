"""layouts/registry.py: every layout shardkit maps is listed once, and each one round-trips on its sample.

A layout is a strategy (sample, forward, inverse) in its own module under ``shardkit/layouts/`` and one
entry of ``LAYOUTS``: the tests below run every entry forward and back, refuse a layout module whose
strategy is not listed, and add a new layout from one module and one entry.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import shardkit.layouts
from shardkit.errors import InvalidInputError
from shardkit.formats.header import TensorEntry
from shardkit.layouts import registry
from shardkit.layouts.fp8_quantize import QUANTIZE_RECIPES
from shardkit.layouts.table import LayoutStrategy, Mapped, round_trip_problems

EXPECTED = {"fp8-tensor", "fp8-channel", "fp8-block", "nvfp4", "mxfp4", "peft-lora", "gguf-llama", "single-file-sd-unet",
            "single-file-sdxl-unet", "single-file-vae", "single-file-clip", "single-file-openclip", "single-file-sd3",
            "single-file-flux"}


def test_the_registry_lists_every_supported_layout_once() -> None:
    names = [layout.name for layout in registry.LAYOUTS]
    assert len(names) == len(set(names))
    assert set(names) == EXPECTED
    assert registry.registered("nvfp4").strategy is registry.LAYOUTS[names.index("nvfp4")].strategy
    with pytest.raises(InvalidInputError, match="no layout 'nvfp8'.*fp8-block"):
        registry.registered("nvfp8")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_layout_round_trips_on_its_table(name: str) -> None:
    """Forward changes the sample (names, dtypes or shapes), and the inverse gives every tensor back exactly."""
    strategy = registry.registered(name).strategy
    plain = strategy.sample()
    stored = strategy.forward(plain)
    assert stored.table() != plain.table()
    assert round_trip_problems(strategy) == []
    assert strategy.inverse(stored).table() == plain.table()


def test_the_quantized_layouts_are_what_their_readers_recognise() -> None:
    """The inverse of each quantized layout is the reader's own recognition (find_quant_layout), not a copy of it."""
    for name in ("fp8-tensor", "fp8-channel", "fp8-block", "nvfp4", "mxfp4"):
        strategy = registry.registered(name).strategy
        stored = strategy.forward(strategy.sample())
        found = registry.find_quant_layout(stored.entries, config=stored.config, where=name)
        assert found is not None and not getattr(found, "problems", ()), name
        assert found.extra and found.extra <= {e.name for e in stored.entries}


def test_a_broken_mapping_is_caught_by_the_round_trip() -> None:
    """A recipe naming its scales as no reader does loses its weights on the way back: the check can fail."""
    broken = dataclasses.replace(QUANTIZE_RECIPES["fp8-block"], scale_suffix=".weight_factor")
    problems = round_trip_problems(broken)
    assert any("became" in p for p in problems) and any("made on the way back" in p for p in problems), problems
    identity = _Renaming("model.", "model.")
    assert round_trip_problems(identity) == ["forward leaves the sample as it is: the layout maps nothing"]


def test_a_fused_tensor_put_together_in_the_wrong_order_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """q and k swapped in SD3's qkv keep every name and shape: the round trip still refuses it (diffusers' order)."""
    from shardkit.layouts import single_file

    layout = single_file.LAYOUTS["sd3"]

    def swapped(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> Callable[[str], Any]:
        name_of = layout.namer(shapes, config)

        def swapped_name_of(name: str) -> tuple[str, int] | None:
            found = name_of(name)
            return (found[0], 1 - found[1]) if found and (".to_q." in name or ".to_k." in name) else found

        return swapped_name_of

    monkeypatch.setitem(single_file.LAYOUTS, "sd3", dataclasses.replace(layout, namer=swapped))
    problems = round_trip_problems(registry.registered("single-file-sd3").strategy)
    assert len(problems) == 1 and "attn.qkv.weight: diffusers fills it from" in problems[0], problems


def _strategy_classes() -> dict[str, type]:
    """Every class in shardkit/layouts/ that is a layout strategy (sample, forward and inverse)."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(shardkit.layouts.__path__):
        module = importlib.import_module(f"shardkit.layouts.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and cls is not LayoutStrategy and all(
                    callable(getattr(cls, m, None)) for m in ("sample", "forward", "inverse")):
                found[f"{module.__name__}.{name}"] = cls
    return found


def test_every_layout_strategy_is_registered_and_lives_in_layouts() -> None:
    """A layout module whose strategy has no entry, or an entry whose strategy lives elsewhere, fails here."""
    classes = _strategy_classes()
    assert len(classes) >= 4, classes  # fp8, fp4, GGUF names, single-file families
    registered_types = {type(layout.strategy) for layout in registry.LAYOUTS}
    assert [name for name, cls in classes.items() if cls not in registered_types] == []
    assert all(cls.__module__.startswith("shardkit.layouts.") for cls in registered_types)


@dataclasses.dataclass(frozen=True)
class _Renaming:
    """A toy layout for the checks above: one prefix renamed to another."""

    old: str
    new: str

    def sample(self) -> Mapped:
        return Mapped((TensorEntry("model.a.weight", "F32", (2, 2), 16), TensorEntry("model.b.bias", "F32", (2,), 8)))

    def forward(self, plain: Mapped) -> Mapped:
        return Mapped(tuple(dataclasses.replace(e, name=self.new + e.name.removeprefix(self.old)) for e in plain.entries))

    def inverse(self, stored: Mapped) -> Mapped:
        return Mapped(tuple(dataclasses.replace(e, name=self.old + e.name.removeprefix(self.new))
                            for e in stored.entries))


NEW_LAYOUT = '''
from __future__ import annotations

from dataclasses import dataclass, replace

from shardkit.formats.header import TensorEntry
from shardkit.layouts.table import Mapped


@dataclass(frozen=True)
class TransformerPrefix:
    """Megatron-style names: ``model.`` becomes ``transformer.``."""

    def sample(self) -> Mapped:
        return Mapped((TensorEntry("model.layers.0.mlp.up_proj.weight", "BF16", (8, 4), 64),))

    def forward(self, plain: Mapped) -> Mapped:
        return Mapped(tuple(replace(e, name="transformer." + e.name.removeprefix("model.")) for e in plain.entries))

    def inverse(self, stored: Mapped) -> Mapped:
        return Mapped(tuple(replace(e, name="model." + e.name.removeprefix("transformer.")) for e in stored.entries))
'''


def test_a_new_layout_is_one_module_and_one_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout written as one module, listed by one entry, is found and checked like the built-in ones."""
    (tmp_path / "toy_layout.py").write_text(NEW_LAYOUT)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_layout")
    try:
        entry = registry.RegisteredLayout("megatron-prefix", "model. → transformer.", module.TransformerPrefix())
        monkeypatch.setattr(registry, "LAYOUTS", (*registry.LAYOUTS, entry))
        assert registry.registered("megatron-prefix") is entry
        assert round_trip_problems(registry.registered("megatron-prefix").strategy) == []
        assert {layout.name for layout in registry.LAYOUTS} == EXPECTED | {"megatron-prefix"}
    finally:
        sys.modules.pop("toy_layout", None)


def test_importing_the_registry_imports_no_torch_diffusers_or_transformers() -> None:
    """``import shardkit`` stays instant: the single-file samples import diffusers only when asked for."""
    import subprocess

    code = ("import sys, shardkit.layouts.registry; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
