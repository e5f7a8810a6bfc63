"""The ignite behaviours hookloop relies on, pinned on a plain ignite ``Engine``.

Every private hook ``engine/ignite_adapter.py`` overrides or reads is exercised here on ignite's
own class. If an ignite release changes one, this file fails first and names what moved;
``setup.cfg`` bounds pytorch-ignite to the versions it passes on.
"""

import configparser
import weakref
from pathlib import Path

import ignite
from ignite.engine import Engine, Events
from packaging.specifiers import SpecifierSet

from hookloop.engine import ignite_adapter

REPO = Path(__file__).resolve().parents[1]


def test_installed_ignite_is_a_supported_version_and_setup_cfg_says_so():
    assert ignite.__version__ in SpecifierSet(ignite_adapter.SUPPORTED_IGNITE)
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = cfg["options"]["install_requires"]
    assert f"pytorch-ignite{ignite_adapter.SUPPORTED_IGNITE}" in requires.replace(" ", "")


def test_every_loop_event_goes_through_fire_event():
    seen = []

    class Spy(Engine):
        def _fire_event(self, event_name, *args, **kwargs):
            seen.append(event_name)
            super()._fire_event(event_name, *args, **kwargs)

    Spy(lambda e, b: None).run([1, 2], max_epochs=1)
    for event in (Events.STARTED, Events.EPOCH_STARTED, Events.ITERATION_STARTED, Events.ITERATION_COMPLETED,
                  Events.EPOCH_COMPLETED, Events.COMPLETED):  # fmt: skip
        assert event in seen, event


def test_setup_dataloader_iter_makes_each_epochs_iterator_from_state_dataloader():
    calls = []

    class Spy(Engine):
        def _setup_dataloader_iter(self):
            calls.append(self.state.dataloader)
            self._dataloader_iter = iter([b * 10 for b in self.state.dataloader])

    batches = []
    Spy(lambda e, b: batches.append(b)).run([1, 2], max_epochs=2)
    assert batches == [10, 20, 10, 20]
    assert len(calls) >= 2 and all(c == [1, 2] for c in calls)


def test_errors_reach_handle_exception_from_the_process_function_and_handlers():
    errors = []

    class Spy(Engine):
        def _handle_exception(self, e):
            errors.append(type(e).__name__)
            raise e

    engine = Spy(lambda e, b: 1 / 0)
    try:
        engine.run([1])
    except ZeroDivisionError:
        pass
    assert errors and set(errors) == {"ZeroDivisionError"}


def test_init_iter_and_dataloader_iter_position_the_loop_inside_an_epoch():
    seen = []
    engine = Engine(lambda e, b: seen.append((e.state.epoch, e.state.iteration, b)))
    engine.state.max_epochs = None

    @engine.on(Events.STARTED)
    def position(e):
        # what Trainer.resume_at does: one epoch done plus 2 steps of the next
        e.state.iteration, e.state.epoch = 6, 1
        e._init_iter = 2
        e._dataloader_iter = None

    engine.run(list(range(4)), max_epochs=2)
    assert seen[0] == (2, 7, 0)
    assert [s[1] for s in seen] == [7, 8]


def test_every_filter_is_read_as_its_number_and_other_filters_are_not():
    assert ignite_adapter.every_of(Events.ITERATION_COMPLETED(every=7).filter) == 7
    assert ignite_adapter.every_of(Events.ITERATION_COMPLETED(once=7).filter) is None
    assert ignite_adapter.every_of(Events.ITERATION_COMPLETED(event_filter=lambda e, n: True).filter) is None
    assert ignite_adapter.every_of(Events.ITERATION_COMPLETED(every=3, before=9).filter) is None


def test_filtered_events_compare_equal_to_their_member_and_registered_events_are_listed():
    filtered = Events.ITERATION_COMPLETED(every=2)
    assert filtered == Events.ITERATION_COMPLETED and hash(filtered) == hash(Events.ITERATION_COMPLETED)
    assert ignite_adapter.base_event(filtered) is Events.ITERATION_COMPLETED
    engine = Engine(lambda e, b: None)
    assert Events.ITERATION_COMPLETED in engine._allowed_events


