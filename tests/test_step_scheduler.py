"""StepScheduler: derived limits, start positions, and as a trainer handler
(published flags, loss average, GC, exit interval / duration, stop signals in 1 and 2 processes)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import time

import pytest
import torch

from hookloop.engine import ConfigError, Events, ExitCode, Priority, Trainer
from hookloop.handlers.step_scheduler import StepScheduler, StepSchedulerConfig
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import REPO, free_port
from tests.forked import start_forked

SIGNAL_SCRIPT = REPO / "tests" / "scripts" / "step_scheduler_signal.py"


class Stream:
    """An iterable without a length, like a loader over an IterableDataset."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_derived_limits_and_defaults():
    s = StepScheduler(8, 2, 2, list(range(10)), max_steps=7, stop_signals=None)  # 2 per step: 5 steps/epoch
    assert (s.grad_acc_steps, s.epoch_len, s.num_epochs, s.ckpt_every_steps) == (2, 5, 2, None)
    s = StepScheduler(8, 2, 2, list(range(10)), num_epochs=3, stop_signals=None)
    assert s.max_steps == 15
    s = StepScheduler(4, 2, 2, Stream(range(10)), max_steps=9, stop_signals=None)
    assert (s.epoch_len, s.num_epochs, s.ckpt_every_steps) == (None, 10, None)


def test_start_position_must_lie_in_its_epoch():
    with pytest.raises(ConfigError, match="start_step.*start_epoch=2"):
        StepScheduler(1, 1, 1, list(range(4)), start_step=9, start_epoch=0, stop_signals=None)
    s = StepScheduler(1, 1, 1, list(range(4)), start_step=8, start_epoch=1, stop_signals=None)  # epoch 1 done
    assert (s.step, s.epoch) == (8, 2)
    with pytest.raises(ConfigError, match="state_dict\\['step'\\]"):
        s.load_state_dict({"step": 3, "epoch": 2})
    with pytest.raises(ValueError, match="no 'epoch'.*needs 'step' and 'epoch'"):
        s.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="must be a mapping"):
        s.load_state_dict([3, 0])


# ---------------------------------------------------------------------------------------- trainer


def make_trainer(seed=0):
    model = tiny_gpt(seed, n_layers=1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cross_entropy_loss)


def record_flags(trainer, into):
    @trainer.on(Events.STEP_START)  # normal priority: after the scheduler asked and published
    def _record():
        s, c = trainer.state, trainer.control
        into.append((s.step, c.save, c.validate, trainer.at_last_step))


