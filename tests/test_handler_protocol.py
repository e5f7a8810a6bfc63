"""Every shipped handler has one shape: a ``Handler`` whose ``attach`` returns it and registers it.

Registered handlers are found by type or state key (``trainer.get_handler``), stateful ones are
checkpointed under their historical keys, each runs at its named place (``Places``) (never two shipped
handlers at one priority on one event), and they find each other through the registry only.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hookloop.engine import Events, Trainer
from hookloop.engine.data import MixtureDataset, MixtureSampler, TokenDataset
from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.handler import Handler
from hookloop.engine.running_mean import RunningMean
from hookloop.handlers import (
    AsyncCheckpointer,
    ConsoleLogger,
    HealthCheck,
    JSONLLogger,
    MetricLogger,
    MetricsTracker,
    NaNDetector,
    PerDatasetMetrics,
    PhaseCurriculum,
    Places,
    Priority,
    ProfilerWindow,
    StepScheduler,
    StragglerDetector,
    TensorBoardLogger,
    WandBLogger,
)
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches

SEQ = 16

# The keys existing checkpoints hold these handlers' state under.
HISTORICAL_KEYS = {
    StepScheduler: "step_scheduler",
    NaNDetector: "nan_detector",
    PhaseCurriculum: "curriculum",
    MetricsTracker: "metrics_tracker",
}


class RecordingWandB(WandBLogger):
    """A WandBLogger that records what it would send instead of importing wandb."""

    def open(self) -> None:
        self.sent: list[tuple[int, dict]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.sent.append((step, dict(metrics)))

    def close(self) -> None:
        pass


def _mixture(root: Path) -> MixtureDataset:
    sources = {}
    for i, name in enumerate(("docs", "code")):
        path = root / f"{name}.u8"
        np.random.default_rng(i).integers(32 * i, 32 * i + 32, 50 * SEQ + 1, dtype=np.uint8).tofile(path)
        path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint8"}))
        sources[name] = TokenDataset(path, SEQ)
    return MixtureDataset(sources)


def _trainer(loss_fn=cross_entropy_loss, grad_accum_steps: int = 2) -> Trainer:
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Trainer(model, opt, loss_fn, grad_accum_steps=grad_accum_steps)


def _factories(tmp_path: Path, data, sampler: MixtureSampler) -> dict[str, callable]:
    """One builder per shipped handler (the checkpointer aside: it has its own tests)."""
    return {
        "StepScheduler": lambda: StepScheduler(4, 2, 1, data, max_steps=4, stop_signals=None),
        "NaNDetector": lambda: NaNDetector(action="warn"),
        "PhaseCurriculum": lambda: PhaseCurriculum(sampler, []),
        "PerDatasetMetrics": lambda: PerDatasetMetrics(sampler, log_interval=2),
        "ProfilerWindow": lambda: ProfilerWindow(2, 3, output_dir=tmp_path / "profile"),
        "HealthCheck": lambda: HealthCheck(every_steps=2),
        "StragglerDetector": lambda: StragglerDetector(every_steps=2),
        "MetricsTracker": lambda: MetricsTracker(2, run_dir=tmp_path),
        "JSONLLogger": lambda: JSONLLogger(tmp_path / "metrics.jsonl"),
        "TensorBoardLogger": lambda: TensorBoardLogger(tmp_path / "tb"),
        "WandBLogger": lambda: RecordingWandB(mode="disabled"),
        "ConsoleLogger": lambda: ConsoleLogger(stream=io.StringIO(), progress_bar=False),
    }


@pytest.fixture
def mixture_sampler(tmp_path) -> MixtureSampler:
    return MixtureSampler(_mixture(tmp_path), {"docs": 1.0, "code": 1.0}, seed=0)


HANDLER_NAMES = list(_factories(Path("."), [], None))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", HANDLER_NAMES)
def test_attach_returns_the_handler_and_registers_it(name, tmp_path, mixture_sampler):
    trainer = _trainer()
    handler = _factories(tmp_path, token_batches(8), mixture_sampler)[name]()
    assert isinstance(handler, Handler)
    assert handler.attach(trainer) is handler
    assert trainer.get_handler(type(handler)) is handler
    assert handler in trainer.handlers and handler.trainer is trainer
    key = HISTORICAL_KEYS.get(next((t for t in HISTORICAL_KEYS if isinstance(handler, t)), None))
    if key is not None:
        assert trainer.stateful[key] is handler
        assert trainer.get_handler(key) is handler
    else:
        assert handler not in trainer.stateful.values()


@pytest.mark.parametrize("name", HANDLER_NAMES)
def test_one_instance_cannot_serve_two_trainers(name, tmp_path, mixture_sampler):
    handler = _factories(tmp_path, token_batches(8), mixture_sampler)[name]()
    handler.attach(_trainer())
    with pytest.raises(RuntimeError, match="already attached"):
        handler.attach(_trainer())


def test_scheduler_and_curriculum_refuse_a_second_attach_to_the_same_trainer(tmp_path, mixture_sampler):
    for build in (
        lambda: StepScheduler(4, 2, 1, token_batches(8), stop_signals=None),
        lambda: PhaseCurriculum(mixture_sampler, []),
    ):
        trainer = _trainer()
        handler = build().attach(trainer)
        with pytest.raises(RuntimeError, match="already attached to a trainer"):
            handler.attach(trainer)


def test_keys_given_to_the_constructor_still_name_the_checkpoint_state(mixture_sampler):
    trainer = _trainer()
    curriculum = PhaseCurriculum(mixture_sampler, [], state_key="curriculum_b").attach(trainer)
    tracker = MetricsTracker(2, state_key="tracker_b").attach(trainer)
    assert trainer.stateful["curriculum_b"] is curriculum and trainer.stateful["tracker_b"] is tracker
    assert "curriculum" not in trainer.stateful and "metrics_tracker" not in trainer.stateful


def test_a_tracker_without_state_key_is_registered_but_not_checkpointed():
    trainer = _trainer()
    tracker = MetricsTracker(2, state_key=None).attach(trainer)
    assert trainer.get_handler(MetricsTracker) is tracker
    assert trainer.get_handler("metrics_tracker") is tracker  # the loggers still find it
    assert tracker not in trainer.stateful.values()


# ---------------------------------------------------------------------------------- priorities


def _owner(entry) -> object:
    return getattr(entry.original, "__self__", entry.original)


def _priority_values() -> set[float]:
    """Every named place: the engine's phases and each shipped handler's own (``handlers.Places``)."""
    phases = [getattr(Priority, k) for k in vars(Priority) if not k.startswith("_")]
    return {*phases, *(getattr(Places, k) for k in vars(Places) if not k.startswith("_"))}


def _attach_everything(tmp_path: Path, sampler: MixtureSampler) -> tuple[Trainer, list, MixtureLoader]:
    trainer = _trainer()
    loader = MixtureLoader(sampler, 2)
    handlers = [AsyncCheckpointer(tmp_path / "ckpt", mode="sync", resume=None)]
    factories = _factories(tmp_path, loader, sampler)
    factories["NaNDetector"] = lambda: NaNDetector(action="rollback")  # the checkpointer answers ROLLBACK
    handlers += [build() for build in factories.values()]
    for handler in handlers:
        assert handler.attach(trainer) is handler
    return trainer, handlers, loader


EVENTS = [
    Events.TRAIN_START,
    Events.EPOCH_START,
    Events.STEP_START,
    Events.MICROBATCH,
    Events.BEFORE_OPTIMIZER_STEP,
    Events.STEP_END,
    Events.VALIDATION_END,
    Events.CHECKPOINT_SAVED,
    Events.ROLLBACK,
    Events.EPOCH_END,
    Events.TRAIN_END,
    Events.TRAIN_FAILED,
    Events.EXCEPTION,
    Events.TERMINATE,
]


def test_no_two_shipped_handlers_share_a_priority_on_one_event(tmp_path, mixture_sampler):
    trainer, handlers, _ = _attach_everything(tmp_path, mixture_sampler)
    from ignite.engine import Events as IgniteEvents

    events = EVENTS + [IgniteEvents.GET_BATCH_STARTED, IgniteEvents.GET_BATCH_COMPLETED]
    shipped = set(map(id, handlers)) | {id(trainer)}
    names = _priority_values()
    for event in events:
        owners: dict[float, set[int]] = {}
        for entry in trainer.events.entries(event):
            owner = _owner(entry)
            assert id(owner) in shipped, f"{event}: {entry.original!r} belongs to no shipped handler"
            assert entry.priority in names, f"{event}: {entry.original!r} runs at an unnamed priority"
            owners.setdefault(entry.priority, set()).add(id(owner))
        shared = {p: len(o) for p, o in owners.items() if len(o) > 1}
        assert shared == {}, f"{event}: shipped handlers share priorities {shared}"
    # EXCEPTION handlers handle the error (ignite's rule): cleanup belongs to TRAIN_FAILED
    assert trainer.events.entries(Events.EXCEPTION) == []


def test_the_order_table_in_the_docs_reads_as_the_code():
    """docs/concepts.md shows each shipped place as ``NAME = PHASE ± offset``: the same as the code."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    found = re.findall(r"`([A-Z_]+)` = `([A-Z_]+)`(?: ([+-]) ([0-9.e]+))?", text)
    assert len({name for name, *_ in found}) >= 20
    for name, phase, sign, offset in found:
        value = getattr(Priority, phase) + (float(sign + offset) if sign else 0.0)
        place = getattr(Places, name, None) or getattr(Priority, name)  # VALIDATION: the trainer's own
        assert (place.phase, place) == (phase, value), f"docs/concepts.md: {name} = {phase} {sign} {offset}"