def test_is_done_and_the_run_generator_decide_whether_run_continues():
    engine = Engine(lambda e, b: None)
    engine.run([1, 2], max_epochs=1)
    assert Engine._is_done(engine.state) and engine._internal_run_generator is None
    engine.run([1, 2], max_epochs=2)  # a larger limit continues the run
    assert engine.state.iteration == 4


def test_check_and_set_max_epochs_extends_a_run_and_refuses_to_go_below_it():
    import pytest

    engine = Engine(lambda e, b: None)
    engine.run([1, 2], max_epochs=2)
    engine._check_and_set_max_epochs(3)
    assert engine.state.max_epochs == 3
    with pytest.raises(ValueError):
        engine._check_and_set_max_epochs(1)


def test_internal_run_runs_the_loop_over_the_state_as_set():
    # Trainer.run sets the state up itself (ignite's rules plus both limits) and starts this loop
    seen = []
    engine = Engine(lambda e, b: seen.append((e.state.epoch, e.state.iteration, b)))
    engine.state.iteration = engine.state.epoch = 0
    engine.state.max_epochs, engine.state.max_iters, engine.state.epoch_length = 2, 3, 2
    engine.state.dataloader = [1, 2]
    state = engine._internal_run()
    assert seen == [(1, 1, 1), (1, 2, 2), (2, 3, 1)]  # max_iters ends the run inside epoch 2
    assert state is engine.state and engine._internal_run_generator is None


def test_event_handlers_hold_ignites_tuples_that_its_time_profilers_edit():
    from ignite.handlers import BasicTimeProfiler

    engine = Engine(lambda e, b: None)

    def takes_engine(engine):
        pass

    engine.add_event_handler(Events.ITERATION_COMPLETED, takes_engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda: None)
    (func, args, kwargs), (_, no_args, _) = engine._event_handlers[Events.ITERATION_COMPLETED]
    assert func is takes_engine and isinstance(args[0], weakref.ref) and args[0]() is engine
    assert no_args == () and kwargs == {}
    profiler = BasicTimeProfiler()
    profiler.attach(engine)
    assert engine._event_handlers[Events.STARTED][0][0] == profiler._as_first_started


def test_check_and_set_max_iters_refuses_to_go_below_the_iteration_reached():
    import pytest

    engine = Engine(lambda e, b: None)
    engine.run([1, 2, 3], max_iters=3)
    engine._check_and_set_max_iters(5)
    assert engine.state.max_iters == 5
    with pytest.raises(ValueError, match="Argument max_iters should be greater than or equal"):
        engine._check_and_set_max_iters(2)


def test_metrics_reduce_through_the_model_behind_idist_which_ignite_world_swaps_and_restores():
    """ignite's metrics reduce in ``compute()`` through ``idist`` (``sync_all_reduce``), which calls
    the computation model in ``ignite.distributed.utils._model`` (``_need_to_sync`` False: used as
    set). ``ignite_world`` installs its own there for a block and puts the previous one back."""
    import ignite.distributed as idist
    import torch
    from ignite.distributed import utils as idist_utils
    from ignite.metrics import Accuracy

    calls = []

    class Recording(ignite_adapter.GroupModel):
        def get_world_size(self):
            return 2  # pretend a peer: sync_all_reduce then reduces through _do_all_reduce

        def _do_all_reduce(self, tensor, op="SUM", group=None):
            calls.append(op)
            return tensor * 2

    before = idist_utils._model, idist_utils._need_to_sync
    accuracy = Accuracy()
    accuracy.update((torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0])))
    saved = idist_utils._model, idist_utils._need_to_sync
    idist_utils._model, idist_utils._need_to_sync = Recording(None), False
    try:
        assert idist.get_world_size() == 2
        assert accuracy.compute() == 0.5  # both counts doubled: the ratio stays
    finally:
        idist_utils._model, idist_utils._need_to_sync = saved
    assert calls == ["SUM", "SUM"]  # _num_correct and _num_examples
    with ignite_adapter.ignite_world(None) as model:
        assert idist_utils._model is model and idist.get_world_size() == 1 and idist.get_rank() == 0
        assert idist.all_reduce(3.0) == 3.0 and idist.all_gather(torch.tensor(2)).tolist() == [2]
        assert idist.broadcast(5.0, src=0) == 5.0
    assert (idist_utils._model, idist_utils._need_to_sync) == before
