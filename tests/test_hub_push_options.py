"""``PushOptions``: the one definition of the push options, and the keywords ``shardkit.push`` takes for them."""

from __future__ import annotations

import dataclasses

import pytest

from shardkit.api.jobs import PushKeywords
from shardkit.errors import InvalidInputError
from shardkit.hub.push import PushOptions


def test_the_keywords_are_the_fields() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(PushOptions)}
    keywords = {name: getattr(hint, "__forward_arg__", hint) for name, hint in PushKeywords.__annotations__.items()}
    assert keywords == fields


def test_globs_are_kept_as_tuples_and_none_means_every_file() -> None:
    assert PushOptions(include="unet/*").include == ("unet/*",)
    assert PushOptions(exclude=["*.bin", "*.pt"]).exclude == ("*.bin", "*.pt")
    assert PushOptions().globs() == (None, None)
    assert PushOptions(include=("a/*",)).globs() == (["a/*"], None)


def test_a_pull_request_from_a_pull_request_is_refused_when_the_options_are_made() -> None:
    with pytest.raises(InvalidInputError, match="revision='refs/pr/3' is a pull request already"):
        PushOptions(revision="refs/pr/3", create_pr=True)
    assert PushOptions(revision="refs/pr/3").revision == "refs/pr/3"


def test_shorthands_apply_over_the_options_object() -> None:
    base = PushOptions(private=True, message="m")
    assert dataclasses.replace(base, message="n") == PushOptions(private=True, message="n")