def test_every_shipped_handler_together_costs_no_late_all_reduce(tmp_path, mixture_sampler):
    """The shipped handlers on STEP_END / ROLLBACK / ... together cost no second all-reduce (the
    straggler detector only with a stop threshold)."""
    trainer, _, _ = _attach_everything(tmp_path, mixture_sampler)
    assert not trainer.step_decisions.late_requests_possible()
    assert StragglerDetector(stop_threshold=2.0).asks_after_agreement is True


def test_every_shipped_handler_together_on_one_run(tmp_path, mixture_sampler):
    trainer, handlers, loader = _attach_everything(tmp_path, mixture_sampler)
    state = trainer.run(loader)
    assert state.step == 4 and state.control.exit_code == 0
    wandb = trainer.get_handler(WandBLogger)
    assert [step for step, _ in wandb.sent] == [2, 4]  # logging.log_interval: the tracker's, every logger's
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]  # the tracker's log steps
    assert {"loss/docs", "tokens/code", "phase", "step_time_s", "loss_avg"} <= set(records[-1])


# ---------------------------------------------------------------------------------- the registry


def test_wandb_logs_on_the_trackers_steps_with_a_scheduler_attached():
    trainer = _trainer()
    wandb = RecordingWandB().attach(trainer)  # attached before the tracker: it follows it all the same
    data = token_batches(24)
    StepScheduler(4, 2, 1, data, num_epochs=1, stop_signals=None).attach(trainer)
    MetricsTracker(3).attach(trainer)  # logging.log_interval: the one log cadence
    trainer.run(data)
    assert [step for step, _ in wandb.sent] == [3, 6, 9, 12]


