"""The run config composed from handler-owned sections: from_config, compose_config, attach order."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from hookloop.engine import ConfigError, Events, Trainer
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checks import check_int, check_str
from hookloop.engine.config import PipelineSection
from hookloop.engine.data import MixtureDataset, MixtureSampler
from hookloop.engine.data.config import DataConfig, Phase, PhaseConfig
from hookloop.engine.handler import Handler
from hookloop.engine.pipeline import PipelineConfig
from hookloop.handlers import (
    HANDLER_ORDER,
    AsyncCheckpointer,
    CheckpointConfig,
    ConsoleLogger,
    HealthCheck,
    HealthConfig,
    JSONLLogger,
    LoggingConfig,
    MetricsConfig,
    MetricsTracker,
    NaNConfig,
    NaNDetector,
    PerDatasetMetrics,
    PhaseCurriculum,
    ProfilerWindow,
    ProfilingConfig,
    RunConfig,
    StepScheduler,
    StepSchedulerConfig,
    StragglerConfig,
    StragglerDetector,
    WandBLogger,
    attach_handlers,
    compose_config,
    load_run_config,
)
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches


def _sampler() -> MixtureSampler:
    return MixtureSampler(
        MixtureDataset({"docs": list(range(20)), "code": list(range(20))}), {"docs": 1.0, "code": 0.0}
    )


def _trainer() -> Trainer:
    model = tiny_gpt()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)


# ------------------------------------------------------------------------------ a user's own section


@dataclasses.dataclass
class EveryNConfig:
    enabled: bool = True
    every: int = 10
    label: str = "tick"

    def validate(self, prefix: str = "every_n") -> None:
        check_int(f"{prefix}.every", self.every)
        check_str(f"{prefix}.label", self.label)

    def cross_check(self, cfg, prefix: str) -> None:
        max_steps = cfg.step_scheduler.max_steps
        if max_steps is not None and self.every > max_steps:
            raise ConfigError(
                f"{prefix}.every", f"({self.every}) never fires within step_scheduler.max_steps"
            )


class EveryN(Handler):
    Config = EveryNConfig
    section = "every_n"

    def __init__(self, every: int = 10, label: str = "tick") -> None:
        EveryNConfig(every=every, label=label).validate(prefix="")
        self.every, self.label, self.fired = every, label, []

    def attach(self, trainer):
        trainer.add_event_handler(
            Events.STEP_END(every=self.every), lambda e: self.fired.append(e.state.step)
        )
        return super().attach(trainer)


MyRunConfig = compose_config(every_n=EveryNConfig)


def test_a_users_section_loads_from_yaml_and_overrides_and_is_validated(tmp_path):
    assert issubclass(MyRunConfig, RunConfig) and MyRunConfig.__name__ == "RunConfigEveryN"
    path = tmp_path / "run.yaml"
    path.write_text("step_scheduler: {max_steps: 20}\nevery_n: {every: 4, label: hello}\n")
    cfg = load_run_config(path, schema=MyRunConfig, world_size=1)
    assert (cfg.every_n.every, cfg.every_n.label) == (4, "hello") and cfg.step_scheduler.max_steps == 20
    cfg = load_run_config(path, ["every_n.every=7"], schema=MyRunConfig, world_size=1)
    assert cfg.every_n.every == 7
    assert (
        load_run_config(None, ["step_scheduler.max_steps=50"], schema=MyRunConfig).every_n == EveryNConfig()
    )
    for override, field in [
        ("every_n.every=0", "every_n.every"),  # its own rule
        ("every_n.every=abc", "every_n.every"),  # the loader's type check
        ("every_n.nope=1", "every_n.nope"),  # unknown key
        ("every_n.every=50", "every_n.every"),  # its cross-check against another section
        ("nan.action=ignore", "nan.action"),  # the shipped sections are still validated
    ]:
        with pytest.raises(ConfigError) as info:
            load_run_config(path, [override], schema=MyRunConfig, world_size=1)
        assert info.value.field == field, (override, str(info.value))


def test_compose_config_rejects_clashes_and_non_sections():
    with pytest.raises(ValueError, match="already in RunConfig"):
        compose_config(nan=EveryNConfig)
    with pytest.raises(TypeError, match="dataclass"):
        compose_config(every_n=dict)
    with pytest.raises(TypeError, match="validate"):
        compose_config(plain=dataclasses.make_dataclass("Plain", [("x", int, 1)]))
    with pytest.raises(TypeError, match="at least one"):
        compose_config()
    twice = compose_config(MyRunConfig, name="Twice", other=EveryNConfig)
    assert {"every_n", "other"} <= {f.name for f in dataclasses.fields(twice)} and twice.__name__ == "Twice"


def test_attach_handlers_builds_a_users_handler_from_its_section(tmp_path):
    cfg = load_run_config(
        None,
        [
            "step_scheduler.global_batch_size=2",
            "step_scheduler.max_steps=6",
            "train.local_batch_size=2",
            "checkpoint.enabled=false",
            "nan.action=warn",
            "logging.jsonl=false",
            "logging.console=false",
            "every_n.every=3",
        ],
        schema=MyRunConfig,
        world_size=1,
    )
    trainer = _trainer()
    data = token_batches(8)
    attached = attach_handlers(
        trainer, cfg, order=[*HANDLER_ORDER, EveryN], dataloader=data, run_dir=tmp_path
    )
    assert [type(h) for h in attached] == [StepScheduler, NaNDetector, MetricsTracker, EveryN]
    hook = attached[-1]
    assert trainer.get_handler(EveryN) is hook and hook.every == 3
    trainer.run(data)
    assert hook.fired == [3, 6]
    cfg.every_n.enabled = False
    assert EveryN.from_config(cfg.every_n) is None
    with pytest.raises(ConfigError, match="compose_config"):
        attach_handlers(_trainer(), RunConfig(), order=[EveryN])


# ------------------------------------------------------------------------------ the shipped handlers


def test_handler_order_and_sections_match_the_run_config():
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert HANDLER_ORDER[:3] == [StepScheduler, AsyncCheckpointer, NaNDetector]
    # the profiler, health check and straggler detector after the loggers (a new handler may follow)
    last = [HANDLER_ORDER.index(c) for c in (ConsoleLogger, ProfilerWindow, HealthCheck, StragglerDetector)]
    assert last == list(range(last[0], last[0] + 4))
    for cls in HANDLER_ORDER:
        assert cls.section in fields, cls
        assert isinstance(getattr(RunConfig(), cls.section), cls.Config), cls


def _runtime(tmp_path):
    return dict(
        dataloader=list(range(8)),
        local_batch_size=1,
        dp_size=1,
        run_dir=tmp_path,
        sampler=_sampler(),
        log_interval=5,
        config={},
    )


@pytest.mark.parametrize("cls", HANDLER_ORDER, ids=lambda c: c.__name__)
def test_from_config_builds_when_enabled_and_returns_none_when_disabled(cls, tmp_path):
    import inspect

    section = getattr(RunConfig(), cls.section)
    wanted = inspect.signature(cls.from_config).parameters
    runtime = {k: v for k, v in _runtime(tmp_path).items() if k in wanted}
    for name in ("enabled", "tensorboard", "wandb"):  # turn on what is off by default
        if hasattr(section, name):
            setattr(section, name, True)
    assert isinstance(cls.from_config(section, **runtime), cls)
    switch = getattr(cls, "switch", "enabled")  # a logger's own boolean in the logging section
    if hasattr(section, switch):
        setattr(section, switch, False)
    else:  # the data section is the engine's: no mixture sampler -> no curriculum
        runtime.pop("sampler")
    assert cls.from_config(section, **runtime) is None


def test_attach_handlers_follows_handler_order_and_the_example_defaults(tmp_path):
    cfg = load_run_config(
        None,
        [
            "step_scheduler.global_batch_size=2",
            "step_scheduler.max_steps=4",
            "train.local_batch_size=2",
            f"train.run_dir={tmp_path}",
            "checkpoint.mode=sync",
            "logging.console=false",
            "health.enabled=true",
        ],
        world_size=1,
    )
    trainer = _trainer()
    attached = attach_handlers(trainer, cfg, dataloader=token_batches(8), flops_per_token=123.0)
    kinds = [type(h) for h in attached]
    assert kinds == [StepScheduler, AsyncCheckpointer, NaNDetector, MetricsTracker, JSONLLogger, HealthCheck]
    assert attached[1].directory == str((tmp_path / "checkpoints").resolve())
    assert attached[3].flops_per_token == 123.0 and attached[3].log_interval == cfg.logging.log_interval
    with pytest.raises(TypeError, match="dataloader="):
        attach_handlers(_trainer(), cfg)


# ------------------------------------------------------------------------------ one rule, two callers


def _same_rule(ctor, config, ctor_field: str, config_field: str) -> None:
    """The constructor and the section reject the value with the same message, naming each field
    (a section may also allow null where a constructor argument may not; other sections' names)."""
    with pytest.raises(ConfigError) as by_ctor:
        ctor()
    with pytest.raises(ConfigError) as by_config:
        config()
    assert (by_ctor.value.field, by_config.value.field) == (ctor_field, config_field)

    def strip(e: pytest.ExceptionInfo) -> str:
        text = re.sub(r"^\S+: ", "", str(e.value)).replace(config_field, ctor_field)
        return text.replace(" or null", "").replace("train.", "")

    assert strip(by_ctor) == strip(by_config)


_SCHED = dict(global_batch_size=4, local_batch_size=1, dp_size=1, dataloader=list(range(8)))

_CASES = {
    "nan.spike_factor": (
        lambda tmp: NaNDetector(spike_factor=0.5),
        lambda: NaNConfig(spike_factor=0.5).validate(),
        "nan.spike_factor",
        "nan.spike_factor",
    ),
    "nan.max_rollbacks": (
        lambda tmp: NaNDetector(max_rollbacks=-1),
        lambda: NaNConfig(max_rollbacks=-1).validate(),
        "nan.max_rollbacks",
        "nan.max_rollbacks",
    ),
    "checkpoint.keep_last": (
        lambda tmp: AsyncCheckpointer(tmp, keep_last=0),
        lambda: CheckpointConfig(keep_last=0).validate(),
        "checkpoint.keep_last",
        "checkpoint.keep_last",
    ),
    "checkpoint.finetune_from": (
        lambda tmp: AsyncCheckpointer(tmp, resume=tmp / "a", finetune_from=tmp / "b"),
        lambda: CheckpointConfig(resume="a", finetune_from="b").validate(),
        "checkpoint.finetune_from",
        "checkpoint.finetune_from",
    ),
    "step_scheduler.exit_duration_in_mins": (
        lambda tmp: StepScheduler(**_SCHED, exit_duration_in_mins=math.inf),
        lambda: StepSchedulerConfig(exit_duration_in_mins=math.inf).validate(),
        "exit_duration_in_mins",
        "step_scheduler.exit_duration_in_mins",
    ),
    "step_scheduler.stop_signals": (
        lambda tmp: StepScheduler(**_SCHED, stop_signals=["SIGNOPE"]),
        lambda: StepSchedulerConfig(stop_signals=["SIGNOPE"]).validate(),
        "stop_signals",
        "step_scheduler.stop_signals",
    ),
    "step_scheduler.global_batch_size": (
        lambda tmp: StepScheduler(**{**_SCHED, "local_batch_size": 3}),
        lambda: load_run_config(
            None,
            ["step_scheduler.global_batch_size=4", "train.local_batch_size=3", "step_scheduler.max_steps=9"],
        ),
        "global_batch_size",
        "step_scheduler.global_batch_size",
    ),
    "profiling.end_step": (
        lambda tmp: ProfilerWindow(5, 5, output_dir=tmp),
        lambda: ProfilingConfig(start_step=5, end_step=5).validate(),
        "end_step",
        "profiling.end_step",
    ),
    "profiling.ranks": (
        lambda tmp: ProfilerWindow(1, 2, ranks=[-1], output_dir=tmp),
        lambda: ProfilingConfig(start_step=1, end_step=2, ranks=[-1]).validate(),
        "ranks",
        "profiling.ranks",
    ),
    "health.timeout_s": (
        lambda tmp: HealthCheck(timeout_s=math.nan),
        lambda: HealthConfig(timeout_s=math.nan).validate(),
        "timeout_s",
        "health.timeout_s",
    ),
    "straggler.stop_threshold": (
        lambda tmp: StragglerDetector(stop_threshold=1.0),
        lambda: StragglerConfig(stop_threshold=1.0).validate(),
        "stop_threshold",
        "straggler.stop_threshold",
    ),
    "metrics.flops_per_token": (
        lambda tmp: MetricsTracker(1, flops_per_token=-1.0),
        lambda: MetricsConfig(flops_per_token=-1.0).validate(),
        "flops_per_token",
        "metrics.flops_per_token",
    ),
    "logging.log_interval": (
        lambda tmp: PerDatasetMetrics(["docs"], 0),
        lambda: LoggingConfig(log_interval=0).validate(),
        "log_interval",
        "logging.log_interval",
    ),
    "logging.wandb_mode": (
        lambda tmp: WandBLogger(mode="sometimes"),
        lambda: LoggingConfig(wandb_mode="sometimes").validate(),
        "mode",
        "logging.wandb_mode",
    ),
    "data.phases": (
        lambda tmp: PhaseCurriculum(_sampler(), [Phase(1, {"docs": 0.0})]),
        lambda: DataConfig(
            datasets={"docs": "a", "code": "b"}, weights={"code": 0.0}, phases=[PhaseConfig(1, {"docs": 0.0})]
        ).validate(),
        "phases[0].dataset_weights",
        "data.phases[0].dataset_weights",
    ),
    "pipeline.dtype": (
        lambda tmp: PipelineConfig(dtype="int7").validate(),
        lambda: PipelineSection(dtype="int7").validate(),
        "pipeline.dtype",
        "pipeline.dtype",
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_constructor_and_section_reject_a_bad_value_with_the_same_rule(case, tmp_path):
    ctor, config, ctor_field, config_field = _CASES[case]
    _same_rule(lambda: ctor(tmp_path), config, ctor_field, config_field)


def test_a_corrupt_curriculum_state_is_a_checkpoint_error_naming_the_key():
    curriculum = PhaseCurriculum(_sampler(), [])
    good = curriculum.state_dict()
    for state, key in [
        ({**good, "format": "other"}, "format"),
        ({**good, "version": 99}, "version"),
        ({k: v for k, v in good.items() if k != "draws"}, "draws"),
        ({**good, "step": "x"}, "step"),
        ({**good, "draws": good["draws"] + 1}, "draws"),
    ]:
        with pytest.raises(CheckpointError, match=key) as info:
            curriculum.load_state_dict(state)
        assert not isinstance(info.value, ConfigError)
    curriculum.load_state_dict(good)


def test_the_docs_example_runs():
    import os
    import sys

    from tests.dist_utils import REPO, run_process

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "writing_handlers.md").read_text(), re.S)
    block = next(b for b in blocks if "class EveryNConfig" in b)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = run_process([sys.executable, "-c", block], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "EveryNConfig(enabled=True, every=25)",
        "25",
        "every_n.every: must be an integer >= 1, got 0",
    ]


def test_a_null_run_dir_falls_back_to_the_library_default_everywhere(tmp_path, monkeypatch):
    import torch

    from hookloop.engine import Trainer
    from hookloop.handlers import attach_handlers, check_run_paths, load_run_config
    from hookloop.handlers.checkpoint import AsyncCheckpointer
    from hookloop.handlers.run_config import DEFAULT_RUN_DIR

    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(None, ["train.run_dir=null", "step_scheduler.max_steps=4"], world_size=1)
    assert cfg.train.run_dir is None
    check_run_paths(cfg)  # no crash on a null directory: the default is checked instead
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    attach_handlers(trainer, cfg, dataloader=[(torch.ones(1, 2), torch.ones(1, 1))] * 4, dp_size=1)
    checkpointer = trainer.get_handler(AsyncCheckpointer)
    assert (
        str(checkpointer.directory) == str(tmp_path / DEFAULT_RUN_DIR / "checkpoints")
        or str(checkpointer.directory) == f"{DEFAULT_RUN_DIR}/checkpoints"
    )
