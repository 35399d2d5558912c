"""The pure shard planner: greedy in key order, byte limits, the two oversized-tensor rules, naming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import InvalidInputError
from shardkit.formats.index import Naming
from shardkit.sharding.job import resolve_naming
from shardkit.sharding.plan import plan_shards
from shardkit.sources.base import Source


def _groups(plan) -> list[list[str]]:
    return [list(s.names) for s in plan.shards]


def test_greedy_in_key_order() -> None:
    plan = plan_shards([("a", 4), ("b", 4), ("c", 4), ("d", 1)], max_shard_bytes=10)
    assert _groups(plan) == [["a", "b"], ["c", "d"]]
    assert [s.nbytes for s in plan.shards] == [8, 5]
    assert plan.total_bytes == 13
    assert plan.filenames() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                "model.safetensors.index.json"]


def test_oversized_tensor_gets_its_own_shard_and_the_open_shard_keeps_filling() -> None:
    """The default rule is huggingface_hub's: the big tensor's shard is numbered when it is met."""
    plan = plan_shards([("a", 3), ("b", 3), ("huge", 50), ("c", 3), ("d", 3)], max_shard_bytes=10)
    assert _groups(plan) == [["huge"], ["a", "b", "c"], ["d"]]
    assert plan.shards[0].filename == "model-00001-of-00003.safetensors"
    assert plan.shards[0].nbytes == 50
    assert _groups(plan_shards([("a", 6), ("huge", 20), ("b", 3)], max_shard_bytes=10)) == [["huge"], ["a", "b"]]
    # first and last positions too
    assert _groups(plan_shards([("huge", 11), ("a", 1)], max_shard_bytes=10)) == [["huge"], ["a"]]
    assert _groups(plan_shards([("a", 1), ("huge", 11)], max_shard_bytes=10)) == [["huge"], ["a"]]
    assert _groups(plan_shards([("h1", 11), ("h2", 11)], max_shard_bytes=10)) == [["h1"], ["h2"]]
    # a closed shard keeps its number ahead of a later oversized tensor
    assert _groups(plan_shards([("a", 8), ("b", 8), ("huge", 11), ("c", 1)], max_shard_bytes=10)) == \
        [["a"], ["huge"], ["b", "c"]]


def test_sequential_rule_closes_the_open_shard_at_an_oversized_tensor() -> None:
    """File sources: every shard is one run of the key (file) order."""
    plan = plan_shards([("a", 3), ("b", 3), ("huge", 50), ("c", 3), ("d", 3)], max_shard_bytes=10,
                       rule="sequential")
    assert _groups(plan) == [["a", "b"], ["huge"], ["c", "d"]]
    assert plan.shards[1].filename == "model-00002-of-00003.safetensors"
    assert plan.shards[1].nbytes == 50
    for items, expected in [
        ([("huge", 11), ("a", 1)], [["huge"], ["a"]]),
        ([("a", 1), ("huge", 11)], [["a"], ["huge"]]),
        ([("h1", 11), ("h2", 11)], [["h1"], ["h2"]]),
        ([("a", 6), ("huge", 20), ("b", 3)], [["a"], ["huge"], ["b"]]),
    ]:
        assert _groups(plan_shards(items, max_shard_bytes=10, rule="sequential")) == expected


def test_exact_fit() -> None:
    assert _groups(plan_shards([("a", 5), ("b", 5), ("c", 5)], max_shard_bytes=10)) == [["a", "b"], ["c"]]
    assert _groups(plan_shards([("a", 10), ("b", 10)], max_shard_bytes=10)) == [["a"], ["b"]]
    assert _groups(plan_shards([("a", 10), ("b", 1)], max_shard_bytes=11)) == [["a", "b"]]
    assert _groups(plan_shards([("a", 10), ("b", 2)], max_shard_bytes=11)) == [["a"], ["b"]]


def test_one_shard_has_no_suffix_and_no_index() -> None:
    plan = plan_shards([("a", 1), ("b", 2)], max_shard_bytes=10**9)
    assert len(plan.shards) == 1
    assert plan.shards[0].filename == "model.safetensors"
    assert plan.index_filename is None
    assert plan.filenames() == ["model.safetensors"]
    single_huge = plan_shards([("a", 100)], max_shard_bytes=10)
    assert single_huge.shards[0].filename == "model.safetensors" and single_huge.index_filename is None


def test_thousands_of_tiny_tensors() -> None:
    items = [(f"t.{i:05d}", 1) for i in range(10_000)]
    plan = plan_shards(items, max_shard_bytes=1000)
    assert len(plan.shards) == 10
    assert all(s.nbytes == 1000 and len(s.names) == 1000 for s in plan.shards)
    assert plan.shards[-1].filename == "model-00010-of-00010.safetensors"
    weight_map = plan.weight_map()
    assert len(weight_map) == 10_000
    assert weight_map["t.01999"] == "model-00002-of-00010.safetensors"


def test_zero_byte_tensors_are_kept() -> None:
    plan = plan_shards([("empty", 0), ("a", 10), ("empty2", 0), ("b", 1)], max_shard_bytes=10)
    assert _groups(plan) == [["empty", "a", "empty2"], ["b"]]


def test_shard_numbers_are_zero_padded_to_five_digits() -> None:
    plan = plan_shards([(str(i), 1) for i in range(3)], max_shard_bytes=1)
    assert [s.filename for s in plan.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_bad_plans() -> None:
    with pytest.raises(InvalidInputError, match="appears twice"):
        plan_shards([("a", 1), ("a", 1)], max_shard_bytes=10)
    with pytest.raises(InvalidInputError, match="no tensors"):
        plan_shards([], max_shard_bytes=10)
    with pytest.raises(InvalidInputError, match="unknown shard rule 'best_fit'"):
        plan_shards([("a", 1)], max_shard_bytes=10, rule="best_fit")  # type: ignore[arg-type]
    for limit in (0, -1):
        with pytest.raises(InvalidInputError, match="positive"):
            plan_shards([("a", 1)], max_shard_bytes=limit)


@pytest.mark.parametrize("naming, single, first, index", [
    (Naming("diffusion_pytorch_model"), "diffusion_pytorch_model.safetensors",
     "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model.safetensors.index.json"),
    (Naming("model", "fp16"), "model.fp16.safetensors", "model.fp16-00001-of-00002.safetensors",
     "model.safetensors.index.fp16.json"),
    (Naming("diffusion_pytorch_model", "ema"), "diffusion_pytorch_model.ema.safetensors",
     "diffusion_pytorch_model.ema-00001-of-00002.safetensors", "diffusion_pytorch_model.safetensors.index.ema.json"),
    (Naming("custom"), "custom.safetensors", "custom-00001-of-00002.safetensors", "custom.safetensors.index.json"),
])
def test_plan_naming(naming: Naming, single: str, first: str, index: str) -> None:
    one = plan_shards([("a", 1)], max_shard_bytes=10, naming=naming)
    assert one.shards[0].filename == single and one.index_filename is None
    two = plan_shards([("a", 6), ("b", 6)], max_shard_bytes=10, naming=naming)
    assert two.shards[0].filename == first and two.index_filename == index
    assert set(two.weight_map().values()) == {s.filename for s in two.shards}


class _NamedSource(Source):
    def __init__(self, naming: Naming) -> None:
        self.naming = naming

    def entries(self):  # pragma: no cover - not used
        return []

    def read(self, entry, begin, end):  # pragma: no cover - not used
        return b""


def test_resolve_naming_keeps_source_convention_and_lets_name_and_variant_override() -> None:
    diffusers = _NamedSource(Naming("diffusion_pytorch_model", "fp16"))
    assert resolve_naming(diffusers, name=None, variant=None) == Naming("diffusion_pytorch_model", "fp16")
    assert resolve_naming(diffusers, name="model", variant=None) == Naming("model", "fp16")
    assert resolve_naming(diffusers, name=None, variant="bf16") == Naming("diffusion_pytorch_model", "bf16")
    assert resolve_naming(_NamedSource(Naming()), name=None, variant=None) == Naming()
    for bad in ("", "a/b", "model.safetensors", "../x"):
        with pytest.raises(InvalidInputError, match="name="):
            resolve_naming(diffusers, name=bad, variant=None)


# ------------------------------------------------------------------ properties

sizes = st.lists(st.integers(min_value=0, max_value=200), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes, limit=st.integers(min_value=1, max_value=300), rule=st.sampled_from(["huggingface_hub", "sequential"]))
def test_plan_properties(sizes: list[int], limit: int, rule: str) -> None:
    items = [(f"t{i}", n) for i, n in enumerate(sizes)]
    plan = plan_shards(items, max_shard_bytes=limit, rule=rule)  # type: ignore[arg-type]
    placed = [n for s in plan.shards for n in s.names]
    assert sorted(placed) == sorted(name for name, _ in items), "every tensor is placed once"
    by_name = dict(items)
    position = {name: i for i, (name, _) in enumerate(items)}
    for shard in plan.shards:
        assert shard.nbytes == sum(by_name[n] for n in shard.names)
        assert shard.names, "no empty shards"
        assert shard.nbytes <= limit or len(shard.names) == 1
        assert [position[n] for n in shard.names] == sorted(position[n] for n in shard.names)
    # greedy: the first tensor of the next shard within the limit would not have fit; the hub rule
    # skips over oversized shards, the sequential one starts afresh after each
    normal = [s for s in plan.shards if s.nbytes <= limit]
    pairs = zip(normal, normal[1:], strict=False) if rule == "huggingface_hub" else zip(plan.shards, plan.shards[1:], strict=False)
    for prev, nxt in pairs:
        if prev.nbytes <= limit and nxt.nbytes <= limit:
            assert prev.nbytes + by_name[nxt.names[0]] > limit
    if rule == "sequential":
        assert placed == [name for name, _ in items], "key order is preserved across shards"
    assert plan.total_bytes == sum(sizes)
    assert (plan.index_filename is None) == (len(plan.shards) == 1)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=60),
       limit=st.integers(min_value=1, max_value=400))
def test_plan_is_huggingface_hubs(sizes: list[int], limit: int) -> None:
    """The default rule is exactly huggingface_hub's planner, oversized tensors included."""
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    items = {f"t{i}": n for i, n in enumerate(sizes)}
    hub = split_state_dict_into_shards_factory(items, get_storage_size=lambda n: n,
                                               filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    ours = plan_shards(list(items.items()), max_shard_bytes=limit)
    assert {s.filename: list(s.names) for s in ours.shards} == hub.filename_to_tensors
    assert [s.filename for s in ours.shards] == list(hub.filename_to_tensors)
    assert ours.weight_map() == hub.tensor_to_filename
    assert ours.total_bytes == hub.metadata["total_size"]
    assert (ours.index_filename is not None) == hub.is_sharded