def test_wandb_does_not_take_a_lookalike_for_the_scheduler():
    class Lookalike:  # has the scheduler's cadence attribute, but is not the registered scheduler
        log_remote_every_steps = 3

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    trainer = _trainer()
    trainer.register_stateful("lookalike", Lookalike())
    wandb = RecordingWandB().attach(trainer)
    trainer.run(token_batches(8), max_steps=4)
    assert [step for step, _ in wandb.sent] == [1, 2, 3, 4]  # no tracker, no scheduler: every step


def test_loggers_follow_a_tracker_attached_after_them(tmp_path):
    trainer = _trainer()
    logger = JSONLLogger(tmp_path / "m.jsonl").attach(trainer)
    MetricsTracker(3).attach(trainer)
    trainer.run(token_batches(16), max_steps=7)
    steps = [json.loads(line)["step"] for line in logger.path.read_text().splitlines()]
    assert steps == [3, 6, 7]


class _UserLogger(MetricLogger):
    def open(self) -> None:
        self.steps: list[int] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)


def test_a_user_logger_runs_after_the_shipped_ones(tmp_path):
    trainer = _trainer()
    user = _UserLogger().attach(trainer)  # attached first, still runs last among loggers
    JSONLLogger(tmp_path / "m.jsonl").attach(trainer)
    order = [_owner(e) for e in trainer.events.entries(Events.STEP_END)]
    assert order.index(user) > order.index(trainer.get_handler(JSONLLogger))
    assert user.priority == Places.LOG


