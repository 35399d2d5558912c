"""The library logs to the ``shardkit`` logger and leaves other libraries' logging alone; the CLI sets it up."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from conftest import TINY_UNET_CONFIG, invoke_cli

import shardkit

PACKAGE = Path(shardkit.__file__).parent
OTHERS = ("accelerate", "accelerate.utils.modeling", "diffusers", "huggingface_hub", "transformers")
GLOBAL_CHANGES = re.compile(r"setLevel\(|set_verbosity|disable_progress_bars|enable_progress_bars|logging\.disable\(")


def test_no_module_outside_the_cli_changes_global_logging() -> None:
    offenders = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py") if "cli" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1) if GLOBAL_CHANGES.search(line)]
    assert offenders == []


@pytest.fixture
def known_levels():
    """Other libraries' loggers at a known level (earlier in-process CLI runs quiet them, as an app may)."""
    import accelerate  # noqa: F401 - each library sets its own level when first imported: not our change
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils.logging as hub_logging
    import transformers.utils.logging as transformers_logging

    for library in (diffusers_logging, hub_logging, transformers_logging):
        library.get_logger("x")
    saved = {name: logging.getLogger(name).level for name in OTHERS}
    for name in OTHERS:
        logging.getLogger(name).setLevel(logging.INFO)
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def test_planning_for_absent_gpus_leaves_accelerate_logging_alone(known_levels) -> None:
    plan = shardkit.plan_device_map("diffusers:UNet2DConditionModel", config=TINY_UNET_CONFIG,
                                    max_memory={0: "1MB", 7: "1MB", "cpu": "1GB"})
    assert plan.device_map
    assert {name: logging.getLogger(name).level for name in OTHERS} == dict.fromkeys(OTHERS, logging.INFO)


def test_runtime_options_log_to_the_shardkit_logger(known_levels, caplog) -> None:
    from conftest import tiny_unet

    from shardkit.runtime.apply import RuntimeSetup, apply_runtime

    with caplog.at_level(logging.DEBUG, logger="shardkit"):
        apply_runtime(tiny_unet(), RuntimeSetup(offload="model", offload_options={"device": "cpu"}))
    records = [r for r in caplog.records if r.name.startswith("shardkit.")]
    assert any("offload 'model'" in r.getMessage() for r in records), caplog.text
    assert {name: logging.getLogger(name).level for name in OTHERS} == dict.fromkeys(OTHERS, logging.INFO)


def test_cli_debug_shows_shardkit_debug_records_and_default_hides_them(tmp_path: Path) -> None:
    logging.getLogger("shardkit.test").debug("not shown before the CLI configures logging")
    result = invoke_cli("--debug", "plan", "--help")
    assert result.exit_code == 0
    assert logging.getLogger("shardkit").level == logging.DEBUG
    result = invoke_cli("plan", "--help")
    assert result.exit_code == 0
    assert logging.getLogger("shardkit").level == logging.WARNING
    assert "DEBUG" not in result.stderr


def test_runtime_setup_refuses_options_without_a_strategy() -> None:
    from shardkit.runtime.apply import RuntimeSetup

    with pytest.raises(shardkit.ShardkitError, match="offload_options given without offload"):
        RuntimeSetup(offload_options={"device": "cpu"})
