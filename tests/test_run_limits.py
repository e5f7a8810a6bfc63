"""``engine.run_limits``: ``run()``'s argument checks and the state set-up, on a bare Trainer without
running a step."""

import pytest
import torch

from hookloop.engine import ConfigError, Trainer
from hookloop.engine.run_limits import check_limit_kind, check_run_arguments, set_up_run
from hookloop.engine.state import TrainState


def bare_trainer(accum: int = 1) -> Trainer:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(
        model, optimizer, torch.nn.functional.mse_loss, grad_accum_steps=accum, hang_timeout_s=None
    )


def test_max_iters_is_max_steps_under_ignites_rules():
    assert check_run_arguments([1], None, None, None, 5) == (5, "max_steps")
    assert check_run_arguments([1], None, 5, None, None) == (5, "max_iters")
    assert check_run_arguments([1], None, 5, None, 5) == (5, "max_iters")
    with pytest.raises(ConfigError, match="contradicts max_steps"):
        check_run_arguments([1], None, 5, None, 6)
    with pytest.raises(ValueError, match="mutually exclusive"):
        check_run_arguments([1], 2, 5, None, None)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"data": 3}, TypeError, "Argument data should be iterable"),
        ({"data": []}, ValueError, "Input data has zero size"),
        ({"epoch_length": 0}, ConfigError, "Input data has zero size"),
        ({"max_epochs": 0}, ConfigError, "Argument max_epochs is invalid"),
        ({"max_steps": True}, ConfigError, "must be a positive integer"),
        ({"max_iters": 1.5}, ConfigError, "max_iters.*must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused_in_ignites_words(kwargs, error, match):
    args = {"data": [1], "max_epochs": None, "max_iters": None, "epoch_length": None, "max_steps": None}
    with pytest.raises(error, match=match):
        check_run_arguments(**{**args, **kwargs})


def test_a_run_keeps_its_kind_of_limit_unless_it_has_both():
    state = TrainState()
    state.max_epochs = 2
    with pytest.raises(ValueError, match="To switch from max_epochs to max_iters"):
        check_limit_kind(state, 5, None)
    state.max_epochs, state.max_iters = None, 5
    with pytest.raises(ValueError, match="To switch from max_iters to max_epochs"):
        check_limit_kind(state, None, 2)
    state.max_epochs = 2
    check_limit_kind(state, 5, 3)  # both: either may be extended


def test_a_new_run_takes_the_trainers_defaults_and_the_datas_steps_per_pass():
    trainer = bare_trainer(accum=2)
    trainer.max_steps = 7
    assert set_up_run(trainer, list(range(6))) is False
    state = trainer.state
    assert (state.max_iters, state.max_epochs, state.epoch_length) == (7, None, 3)
    assert trainer.step_data.data == list(range(6))
    trainer = bare_trainer()
    assert set_up_run(trainer, [1, 2]) is False
    assert (trainer.state.max_iters, trainer.state.max_epochs) == (None, 1)  # ignite's default


def test_an_unfinished_run_continues_and_is_extended_through_ignites_check():
    trainer = bare_trainer()
    trainer.load_state_dict({"iteration": 4, "max_iters": 6, "epoch_length": 3})
    assert set_up_run(trainer, [1, 2, 3], max_steps=8) is True
    assert trainer.state.max_iters == 8
    with pytest.raises(ValueError, match=r"Argument max_steps should be greater .* 3 vs 4"):
        set_up_run(trainer, [1, 2, 3], max_steps=3)
    with pytest.raises(ValueError, match=r"Argument max_iters should be greater .* 2 vs 4"):
        set_up_run(trainer, [1, 2, 3], max_iters=2)
    with pytest.raises(ValueError, match="Argument epoch_length should be same as in the state"):
        set_up_run(trainer, [1, 2, 3], epoch_length=2)


def test_a_run_without_data_needs_an_epoch_length():
    with pytest.raises(ValueError, match="epoch_length should be provided if data is None"):
        set_up_run(bare_trainer(), None)
    trainer = bare_trainer()
    assert set_up_run(trainer, None, epoch_length=4) is False
    assert (trainer.state.epoch_length, trainer.state.max_epochs) == (4, 1)


def test_epoch_bounds_stop_a_step_limited_run_after_two_empty_epochs():
    trainer = bare_trainer()
    state, bounds = trainer.state, trainer.plan
    state.max_iters, state.max_epochs, state.iteration, state.epoch = 10, None, 4, 1
    bounds.start_run()
    bounds.epoch_started()
    bounds.epoch_ended()  # the first empty epoch: the data may come back
    assert not trainer.control.stop
    state.epoch = 2
    bounds.epoch_started()
    bounds.epoch_ended()
    assert trainer.control.stop
    assert "epochs 1 and 2 started no step and only max_steps=10" in trainer.control.stop_reason


def test_epoch_bounds_keep_a_smaller_epoch_limit_once_the_epoch_length_is_known():
    trainer = bare_trainer()
    state, bounds = trainer.state, trainer.plan
    state.max_iters, state.max_epochs, state.epoch_length = 100, 2, None
    bounds.run_set_up()
    state.epoch_length, state.max_epochs, state.iteration = 10, 10, 10  # as ignite sets it
    bounds.epoch_ended()
    assert state.max_epochs == 2 and not trainer.control.stop


def test_no_handler_writes_the_run_limits_or_position():
    """The run plan is the one owner of the run's limits and position: no shipped handler assigns
        the trainer's limits or accumulation, the data's skip count, or the state's step and epoch (the
    step scheduler wrote all of them before the run plan)."""
    import ast
    from pathlib import Path

    def sub_attr(node: ast.AST) -> str | None:
        return node.attr if isinstance(node, ast.Attribute) else None

    owned = {"max_steps", "max_epochs", "grad_accum_steps", "skip_next", "iteration", "epoch"}
    writers = []
    for path in sorted((Path(__file__).resolve().parents[1] / "handlers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets if isinstance(node, (ast.Assign, ast.AugAssign)) else []:
                for sub in ast.walk(target):
                    written = ast.unparse(sub) if isinstance(sub, ast.Attribute) else ""
                    if sub_attr(sub) in owned and ("trainer" in written or written.startswith("state.")):
                        writers.append(f"{path.name}:{node.lineno} {ast.unparse(sub)}")
    assert writers == []