# ---------------------------------------------------------------------------------- one loss average


def test_the_scheduler_owns_loss_avg_when_attached_else_the_tracker():
    def run(with_scheduler: bool) -> tuple[list[float], dict[int, float]]:
        trainer = _trainer()
        data = token_batches(12)
        MetricsTracker(2).attach(trainer)
        if with_scheduler:
            StepScheduler(4, 2, 1, data, num_epochs=1, loss_average_window_steps=3, stop_signals=None).attach(
                trainer
            )
        losses: list[float] = []
        published: dict[int, float] = {}

        @trainer.on(Events.STEP_END, priority=Places.LOG - 1)
        def grab() -> None:
            losses.append(trainer.state.loss)
            if trainer.state.metrics_step == trainer.state.step:
                published[trainer.state.step] = trainer.state.metrics["loss_avg"]

        trainer.run(data) if with_scheduler else trainer.run(data, max_steps=6)
        return losses, published

    losses, published = run(with_scheduler=True)
    assert published[4] == pytest.approx(sum(losses[1:4]) / 3)  # the scheduler's window of 3
    assert published[6] == pytest.approx(sum(losses[3:6]) / 3)
    losses, published = run(with_scheduler=False)
    assert published[4] == pytest.approx(sum(losses[2:4]) / 2)  # the tracker's window: log_interval


def test_running_mean_skips_non_finite_values_and_keeps_its_window():
    mean = RunningMean(3)
    assert math.isnan(mean.mean) and len(mean) == 0
    for value in (1.0, float("nan"), 2.0, float("inf"), 3.0, 4.0):
        mean.add(value)
    assert mean.mean == pytest.approx(3.0) and len(mean) == 3 and mean.window == 3
    mean.clear()
    assert math.isnan(mean.mean)


def test_running_mean_reads_pushed_tensors_to_floats_one_or_many_at_a_time():
    mean = RunningMean(3)
    mean.push(torch.tensor(1.0))
    assert mean.values == [1.0]  # one unread value
    for value in (2.0, float("nan"), 4.0):
        mean.push(torch.tensor(value))
    assert mean.values == [2.0, 4.0] and all(type(v) is float for v in mean.values)  # several
    mean.push(torch.tensor(float("inf")))
    for value in (5.0, 6.0, 7.0):  # the unread tensor falls out of the window before a read
        mean.push(value)
    assert mean.values == [5.0, 6.0, 7.0] and mean.mean == pytest.approx(6.0)


