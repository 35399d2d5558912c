"""``shardkit.load_pipeline("s3://BUCKET/PREFIX")``: a diffusers pipeline loaded from a bucket, each
component from its subfolder by ranged GETs, against a real SeaweedFS and a tiny StableDiffusionPipeline
built from configs with random weights."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.errors import InvalidInputError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def pipeline_in_bucket(s3_env, tmp_path):
    """``(url, reference image)``: the tiny SD pipeline resharded to 200KB shards, uploaded."""
    from helpers_pipeline import build_tiny_sd_pipeline, generate

    pipe = build_tiny_sd_pipeline(tmp_path / "scratch")
    pipe.save_pretrained(tmp_path / "saved")
    shardkit.split(tmp_path / "saved", tmp_path / "sharded", max_shard_size="200KB")
    s3_env.put_folder(tmp_path / "sharded", "sd/tiny")
    return f"s3://{s3_env.bucket}/sd/tiny", generate(pipe)


def test_load_pipeline_from_a_bucket_matches_the_original(pipeline_in_bucket) -> None:
    import numpy as np
    from helpers_pipeline import generate

    url, reference = pipeline_in_bucket
    pipe = shardkit.load_pipeline(url, device_map="cpu")
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    report = pipe.shardkit_load_report
    assert {name for name, r in report.items() if r["loaded_by"] == "shardkit"} == {"unet", "vae", "text_encoder"}
    assert pipe.tokenizer("a photo of a cat").input_ids[:2] == [pipe.tokenizer.bos_token_id,
                                                                 pipe.tokenizer.convert_tokens_to_ids("a</w>")]
    np.testing.assert_allclose(generate(pipe), reference, rtol=0, atol=1e-5)


def test_bf16_and_the_options_that_do_not_apply_to_a_bucket(pipeline_in_bucket) -> None:
    url, _ = pipeline_in_bucket
    with pytest.raises(InvalidInputError, match="variant='fp16' does not apply"):
        shardkit.load_pipeline(url, variant="fp16")
    with pytest.raises(InvalidInputError, match="fit= does not apply"):
        shardkit.load_pipeline(url, fit="auto", max_memory={"cpu": "8GB"})
    pipe = shardkit.load_pipeline(url, device_map="cpu", dtype="bf16")
    assert pipe.unet.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16


def test_a_prefix_without_a_pipeline_is_one_line(s3_env) -> None:
    s3_env.put("plain/model.safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(shardkit.errors.SourceNotFoundError, match=f"s3://{s3_env.bucket}/plain has no model_index.json"):
        shardkit.load_pipeline(f"s3://{s3_env.bucket}/plain")
