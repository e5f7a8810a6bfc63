"""Every spelling of null on the command line (None, none, null, ~) means null for Optional fields."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hookloop.engine.config import load_config
from hookloop.engine.errors import ConfigError
from hookloop.handlers import load_run_config

_BASE = ["step_scheduler.max_steps=10"]  # the default cosine schedule needs a length


@pytest.mark.parametrize("word", ["None", "none", "null", "~"])
def test_null_words_clear_an_optional_field(word: str) -> None:
    cfg = load_run_config(None, [*_BASE, f"checkpoint.resume={word}"])
    assert cfg.checkpoint.resume is None


@pytest.mark.parametrize("word", ["None", "none"])
def test_null_words_clear_optional_numbers(word: str) -> None:
    overrides = [*_BASE, f"step_scheduler.ckpt_every_steps={word}", f"train.grad_clip_norm={word}"]
    cfg = load_run_config(None, overrides)
    assert cfg.step_scheduler.ckpt_every_steps is None
    assert cfg.train.grad_clip_norm is None


def test_words_containing_none_stay_strings() -> None:
    cfg = load_run_config(None, [*_BASE, "profiling.output_dir=none_dir"])
    assert cfg.profiling.output_dir == "none_dir"


@dataclass
class _Section:
    name: str = "x"
    count: int = 1

    def validate(self, prefix: str) -> None:
        pass


@dataclass
class _Schema:
    sec: _Section


def test_a_required_str_field_keeps_the_word() -> None:
    cfg = load_config(None, ["sec.name=None"], schema=_Schema)
    assert cfg.sec.name == "None"


def test_a_required_int_field_rejects_the_word_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="sec.count"):
        load_config(None, ["sec.count=None"], schema=_Schema)