def test_attached_scheduler_drives_the_trainer_and_publishes_each_steps_decisions():
    data = token_batches(10)  # 3 per step: epochs of 4 steps, the last with one microbatch
    trainer = make_trainer()
    s = StepScheduler(
        6,
        2,
        1,
        data,
        ckpt_every_steps=3,
        val_every_steps=5,
        loss_average_window_steps=3,
        num_epochs=2,
        stop_signals=None,
    )
    s.attach(trainer)
    assert (trainer.grad_accum_steps, trainer.max_steps, trainer.max_epochs) == (3, 8, 2)
    assert trainer.stateful["step_scheduler"] is s
    flags, losses, sizes, positions = [], [], [], []
    record_flags(trainer, flags)
    trainer.add_event_handler(Events.STEP_START, lambda: sizes.append(len(trainer.state.batch)))
    trainer.add_event_handler(Events.STEP_START, lambda: positions.append((s.step, s.epoch)))

    @trainer.on(Events.STEP_END)
    def _loss():
        losses.append((trainer.state.loss, trainer.state.metrics["loss_avg"]))

    state = trainer.run(data)
    assert state.step == 8 and state.control.exit_code == ExitCode.SUCCESS
    assert sizes == [3, 3, 3, 1] * 2
    assert positions == [(k, (k - 1) // 4) for k in range(1, 9)]
    assert flags == [
        # step, checkpoint, validate, last step: validation every 5 steps and at the last, not on
        # checkpoint steps (one key per cadence)
        (1, False, False, False),
        (2, False, False, False),
        (3, True, False, False),
        (4, True, False, False),  # end of epoch 0
        (5, False, True, False),
        (6, True, False, False),
        (7, False, False, False),
        (8, True, True, True),
    ]
    for i, (_loss_k, avg) in enumerate(losses):
        window = [x for x, _ in losses[max(0, i - 2) : i + 1]]
        assert avg == pytest.approx(sum(window) / len(window))
    assert s.state_dict() == {"step": 8, "epoch": 2, "loss_window": [x for x, _ in losses[-3:]]}
    assert not (trainer.control.save or trainer.control.validate)  # the step's requests reset


def test_the_scheduler_says_which_setting_asked_for_each_save():
    data = token_batches(10)  # 3 per step: epochs of 4 steps
    trainer = make_trainer()
    StepScheduler(6, 2, 1, data, ckpt_every_steps=3, num_epochs=2, stop_signals=None).attach(trainer)
    asked = {}

    @trainer.on(Events.STEP_START)
    def _record():
        if trainer.control.save:
            asked[trainer.state.step] = trainer.control.save_by

    trainer.run(data)
    cadence = ("step_scheduler.ckpt_every_steps=3",)
    epoch_end = ("step_scheduler.save_checkpoint_every_epoch",)
    assert asked == {3: cadence, 4: epoch_end, 6: cadence, 8: ("last step",)}


@pytest.mark.parametrize("restored_by", ["scheduler", "checkpoint_handler"])
def test_attached_resume_mid_epoch_continues_flags_and_data(restored_by):
    data = token_batches(10)  # 3 per step: 4 steps per epoch

    def run(checkpoint=None, **kwargs):
        trainer = make_trainer()
        s = StepScheduler(6, 2, 1, data, ckpt_every_steps=3, num_epochs=3, stop_signals=None, **kwargs)
        if checkpoint is not None and restored_by == "scheduler":
            s.load_state_dict(checkpoint["scheduler"])  # fresh trainer: the scheduler moves it there

        @trainer.on(Events.TRAIN_START, priority=Priority.RESTORE)  # what a checkpoint handler does, first
        def _restore():
            if checkpoint is not None and restored_by == "checkpoint_handler":
                trainer.state.load_counters(checkpoint["counters"])
                for key, obj in trainer.stateful.items():
                    obj.load_state_dict(checkpoint[key])
                trainer.step_data.skip_next = checkpoint["microbatches_into_epoch"]

        s.attach(trainer)
        rows = []
        record_flags(trainer, rows)
        trainer.add_event_handler(
            Events.STEP_START, lambda: rows.append((s.step, s.epoch, int(trainer.state.batch[0][0].sum())))
        )
        state = trainer.run(data)
        saved = {
            "scheduler": s.state_dict(),
            "step_scheduler": s.state_dict(),
            "counters": state.counters(),
            "microbatches_into_epoch": (state.step % 4) * 3,
        }
        return state, saved, rows

    _, _, full_rows = run()
    stopped, saved, _ = run(exit_interval=6)  # stops after step 6, in the middle of epoch 1
    assert (stopped.step, stopped.control.exit_code) == (6, ExitCode.STOPPED)
    assert {k: saved["scheduler"][k] for k in ("step", "epoch")} == {"step": 6, "epoch": 1}
    state, _, rows = run(saved)
    assert (state.step, state.epoch, state.control.exit_code) == (12, 3, ExitCode.SUCCESS)
    # the same decisions, epochs and microbatches as the uninterrupted run: nothing replayed
    assert rows == full_rows[12:]


def test_gc_is_manual_during_training_and_restored_after():
    data = token_batches(6)
    collected_at = []
    trainer = make_trainer()
    StepScheduler(2, 2, 1, data, gc_every_steps=2, num_epochs=1, stop_signals=None).attach(trainer)
    enabled_during = []
    trainer.add_event_handler(Events.STEP_END, lambda: enabled_during.append(gc.isenabled()))

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            collected_at.append(trainer.state.step)

    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        trainer.run(data)
    finally:
        gc.callbacks.remove(on_gc)
    assert enabled_during == [False] * 6
    assert collected_at == [2, 4, 6]
    assert gc.isenabled()

    trainer = make_trainer()
    StepScheduler(2, 2, 1, data, gc_every_steps=2, num_epochs=1, stop_signals=None).attach(trainer)

    def boom():
        if trainer.state.step == 2:
            raise RuntimeError("boom")

    trainer.add_event_handler(Events.STEP_END, boom)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.run(data)
    assert gc.isenabled()


def test_exit_interval_stops_with_a_checkpoint_request_on_that_step():
    data = token_batches(20)
    trainer = make_trainer()
    s = StepScheduler(2, 2, 1, data, exit_interval=4, ckpt_every_steps=100, num_epochs=1, stop_signals=None)
    s.attach(trainer)
    flags = []
    record_flags(trainer, flags)
    state = trainer.run(data)
    assert (state.step, state.control.exit_code, state.control.stop) == (4, ExitCode.STOPPED, True)
    assert [f[0] for f in flags if f[1]] == [4]
    assert "exit_interval" in state.control.stop_reason


def test_exit_duration_stops_on_the_first_step_past_the_limit():
    data = token_batches(20)
    trainer = make_trainer()
    s = StepScheduler(
        2, 2, 1, data, exit_duration_in_mins=1e-9, val_every_steps=1, num_epochs=1, stop_signals=None
    )
    s.attach(trainer)
    trainer.set_validation(data[:1])
    checkpoint_flags, validated = [], []
    trainer.add_event_handler(Events.STEP_END, lambda: checkpoint_flags.append(trainer.control.decided.save))
    trainer.add_event_handler(Events.VALIDATION_END, lambda: validated.append(trainer.state.step))
    state = trainer.run(data)
    assert (state.step, state.control.exit_code) == (1, ExitCode.STOPPED)
    assert checkpoint_flags == [True] and validated == []  # no validation when time is up
    assert "exit_duration_in_mins" in state.control.stop_reason


@pytest.mark.parametrize("signal_step, expected_exit", [(2, ExitCode.STOPPED), (5, ExitCode.SUCCESS)])
def test_signal_in_one_process_stops_after_that_step(signal_step, expected_exit):
    data = token_batches(5)
    trainer = make_trainer()
    s = StepScheduler(
        2, 2, 1, data, val_every_steps=1, ckpt_every_steps=100, num_epochs=1, stop_signals="SIGUSR2"
    )
    s.attach(trainer)
    trainer.set_validation(data[:1])
    seen, validated, during = [], [], []
    previous = signal.getsignal(signal.SIGUSR2)

    @trainer.on(Events.MICROBATCH)
    def _send():
        during.append(signal.getsignal(signal.SIGUSR2))
        if trainer.state.step == signal_step:
            os.kill(os.getpid(), signal.SIGUSR2)

    trainer.add_event_handler(Events.VALIDATION_END, lambda: validated.append(trainer.state.step))
    trainer.add_event_handler(
        Events.STEP_END, lambda: seen.append((trainer.state.step, trainer.control.decided.save))
    )
    state = trainer.run(data)
    assert state.step == signal_step and state.control.exit_code == expected_exit
    assert seen[-1] == (signal_step, True)
    assert not any(flag for _, flag in seen[:-1])
    assert validated == list(range(1, signal_step))  # the stopping step skips its validation
    assert during[0] is not previous and signal.getsignal(signal.SIGUSR2) is previous
    if expected_exit == ExitCode.STOPPED:
        assert state.control.stop_reason == "signal SIGUSR2" and s.sigterm_received


def test_trainer_settings_that_disagree_with_the_scheduler_are_refused():
    data = token_batches(4)
    trainer = make_trainer()
    StepScheduler(2, 2, 1, data, num_epochs=1, stop_signals=None).attach(trainer)
    with pytest.raises(ConfigError, match="max_steps.*set it on the StepScheduler"):
        trainer.run(data, max_steps=2)
    trainer = make_trainer()
    StepScheduler(2, 2, 1, data, num_epochs=1, stop_signals=None).attach(trainer)
    with pytest.raises(ConfigError, match="dataloader"):
        trainer.run(token_batches(6))


# ---------------------------------------------------------------------------------------- bad input

BASE = dict(global_batch_size=4, local_batch_size=1, dp_size=2, dataloader=list(range(8)))


@pytest.mark.parametrize(
    "field, value",
    [
        ("global_batch_size", 5),  # not a multiple of local_batch_size * dp_size
        ("global_batch_size", 0),
        ("local_batch_size", 0),
        ("dp_size", -1),
        ("ckpt_every_steps", 0),
        ("val_every_steps", -2),
        ("loss_average_window_steps", 0),
        ("gc_every_steps", 0),
        ("start_step", -1),
        ("start_epoch", 1.5),
        ("num_epochs", 0),
        ("max_steps", 0),
        ("exit_interval", 0),
        ("exit_duration_in_mins", -1.0),
        ("stop_signals", ["SIGNOPE"]),
        ("stop_signals", "SIGKILL"),
        ("save_checkpoint_every_epoch", "yes"),
        ("dataloader", []),
        ("dataloader", 3),
    ],
)
def test_bad_input_names_the_argument(field, value):
    with pytest.raises(ConfigError) as info:
        StepScheduler(**{**BASE, field: value})
    assert info.value.field == field


def test_no_length_and_no_max_steps_is_an_error():
    with pytest.raises(ConfigError, match="max_steps.*no length"):
        StepScheduler(1, 1, 1, Stream([1, 2]))


def test_config_section_builds_the_scheduler():
    cfg = StepSchedulerConfig(global_batch_size=8, num_epochs=2, ckpt_every_steps=3, exit_interval=5)
    s = StepScheduler.from_config(cfg, dataloader=list(range(12)), dp_size=2, local_batch_size=2)
    assert (s.grad_acc_steps, s.epoch_len, s.max_steps, s.exit_interval) == (2, 6, 12, 5)
    assert s.stop_signals == (signal.SIGTERM,)


# ---------------------------------------------------------------------------------------- 2 processes


def kill_groups(procs):
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def read_records(path):
    """The complete JSON lines written so far (a line still being written is left out)."""
    return [
        json.loads(x) for x in path.read_text().splitlines(keepends=True) if x.endswith("\n") and x.strip()
    ]


def launch_two_ranks(tmp_path, args, *, external_signal_after_step=None, timeout=90.0):
    """Start the signal script as 2 ranks (torchrun's environment, no agent in between, so each
    process's own exit code is seen); output goes to files, so no pipe can fill and block a rank.
    Returns [(exit code, JSON records, stderr)] per rank; kills both on ``timeout``."""
    port = free_port()
    procs, outs, errs = [], [], []
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
            }
            outs.append(tmp_path / f"rank{rank}.out")
            errs.append(tmp_path / f"rank{rank}.err")
            cmd = [sys.executable, str(SIGNAL_SCRIPT), *args]
            procs.append(start_forked(cmd, env=env, cwd=REPO, stdout=outs[-1], stderr=errs[-1]))
        deadline = time.monotonic() + timeout
        if external_signal_after_step is not None:  # rank 1 announces each finished step
            while not any(
                r.get("step") == external_signal_after_step and not r.get("final")
                for r in read_records(outs[1])
            ):
                assert procs[1].poll() is None, f"rank 1 ended before step {external_signal_after_step}"
                assert time.monotonic() < deadline, "rank 1 did not reach the signal step in time"
                time.sleep(0.02)
            os.kill(procs[1].pid, signal.SIGTERM)
        results = []
        for rank, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, read_records(outs[rank]), errs[rank].read_text()))
        return results
    finally:
        kill_groups([p for p in procs if p.poll() is None])
        for p in procs:
            p.wait(timeout=10)


