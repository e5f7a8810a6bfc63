"""WeightEMA in one process: the average of the committed steps' weights, validation on it, exact
resume, rollback, a changed decay on resume, keep_best by val_loss_ema, the section's rules, and
``hookloop export --ema``. The layouts (DDP, FSDP2, TP) are in tests/test_ema_layouts.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from ignite.metrics import Loss

from hookloop.engine import ConfigError, Events, ExitCode, Priority, Trainer
from hookloop.engine.checkpoint_format.directory import complete_checkpoints, read_json, step_dir_name
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers import HANDLER_ORDER, attach_handlers, compose_config, load_run_config
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.handlers.ema import WeightEMA
from hookloop.handlers.sections.ema import EMAConfig
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every, validate_every
from tests.conftest import tiny_gpt, token_batches
from tests.test_checkpoint import assert_bitwise, make_trainer, seed_all, shuffled_loader, snapshot, stop_at

pytestmark = pytest.mark.usefixtures("deterministic")

BASE = ["checkpoint.enabled=false", "nan.action=warn", "step_scheduler.max_steps=10"]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def val_data():
    return token_batches(3, seed=9)


def average(ema: WeightEMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.average.items()}


def plain_trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_gpt(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def test_the_average_takes_committed_steps_only_from_start_step_on_every_n_steps():
    trainer = make_trainer()
    ema = WeightEMA(decay=0.8, every_steps=2, start_step=2).attach(trainer)
    after: dict[int, dict] = {0: weights(trainer)}
    trainer.add_event_handler(Events.STEP_END, lambda e: after.__setitem__(e.state.step, weights(e)))

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def _veto(engine):
        if engine.state.step == 6:
            engine.control.request_skip()

    trainer.run(shuffled_loader(), max_steps=9)
    expected = dict(after[2])  # until start_step the average is the weights
    for step in (4, 8):  # 6 was vetoed; the odd steps are not every 2nd
        expected = {n: torch.lerp(expected[n], after[step][n], 1 - 0.8) for n in expected}
    assert ema.updates == 2
    assert_bitwise(ema.average, expected)
    assert not torch.equal(ema.average["tok_emb.weight"], after[9]["tok_emb.weight"])


def test_validation_on_the_average_publishes_ema_metrics_and_puts_the_weights_back():
    trainer = plain_trainer()
    ema = WeightEMA(decay=0.5).attach(trainer)
    trainer.set_validation(val_data(), metrics={"xent": Loss(cross_entropy_loss)})
    validate_every(trainer, 3)
    seen = {}

    @trainer.on(Events.VALIDATION_END)
    def _check(engine):
        seen.update(engine.state.metrics)
        seen["weights"] = weights(engine)

    trainer.run(token_batches(10), max_steps=3)
    assert_bitwise(seen.pop("weights"), weights(trainer))  # the trained weights, back in place
    metrics = {k: v for k, v in seen.items() if k.startswith("val_")}
    assert set(metrics) == {"val_loss", "val_xent", "val_loss_ema", "val_xent_ema"}
    assert metrics["val_loss_ema"] != metrics["val_loss"]

    trained = weights(trainer)  # the EMA metrics are the plain validation of the average
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            p.copy_(ema.average[n])
    assert trainer.validate() == pytest.approx(metrics["val_loss_ema"], rel=1e-6)
    assert trainer.state.metrics["val_xent"] == pytest.approx(metrics["val_xent_ema"], rel=1e-6)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            p.copy_(trained[n])


@pytest.mark.parametrize(("mode", "stop"), [("async", 5), ("sync", 4)])
def test_stop_and_resume_gives_the_average_of_the_uninterrupted_run_bitwise(tmp_path, mode, stop):
    def run(directory, seed, stop_step=None):
        trainer = make_trainer(seed=seed)
        ema = WeightEMA(decay=0.7, start_step=1).attach(trainer)
        trainer.set_validation(val_data())
        validate_every(trainer, 3)
        if directory is not None:
            AsyncCheckpointer(directory, mode=mode).attach(trainer)
            save_every(trainer, 3)
        if stop_step is not None:
            stop_at(trainer, stop_step)
        state = trainer.run(shuffled_loader(), max_steps=9)
        return trainer, ema, state

    seed_all()
    ref, ref_ema, _ = run(None, 0)
    seed_all()
    _, _, state = run(tmp_path, 0, stop)
    assert state.control.exit_code == ExitCode.STOPPED
    index = SafeReader(os.path.join(tmp_path, step_dir_name(stop))).read_metadata().state_dict_metadata
    assert {k.removeprefix("handlers.ema.") for k in index if k.startswith("handlers.ema.")} == set(
        ref_ema.average
    )
    seed_all(99)
    resumed, resumed_ema, _ = run(tmp_path, 5)
    assert resumed_ema.updates == ref_ema.updates == 8
    assert_bitwise(resumed_ema.average, ref_ema.average)
    assert_bitwise(snapshot(resumed), snapshot(ref))
    assert resumed.state.metrics["val_loss_ema"] == ref.state.metrics["val_loss_ema"]


def test_a_rollback_restores_the_average_with_the_model(tmp_path):
    trainer = make_trainer()
    ema = WeightEMA(decay=0.6).attach(trainer)
    AsyncCheckpointer(tmp_path).attach(trainer)
    save_every(trainer, 3)
    at_save, after = {}, {}

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE - 900)
    def _remember(engine):
        if engine.state.step == 3 and not at_save:
            at_save.update(average(ema))
            at_save["updates"] = torch.tensor(ema.updates)

    @trainer.on(Events.STEP_END, priority=Priority.RECORD)
    def _poisoned(engine):  # a bad update was committed at step 5 (it entered the average): roll back
        if engine.state.step == 5 and not after:
            engine.control.request_rollback()
            after["pending"] = torch.tensor(1)

    @trainer.on(Events.ROLLBACK, priority=Priority.RESTORE + 1)
    def _before(engine):
        after["before"] = average(ema)["tok_emb.weight"]

    @trainer.on(Events.ROLLBACK, priority=Priority.RESTORE - 1)
    def _restored(engine):
        after.update(average(ema))
        after["updates"] = torch.tensor(ema.updates)

    trainer.run(shuffled_loader(), max_steps=6)
    assert trainer.state.rollbacks == 1
    after.pop("pending")
    assert not torch.equal(after.pop("before"), at_save["tok_emb.weight"])  # step 5 had entered it
    assert_bitwise(after, at_save)


def test_a_changed_decay_on_resume_is_honoured_and_said(tmp_path, caplog):
    def run(decay, steps):
        trainer = make_trainer()
        ema = WeightEMA(decay=decay).attach(trainer)
        AsyncCheckpointer(tmp_path).attach(trainer)
        trainer.run(token_batches(20), max_steps=steps)
        return trainer, ema

    run(0.9, 2)
    before = {}
    trainer = make_trainer()
    ema = WeightEMA(decay=0.5).attach(trainer)
    AsyncCheckpointer(tmp_path).attach(trainer)
    trainer.add_event_handler(
        Events.TRAIN_START, lambda: before.update(average(ema)), priority=Priority.OBSERVE
    )
    trainer.add_event_handler(
        Events.STEP_END, lambda e: before.__setitem__("w3", weights(e)), priority=Priority.OBSERVE + 999
    )
    with caplog.at_level(logging.INFO, logger="hookloop.handlers.ema"):
        trainer.run(token_batches(20), max_steps=3)
    assert "ema.decay 0.9 -> 0.5" in caplog.text
    w3 = before.pop("w3")
    expected = {n: torch.lerp(before[n], w3[n], 0.5) for n in before}
    assert_bitwise(ema.average, expected)


def test_keep_best_ranks_checkpoints_by_val_loss_ema(tmp_path):
    trainer = make_trainer()
    WeightEMA(decay=0.5).attach(trainer)
    trainer.set_validation(val_data())
    AsyncCheckpointer(tmp_path, keep_last=1, keep_best=1, metric="val_loss_ema").attach(trainer)
    save_every(trainer, 2)
    validate_every(trainer, 2)
    ranked = {}
    trainer.add_event_handler(
        Events.VALIDATION_END, lambda e: ranked.__setitem__(e.state.step, e.state.metrics["val_loss_ema"])
    )
    trainer.run(token_batches(20), max_steps=8)
    best = min(ranked, key=ranked.get)
    kept = {step for step, _ in complete_checkpoints(tmp_path)[0]}
    assert kept == {best, 8}
    marker = read_json(os.path.join(tmp_path, step_dir_name(best), ".complete"))
    assert "val_loss_ema" in str(marker)


def test_the_section_composes_validates_by_field_and_builds_the_handler(tmp_path):
    schema = compose_config(ema=EMAConfig)
    cfg = load_run_config(overrides=[*BASE, "ema.enabled=true", "ema.decay=0.99"], schema=schema)
    assert cfg.ema == EMAConfig(enabled=True, decay=0.99)
    for override, field in [
        ("ema.decay=1.0", "ema.decay"),
        ("ema.decay=-0.1", "ema.decay"),
        ("ema.every_steps=0", "ema.every_steps"),
        ("ema.start_step=-1", "ema.start_step"),
    ]:
        with pytest.raises(ConfigError, match=f"^{field}: ") as info:
            load_run_config(overrides=[*BASE, override], schema=schema)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="^ema.decay: "):
        WeightEMA(decay=2)

    trainer = plain_trainer()
    attached = attach_handlers(
        trainer,
        cfg,
        order=[*HANDLER_ORDER, WeightEMA],
        run_dir=str(tmp_path),
        dataloader=token_batches(4),
        dp_size=1,
    )
    ema = next(h for h in attached if isinstance(h, WeightEMA))
    assert ema.decay == 0.99 and trainer.get_handler(WeightEMA) is ema
    off = load_run_config(overrides=BASE, schema=schema)
    assert not any(
        isinstance(h, WeightEMA)
        for h in attach_handlers(
            plain_trainer(),
            off,
            order=[*HANDLER_ORDER, WeightEMA],
            run_dir=str(tmp_path),
            dataloader=token_batches(4),
            dp_size=1,
        )
    )


def test_nan_vetoes_and_the_rollback_leave_the_average_as_the_good_steps_made_it(tmp_path):
    """Steps 5 and 6 have a NaN loss: vetoed (they never enter the average), then, two in a row,
    a rollback to the checkpoint of step 4, which restores the average saved with it."""
    from hookloop.handlers.nan_detector import NaNDetector

    ref: dict = {}

    def loss_fn(out, y):
        loss = cross_entropy_loss(out, y)
        poisoned = ref["t"].state.step in (5, 6) and not ref["t"].state.rollbacks
        return loss * float("nan") if poisoned else loss

    model = tiny_gpt(0)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn)
    ref["t"] = trainer
    ema = WeightEMA(decay=0.7).attach(trainer)
    AsyncCheckpointer(tmp_path).attach(trainer)
    NaNDetector(max_consecutive=2, action="rollback").attach(trainer)
    save_every(trainer, 4)
    seen: dict = {}

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE - 900)
    def _remember(engine):
        if engine.state.step == 4 and "at_save" not in seen:
            seen["at_save"] = average(ema)
        if engine.state.step in (5, 6) and not engine.state.rollbacks:
            seen.setdefault("vetoed", []).append(
                all(torch.equal(a, b) for a, b in zip(average(ema).values(), seen["at_save"].values()))
            )

    @trainer.on(Events.ROLLBACK, priority=Priority.RESTORE - 1)
    def _restored(engine):
        seen["restored"] = average(ema)

    state = trainer.run(token_batches(20), max_steps=8)
    assert state.rollbacks == 1 and state.skipped_steps == 2
    assert seen["vetoed"] == [True, True]  # the vetoed steps left the average as step 4 made it
    assert_bitwise(seen["restored"], seen["at_save"])
    assert all(torch.isfinite(v).all() for v in ema.average.values())


def test_one_average_per_trainer_and_suffixes_are_names():
    trainer = plain_trainer()
    WeightEMA().attach(trainer)
    with pytest.raises(ValueError, match="suffix 'ema' are validated already"):
        WeightEMA().attach(trainer)
    with pytest.raises(ValueError, match="letters, digits and underscores"):
        trainer.validator.add_weights("e-m-a", lambda: None)


def test_without_an_average_in_the_checkpoint_it_starts_from_the_loaded_weights(tmp_path):
    first = plain_trainer()
    AsyncCheckpointer(tmp_path / "a").attach(first)
    first.run(token_batches(8), max_steps=2)  # no average in this checkpoint
    for kind in ("resume", "finetune_from"):
        trainer = plain_trainer(seed=3)
        ema = WeightEMA().attach(trainer)
        where = (
            {"resume": tmp_path / "a"}
            if kind == "resume"
            else {"resume": None, "finetune_from": tmp_path / "a"}
        )
        AsyncCheckpointer(tmp_path / kind, **where).attach(trainer)
        seen = {}
        trainer.add_event_handler(
            Events.TRAIN_START,
            lambda e, seen=seen, ema=ema: seen.update(weights=weights(e), average=average(ema)),
            priority=Priority.OBSERVE,
        )
        trainer.run(token_batches(8), max_steps=3)
        assert_bitwise(seen["average"], seen["weights"])
        assert_bitwise(seen["weights"], weights(first))


def test_checkpoint_metric_may_rank_by_the_average_s_validation_when_the_average_is_on():
    ranked = [
        "checkpoint.keep_best=1",
        "lr.decay_style=constant",
        "validation.metrics.accuracy=hookloop.engine:TokenAccuracy",
    ]
    for metric in ("val_loss_ema", "val_accuracy_ema"):
        cfg = load_run_config(None, [*ranked, "ema.enabled=true", f"checkpoint.metric={metric}"])
        assert cfg.checkpoint.metric == metric
    with pytest.raises(ConfigError, match="checkpoint.metric: 'val_loss_ema' is not a metric") as info:
        load_run_config(None, [*ranked, "checkpoint.metric=val_loss_ema"])  # no average, no such metric
    assert "\n" not in str(info.value)
