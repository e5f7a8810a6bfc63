"""The ``checkpoint`` section: its rules name the dotted field, and mode names parse to the modes."""

from __future__ import annotations

import pytest

from hookloop.engine import ConfigError
from hookloop.handlers.sections.checkpoint import MODES, AsyncMode, CheckpointConfig


def test_modes_and_their_old_name_parse_to_the_enum():
    assert MODES == ("async", "async_copy", "sync")
    assert AsyncMode.parse("async_staged") is AsyncMode.ASYNC
    assert [AsyncMode.parse(m) for m in MODES] == [AsyncMode.ASYNC, AsyncMode.ASYNC_COPY, AsyncMode.SYNC]
    with pytest.raises(ValueError):
        AsyncMode.parse("staged")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keep_best": -1}, r"checkpoint\.keep_best"),
        ({"metric_mode": "lower"}, r"checkpoint\.metric_mode"),
        ({"mode": "staged"}, r"checkpoint\.mode.*'async', 'async_copy', 'sync'"),
        ({"resume": ""}, r"checkpoint\.resume: must be a checkpoint directory path or null"),
        ({"finetune_from": "a", "resume": "b"}, r"checkpoint\.finetune_from: cannot be combined"),
        ({"wait_timeout_s": 0}, r"checkpoint\.wait_timeout_s"),
        ({"max_index_mb": -1}, r"checkpoint\.max_index_mb"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**change).validate()


def test_the_defaults_are_valid_and_a_prefix_names_the_section():
    CheckpointConfig().validate()
    CheckpointConfig(finetune_from="a", resume="auto").validate()
    with pytest.raises(ConfigError, match=r"run\.ckpt\.keep_best"):
        CheckpointConfig(keep_best=-1).validate("run.ckpt")