def check_agreed_stop(results, stop_step):
    for rank, (code, records, err) in enumerate(results):
        assert code == ExitCode.STOPPED, f"rank {rank} exited {code}:\n{err[-3000:]}"
        steps = [r for r in records if not r.get("final")]
        final = records[-1]
        assert final["final"] and final["step"] == stop_step and final["exit_code"] == ExitCode.STOPPED
        assert final["stop_reason"] == "signal SIGTERM" and final["handler_restored"]
        assert [r["step"] for r in steps] == list(range(1, stop_step + 1))
        assert [r["decided_save"] for r in steps] == [False] * (stop_step - 1) + [True]
        assert steps[-1]["decided_stop"] and not steps[-1]["validated"]
        assert all(r["validated"] for r in steps[:-1])


def test_two_processes_signal_to_one_rank_stops_both_after_the_same_step(tmp_path):
    results = launch_two_ranks(
        tmp_path, ["--mode", "self", "--signal-rank", "1", "--signal-step", "3", "--max-steps", "8"]
    )
    check_agreed_stop(results, 3)
    assert results[0][1][-2]["loss_avg"] == pytest.approx(results[1][1][-2]["loss_avg"])


def test_two_processes_signal_from_outside_stops_both_after_the_same_step(tmp_path):
    results = launch_two_ranks(
        tmp_path,
        ["--mode", "external", "--max-steps", "40", "--step-sleep", "0.05"],
        external_signal_after_step=2,
    )
    stop_step = results[1][1][-1]["step"]
    assert 3 <= stop_step < 40
    check_agreed_stop(results, stop_step)