def test_running_mean_lazy_mean_follows_its_window_through_pushes_reads_and_restores():
    """The lazy mean (a tensor while values are unread: one slot of the device-side ring written per
    push) is the mean of the window's finite values, whatever was pushed, read or restored."""
    rng = random.Random(0)
    for window in (1, 2, 3, 5):
        mean = RunningMean(window)
        for i in range(60):
            value = (
                rng.choice([float("nan"), float("inf"), -float("inf")]) if i % 7 == 3 else rng.uniform(-5, 5)
            )
            action = rng.random()
            if action < 0.7:
                mean.push(torch.tensor(value))
            elif action < 0.85:
                mean.push(value)
            elif action < 0.92:
                assert isinstance(
                    mean.values, list
                )  # a read (a state_dict): tensors to floats, non-finite go
            elif action < 0.97:
                mean.restore([rng.uniform(0, 1) for _ in range(rng.randint(0, 2 * window))])
            else:
                mean.clear()
            finite = [float(v) for v in mean._values if math.isfinite(float(v))]
            expected = sum(finite) / len(finite) if finite else float("nan")
            lazy = mean.lazy_mean()
            assert isinstance(lazy, torch.Tensor) == mean._unread
            assert float(lazy) == pytest.approx(expected, rel=1e-6, nan_ok=True), (window, i)


# ---------------------------------------------------------------------------------- NaN rollback


def test_loggers_record_the_step_that_triggers_a_rollback(tmp_path):
    trainer_ref: dict = {}

    def loss_fn(out, y):
        loss = cross_entropy_loss(out, y)
        state = trainer_ref["t"].state
        return loss * float("nan") if state.step == 6 and state.rollbacks == 0 else loss

    trainer = _trainer(loss_fn, grad_accum_steps=1)
    trainer_ref["t"] = trainer
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync", resume=None).attach(trainer)
    save_every(trainer, 4)
    NaNDetector(action="rollback", max_consecutive=1, max_rollbacks=1).attach(trainer)
    logger = JSONLLogger(tmp_path / "metrics.jsonl").attach(trainer)
    state = trainer.run(token_batches(16), max_steps=8)
    assert state.rollbacks == 1 and state.step == 8
    records = [json.loads(line) for line in logger.path.read_text().splitlines()]
    steps = [r["step"] for r in records]
    # step 6 went bad and rolled back to the step-4 checkpoint; its record is there, then 5.. again
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    bad = records[5]
    assert bad["step"] == 6 and math.isnan(bad["loss"]) and bad["nan/bad_steps"] == 1
    assert all(math.isfinite(r["loss"]) for r in records[6:])


# Handlers whose config section is their field list: from_config passes every setting but
# ``enabled`` to the constructor, which validates its arguments by building the section.
_SECTION_SHAPED = [
    StepScheduler,
    NaNDetector,
    HealthCheck,
    StragglerDetector,
    ProfilerWindow,
    AsyncCheckpointer,
]
# Where a run file has a fixed default and the constructor derives one from the data (None).
_DERIVED_IN_CONSTRUCTOR = {("StepScheduler", "num_epochs"), ("StepScheduler", "ckpt_every_steps")}


@pytest.mark.parametrize("cls", _SECTION_SHAPED, ids=lambda c: c.__name__)
def test_a_section_shaped_handler_takes_every_setting_with_the_same_default(cls):
    import dataclasses
    import inspect

    params = inspect.signature(cls).parameters
    for f in dataclasses.fields(cls.Config):
        if f.name == "enabled":
            continue
        assert f.name in params, f"{cls.__name__}({f.name}=...) is missing: the section has it"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        param_default = params[f.name].default
        if param_default is inspect.Parameter.empty or (cls.__name__, f.name) in _DERIVED_IN_CONSTRUCTOR:
            continue  # required in the constructor, or derived there from the data
        if isinstance(param_default, tuple):
            param_default = list(param_default)
        assert param_default == default, f"{cls.__name__}.{f.name}: {param_default!r} != {default!r}"


@pytest.mark.parametrize(
    "cls,kwargs,field",
    [
        (NaNDetector, dict(action="ignore"), "nan.action"),
        (HealthCheck, dict(timeout_s=0), "timeout_s"),
        (StragglerDetector, dict(stop_threshold=1.0), "stop_threshold"),
        # rejected before the directory is created
        (AsyncCheckpointer, dict(directory="never_created", keep_best=-1), "checkpoint.keep_best"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if isinstance(v, type) else None,
)
def test_a_constructor_applies_its_sections_rules(cls, kwargs, field):
    from hookloop.engine.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert info.value.field == field
