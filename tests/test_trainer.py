"""The local step body: accumulation, veto, clipping, stopping, validation, errors."""

import copy
import math

import pytest
import torch
from ignite.contrib.handlers import ProgressBar
from ignite.handlers import EarlyStopping, Timer
from ignite.metrics import RunningAverage

from hookloop.engine import ConfigError, Events, Trainer, build_lr_scheduler
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import validate_every
from tests.conftest import tiny_gpt, token_batches


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulated_gradients_equal_full_batch_gradients():
    data = token_batches(4, batch=2)
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    captured = {}
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, grad_accum_steps=4
    )
    trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, lambda: captured.update(grads_of(model)))
    trainer.run(data, max_steps=1)
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    cross_entropy_loss(ref(x), y).backward()
    expected = grads_of(ref)
    assert captured.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(captured[name], g, atol=1e-6, rtol=0, msg=name)
    full_loss = float(cross_entropy_loss(ref(x), y).detach())
    assert trainer.state.loss == pytest.approx(full_loss, abs=1e-6)


def test_short_last_group_makes_a_step_and_max_epochs():
    model = tiny_gpt()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, grad_accum_steps=3
    )
    sizes = []
    trainer.add_event_handler(Events.STEP_START, lambda e: sizes.append(len(e.state.batch)))
    state = trainer.run(token_batches(7), max_epochs=2)
    assert sizes == [3, 3, 1, 3, 3, 1]
    assert state.step == 6 and state.epoch == 2


def test_max_steps_before_max_epochs_and_iterable_without_length():
    model = tiny_gpt()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, grad_accum_steps=2
    )
    data = token_batches(6)

    class Stream:
        def __iter__(self):
            return iter(data)

    state = trainer.run(Stream(), max_steps=5, max_epochs=10)
    assert (state.step, state.epoch) == (5, 2)
    assert state.tokens_seen == 5 * 2 * 2 * 16


def test_veto_leaves_params_and_optimizer_untouched_and_counts():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_lr_scheduler(opt, warmup_steps=2, decay_steps=10, decay_style="linear")
    trainer = Trainer(model, opt, cross_entropy_loss, lr_scheduler=sched)
    snapshots = {}

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def veto(e):
        if e.state.step == 3:
            e.control.request_skip()
            snapshots["params"] = copy.deepcopy(model.state_dict())
            snapshots["opt"] = copy.deepcopy(opt.state_dict())
            snapshots["lr_epoch"] = sched.last_epoch

    @trainer.on(Events.STEP_END)
    def check(e):
        if e.state.step == 3:
            assert e.control.decided.skip
            for k, v in model.state_dict().items():
                assert torch.equal(v, snapshots["params"][k]), k
            after = opt.state_dict()["state"]
            for idx, st in snapshots["opt"]["state"].items():
                for key, val in st.items():
                    assert torch.equal(after[idx][key], val)
            assert sched.last_epoch == snapshots["lr_epoch"]
            assert all(p.grad is None for p in model.parameters())
            snapshots["checked"] = True

    state = trainer.run(token_batches(5))
    assert snapshots["checked"]
    assert state.step == 5 and state.skipped_steps == 1
    assert sched.last_epoch == 4  # five steps, one vetoed


def test_handlers_see_unclipped_gradients_and_clipping_applies_to_the_update():
    """BEFORE_OPTIMIZER_STEP sees the gradients as backward left them: their norm is exactly
    state.grad_norm (per-layer norms add up in quadrature to it); the optimizer then steps with
    gradients clipped to grad_clip_norm."""
    model = tiny_gpt()
    seen = {}
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, grad_clip_norm=0.01
    )

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def measure(e):
        per_layer = [float(p.grad.norm()) for p in model.parameters() if p.grad is not None]
        seen["quadrature"] = math.sqrt(sum(n * n for n in per_layer))
        seen["reported"] = e.state.grad_norm
        seen["before"] = [p.detach().clone() for p in model.parameters()]

    trainer.run(token_batches(1))
    assert seen["reported"] > 0.01
    assert seen["quadrature"] == pytest.approx(seen["reported"], rel=1e-5)
    update = math.sqrt(
        sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(model.parameters(), seen["before"]))
    )
    assert update == pytest.approx(0.1 * 0.01, rel=1e-3)  # SGD: lr x the clipped norm