def test_attach_refuses_an_explicit_trainer_grad_accum_steps_that_disagrees():
    data = token_batches(8)
    model = tiny_gpt(0, n_layers=1)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), cross_entropy_loss, grad_accum_steps=2
    )
    s = StepScheduler(8, 2, 1, data, num_epochs=1, stop_signals=None)  # 4 microbatches per step
    with pytest.raises(ConfigError, match="grad_accum_steps") as info:
        s.attach(trainer)
    message = str(info.value)
    assert "grad_accum_steps=2" in message and "computes 4" in message and "global_batch_size" in message
    assert trainer.grad_accum_steps == 2  # left as the user built it


def test_attach_accepts_an_explicit_trainer_grad_accum_steps_that_agrees():
    data = token_batches(8)
    model = tiny_gpt(0, n_layers=1)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), cross_entropy_loss, grad_accum_steps=4
    )
    StepScheduler(8, 2, 1, data, num_epochs=1, stop_signals=None).attach(trainer)
    assert trainer.grad_accum_steps == 4
    assert trainer.run(data).step == 2


def _loss_avg_run(directory, stop_at=None):
    """Train 10 steps with a StepScheduler (window 4) and an AsyncCheckpointer in ``directory``;
    returns the final state and the loss_avg of every step."""
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    torch.manual_seed(0)
    data = token_batches(12)  # 2 per step: 6 steps per epoch
    trainer = make_trainer()
    s = StepScheduler(
        4, 2, 1, data, ckpt_every_steps=3, max_steps=10, loss_average_window_steps=4, stop_signals=None
    )
    s.attach(trainer)
    AsyncCheckpointer(directory, mode="sync").attach(trainer)
    averages = {}

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE)
    def _record():
        averages[trainer.state.step] = float(trainer.state.metrics["loss_avg"])  # may be a 0-dim tensor
        if trainer.state.step == stop_at:
            trainer.control.request_stop("test stop", ExitCode.STOPPED)

    return trainer.run(data), averages


def test_resumed_run_continues_the_loss_average(tmp_path, deterministic):
    full, expected = _loss_avg_run(tmp_path / "full")
    stopped, _ = _loss_avg_run(tmp_path / "run", stop_at=6)
    assert (stopped.step, stopped.control.exit_code) == (6, ExitCode.STOPPED)
    resumed, averages = _loss_avg_run(tmp_path / "run")
    assert (full.step, resumed.step) == (10, 10)
    assert min(averages) == 7  # it resumed after step 6
    assert averages[7] == pytest.approx(expected[7], abs=1e-12, rel=0)
    assert averages[10] == pytest.approx(expected[10], abs=1e-12, rel=0)


def test_a_state_without_a_loss_window_still_loads():
    s = StepScheduler(2, 1, 1, list(range(6)), max_steps=6, stop_signals=None)
    s.record_loss(1.0)
    s.load_state_dict({"step": 2, "epoch": 0})  # a checkpoint from before the window was saved
    assert s.step == 2
    s.load_state_dict({"step": 2, "epoch": 0, "loss_window": [1.0, 3.0]})
    assert s.loss_avg == 2.0