def test_a_stop_request_ends_the_run_after_that_step():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    trainer.add_event_handler(Events.STEP_END(once=2), lambda e: e.control.request_stop("test", 75))
    ended = []
    trainer.add_event_handler(Events.TRAIN_END, lambda e: ended.append(e.state.step))
    state = trainer.run(token_batches(6))
    assert state.step == 2 and state.control.exit_code == 75 and state.control.stop_reason == "test"
    assert ended == [2]


def test_flags_are_cleared_after_each_step():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    seen = []
    trainer.add_event_handler(Events.STEP_START(once=1), lambda e: e.control.request_save())
    trainer.add_event_handler(Events.STEP_START, lambda e: seen.append(e.control.save), priority=-1)
    trainer.run(token_batches(3))
    assert seen == [True, False, False]


def test_validation_runs_on_request_and_fires_event():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    val = token_batches(3, seed=1)
    trainer.set_validation(val, eval_iters=2)
    validate_every(trainer, 2)
    got = []
    trainer.add_event_handler(
        Events.VALIDATION_END, lambda e: got.append((e.state.step, e.state.metrics["val_loss"]))
    )
    trainer.run(token_batches(4))
    assert [s for s, _ in got] == [2, 4]
    with torch.no_grad():
        model.eval()
        expected = sum(float(cross_entropy_loss(model(x), y)) for x, y in val[:2]) / 2
    assert got[-1][1] == pytest.approx(expected, rel=1e-6)
    model.train()
    trainer.validate()
    assert model.training  # validate restores the mode it found


def test_ignite_handlers_attach_unchanged():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), cross_entropy_loss)
    RunningAverage(output_transform=lambda loss: loss, alpha=0.5).attach(trainer, "avg_loss")
    timer = Timer(average=True)
    timer.attach(trainer, start=Events.TRAIN_START, step=Events.STEP_END)
    ProgressBar(persist=False, disable=True).attach(trainer, metric_names=["avg_loss"])
    stopper = EarlyStopping(
        patience=1, score_function=lambda e: -e.state.metrics["avg_loss"], trainer=trainer
    )
    trainer.add_event_handler(Events.EPOCH_END, stopper)
    losses = []
    trainer.add_event_handler(Events.STEP_END, lambda e: losses.append(e.state.loss))
    state = trainer.run(token_batches(3), max_epochs=50)
    assert math.isfinite(state.metrics["avg_loss"])
    assert timer.value() > 0
    assert state.epoch < 50  # EarlyStopping terminated the run
    expected = losses[0]
    for loss in losses[1:]:
        expected = 0.5 * expected + 0.5 * loss
    # state.output is the step's loss tensor (float32, never read to the host by the engine), so
    # RunningAverage averages in float32: equal to the float64 recurrence up to float32 rounding.
    assert state.metrics["avg_loss"] == pytest.approx(expected, rel=1e-6)


def test_exception_handlers_called_once_and_error_reraised():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    calls = []
    trainer.add_event_handler(Events.EXCEPTION, lambda e, err: calls.append(type(err).__name__))

    def boom(_e):
        raise KeyError("boom")

    def broken_handler(_e, _err):
        raise RuntimeError("handler failure must not hide the original error")

    trainer.add_event_handler(Events.EXCEPTION, broken_handler)
    trainer.add_event_handler(Events.STEP_END(once=2), boom)
    with pytest.raises(KeyError, match="boom"):
        trainer.run(token_batches(4))
    assert calls == ["KeyError"]


def test_bad_inputs_give_clear_errors():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        Trainer(model, opt, cross_entropy_loss, grad_accum_steps=0)
    with pytest.raises(ConfigError, match="grad_clip_norm"):
        Trainer(model, opt, cross_entropy_loss, grad_clip_norm=-1)
    with pytest.raises(TypeError, match="optimizer"):
        Trainer(model, "sgd", cross_entropy_loss)
    trainer = Trainer(model, opt, cross_entropy_loss)
    with pytest.raises(ValueError, match="empty"):
        trainer.run([])
    with pytest.raises(ConfigError, match="max_steps"):
        trainer.run(token_batches(1), max_steps=0)

    class EmptyStream:
        def __iter__(self):
            return iter(())

    with pytest.raises(ValueError, match="no microbatches"):
        Trainer(model, opt, cross_entropy_loss).run(EmptyStream())
    per_token = Trainer(
        model,
        opt,
        lambda out, y: torch.nn.functional.cross_entropy(
            out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none"
        ),
    )
    with pytest.raises(ValueError, match="scalar"):
        per_token.run(token_batches(1))
    with pytest.raises(TypeError, match="microbatch"):
        Trainer(model, opt, cross_entropy_loss).run([torch.zeros(3)])
