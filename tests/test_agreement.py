"""The step's one agreement: what every rank must decide alike travels in one all-reduce.

Each two-rank test asks for something on one rank only, at the worst moment for it (before the
agreement, after it, with conflicting exit codes, a save asked for late), and checks that both
ranks did the same thing at the same step. The single-process tests check that a step nobody
reads costs no host read of the loss or gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hookloop.engine import Events, ExitCode, Priority, Trainer
from hookloop.engine.agreement import StepAgreement, agreed_exit_code, exit_code_votes, pack
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import run_distributed


def _trainer(rank: int = 0, **kwargs) -> Trainer:
    from hookloop.models.gpt import cross_entropy_loss

    model = tiny_gpt()
    if torch.distributed.is_initialized():
        from hookloop.engine import wrap_data_parallel

        model = wrap_data_parallel(model, "ddp")
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, **kwargs)


def _init() -> None:
    from hookloop.engine import init_distributed

    init_distributed()


# ------------------------------------------------------------------------------ pure functions
def test_exit_code_votes_pick_the_largest_code_any_rank_asked_for():
    votes = [a + b for a, b in zip(exit_code_votes(75), exit_code_votes(76))]
    assert agreed_exit_code(votes) == 76
    assert agreed_exit_code(exit_code_votes(0)) == 0
    custom = [a + b for a, b in zip(exit_code_votes(42), exit_code_votes(0))]
    assert agreed_exit_code(custom) == 42  # a code of the user's own travels too
    assert agreed_exit_code([a + b for a, b in zip(exit_code_votes(42), exit_code_votes(77))]) == 77


def test_on_a_gpu_the_host_numbers_take_a_cpu_group_and_the_step_values_stay_on_the_device(monkeypatch):
    # No GPU here: the meta device stands in for it (reading a meta tensor raises), and the two
    # all-reduces are recorded instead of run (two ranks that voted alike: the sums are twice the values).
    from hookloop.engine import agreement, parallel

    reduced: list[tuple[str, object]] = []
    cpu_group = object()
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    monkeypatch.setattr(parallel, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(agreement, "_host_group", lambda: cpu_group)
    monkeypatch.setattr(
        agreement.dist,
        "all_reduce",
        lambda t, op=None, group=None: (reduced.append((t.device.type, group)), t.mul_(2)),
    )
    loss, norm = torch.ones((), device="meta"), torch.ones((), device="meta")
    out = agreement.sum_over_ranks([loss, norm, 5, True, 0.5], keep=2)
    assert out[2:] == [10.0, 2.0, 1.0]  # the host numbers' sums, read from host memory
    assert all(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in out[:2])  # unread
    assert reduced == [("meta", None), ("cpu", cpu_group)]
    with pytest.raises(NotImplementedError):  # a tensor after ``keep`` is read: on a GPU, the step waits
        agreement.sum_over_ranks([loss, torch.ones((), device="meta"), 1], keep=1)


def test_pack_mixes_host_numbers_and_tensors_in_place_without_reading():
    t = torch.tensor(2.5)
    counted = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        packed = pack([1, t, True, torch.tensor(3, dtype=torch.int64), 0.5], torch.device("cpu"))
    assert torch.ops.aten._local_scalar_dense.default not in counted
    assert packed.tolist() == [1.0, 2.5, 1.0, 3.0, 0.5]


def test_slot_names_are_unique_and_callables_checked():
    agreement = StepAgreement()
    agreement.add("a", lambda: 1)
    with pytest.raises(ValueError, match="already has a slot named 'a'"):
        agreement.add("a", lambda: 2)
    with pytest.raises(TypeError, match="callables"):
        agreement.add("b", 3)
    with pytest.raises(ValueError, match="non-empty name"):
        agreement.add("", lambda: 1)


# ------------------------------------------------------------------------------ one process
class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_step_nobody_reads_reads_nothing_and_reading_gives_the_numbers():
    """SGD has no scalar reads of its own: any read in these steps is the engine's."""
    trainer = _trainer(grad_accum_steps=2, grad_clip_norm=1.0, hang_timeout_s=None)
    reads = _ScalarReads()
    with reads:
        state = trainer.run(token_batches(8), max_steps=4)
    assert reads.n == 0
    held = state.peek("loss")
    assert isinstance(held, torch.Tensor)
    assert state.loss == pytest.approx(float(held)) and isinstance(state.loss, float)
    assert isinstance(state.peek("loss"), float)  # read once, then kept as the number
    assert math.isfinite(state.grad_norm) and state.grad_norm > 0
    with pytest.raises(AttributeError, match="not a step value"):
        state.peek("step")


def test_a_handler_reading_the_loss_pays_one_read_per_value_it_reads():
    trainer = _trainer(grad_accum_steps=2, hang_timeout_s=None)
    trainer.add_event_handler(Events.STEP_END, lambda e: e.state.loss)
    reads = _ScalarReads()
    with reads:
        trainer.run(token_batches(8), max_steps=4)
    assert reads.n == 4


def test_a_slot_votes_and_its_callback_can_veto_the_step():
    trainer = _trainer(hang_timeout_s=None)
    seen = []

    def veto_odd(value: float) -> None:
        seen.append(value)
        if value:
            trainer.control.request_skip()

    trainer.agreement.add("test.odd", lambda: trainer.state.step % 2 == 1, veto_odd)
    state = trainer.run(token_batches(4), max_steps=4)
    assert seen == [1.0, 0.0, 1.0, 0.0]
    assert state.skipped_steps == 2


# ------------------------------------------------------------------------------ two ranks
def _stop_cases(rank: int, world: int) -> dict:
    _init()
    out = {}
    # (a) one rank asks before the agreement (STEP_START): both stop after that step, its code
    trainer = _trainer(hang_timeout_s=None)

    @trainer.on(Events.STEP_START)
    def early(e):
        if rank == 0 and e.state.step == 3:
            e.control.request_stop("rank 0 asked early", ExitCode.STOPPED)

    state = trainer.run(token_batches(10, seed=rank), max_steps=10)
    out["early"] = (state.step, state.control.exit_code, state.control.stop_reason)

    # (b) one rank asks after the agreement (a user's STEP_END handler): agreed at the step's end
    trainer = _trainer(hang_timeout_s=None)

    @trainer.on(Events.STEP_END)
    def late(e):
        if rank == 1 and e.state.step == 4:
            e.control.request_stop("rank 1 asked late", 42)

    state = trainer.run(token_batches(10, seed=rank), max_steps=10)
    out["late"] = (state.step, state.control.exit_code, state.control.stop_reason)

    # (c) both ask at once with different codes: both end with the larger
    trainer = _trainer(hang_timeout_s=None)

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def clash(e):
        if e.state.step == 2:
            e.control.request_stop(f"rank {rank}", ExitCode.STOPPED if rank == 0 else ExitCode.NAN_ABORT)

    state = trainer.run(token_batches(10, seed=rank), max_steps=10)
    out["clash"] = (state.step, state.control.exit_code)

    # (d) one rank vetoes: neither steps; the ranks' parameters stay equal
    trainer = _trainer(hang_timeout_s=None)
    trainer.add_event_handler(
        Events.BEFORE_OPTIMIZER_STEP,
        lambda e: e.control.request_skip() if rank == 1 and e.state.step == 2 else None,
    )
    seen = {}
    trainer.add_event_handler(
        Events.STEP_END, lambda e: seen.setdefault(e.state.step, e.control.decided.skip)
    )
    state = trainer.run(token_batches(6, seed=rank), max_steps=3)
    out["veto"] = (state.skipped_steps, seen)
    out["params"] = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))

    # (e) a slot: the sum over ranks reaches on_agreed on every rank
    trainer = _trainer(hang_timeout_s=None)
    got = []
    trainer.agreement.add("test.rank", lambda: float(rank + 1), got.append)
    trainer.run(token_batches(2, seed=rank), max_steps=2)
    out["slot"] = got
    return out


@pytest.mark.distributed
def test_one_rank_asking_is_every_rank_doing_at_the_same_step():
    r0, r1 = run_distributed(_stop_cases, 2)
    assert r0["early"][:2] == r1["early"][:2] == (3, ExitCode.STOPPED)
    # every rank gives the reason of the rank that asked, named
    assert r0["early"][2] == "rank 0 asked early" and r1["early"][2] == "rank 0 asked early (asked on rank 0)"
    assert r0["late"][:2] == r1["late"][:2] == (4, 42)
    assert r1["late"][2] == "rank 1 asked late" and r0["late"][2] == "rank 1 asked late (asked on rank 1)"
    assert r0["clash"] == r1["clash"] == (2, ExitCode.NAN_ABORT)
    assert r0["veto"] == r1["veto"] == (1, {1: False, 2: True, 3: False})
    assert r0["params"] == r1["params"]
    assert r0["slot"] == r1["slot"] == [3.0, 3.0]


def _late_checkpoint(rank: int, world: int, directory: str) -> dict:
    _init()
    from hookloop.handlers import AsyncCheckpointer

    trainer = _trainer(hang_timeout_s=60)
    AsyncCheckpointer(directory, mode="async").attach(trainer)
    save_every(trainer, 100)
    saved = []
    trainer.add_event_handler(Events.CHECKPOINT_SAVED, lambda _e, step=None, path=None: saved.append(step))

    @trainer.on(Events.STEP_END, priority=Priority.OBSERVE)  # before the checkpointer, after the agreement
    def ask_late(e):
        if rank == 0 and e.state.step == 2:
            e.control.request_save()

    state = trainer.run(token_batches(6, seed=rank), max_steps=6)
    return {"saved": saved, "step": state.step}


@pytest.mark.distributed
def test_a_checkpoint_asked_for_on_one_rank_after_the_agreement_is_saved_next_step_everywhere(tmp_path):
    """A save is collective: one rank starting it alone would hang the other. Asked for after
    the step's agreement, it is carried to the next step's agreement and saved there by both."""
    r0, r1 = run_distributed(_late_checkpoint, 2, str(tmp_path))
    assert r0["step"] == r1["step"] == 6
    assert r0["saved"] == r1["saved"]
    assert r0["saved"][0] == 3
    assert (tmp_path / "step_00000003").is_dir()


class _StepCollectives:
    """Counts the collectives of each step, from the first STEP_START handler to after the
    trainer's own step end; says it never asks after the agreement, as the shipped handlers do."""

    asks_after_agreement = False

    def __init__(self, trainer: Trainer) -> None:
        self.per_step: dict[int, dict] = {}
        self._counter = None
        trainer.add_event_handler(Events.STEP_START, self.start, priority=Priority.ENGINE_FIRST)
        trainer.add_event_handler(Events.STEP_END, self.end, priority=Priority.ENGINE_LAST)

    def start(self, e) -> None:
        from benchmarks.step_budget import CollectiveCounter

        self._counter = CollectiveCounter().__enter__()

    def end(self, e) -> None:
        self._counter.__exit__(None, None, None)
        self.per_step[e.state.step] = dict(self._counter.counts)


def _validate_on_one_rank(rank: int, world: int) -> dict:
    _init()
    out = {}
    # (a) asked on rank 0 before the agreement (STEP_START), on rank 1 after it (STEP_END)
    trainer = _trainer(hang_timeout_s=60)
    trainer.set_validation(token_batches(2, seed=rank), eval_iters=1)
    validated, decided = [], {}

    @trainer.on(Events.STEP_START)
    def ask_early(e):
        if rank == 0 and e.state.step == 2:
            e.control.request_validate()

    @trainer.on(Events.STEP_END, priority=Priority.OBSERVE)  # after the agreement: carried to the next step
    def ask_late(e):
        decided[e.state.step] = e.control.decided.validate
        if rank == 1 and e.state.step == 4:
            e.control.request_validate()

    trainer.add_event_handler(Events.VALIDATION_END, lambda e: validated.append(e.state.step))
    trainer.run(token_batches(12, seed=rank), max_steps=6)
    out.update(validated=validated, decided=decided, step=trainer.state.step)

    # (b) the collectives a step costs: nothing that may ask late is attached, rank 0 asks at step 2
    trainer = _trainer(hang_timeout_s=60)
    trainer.set_validation(token_batches(2, seed=rank), eval_iters=1)
    trainer.add_event_handler(
        Events.STEP_START, lambda e: e.control.request_validate() if rank == 0 and e.state.step == 2 else None
    )
    counted = _StepCollectives(trainer)
    trainer.run(token_batches(8, seed=rank), max_steps=4)
    out["per_step"] = counted.per_step
    return out


@pytest.mark.distributed
def test_a_validation_asked_for_on_one_rank_runs_on_every_rank_at_the_same_step():
    """Validation is collective: one rank validating alone would leave the other waiting. A request
    on one rank is agreed in the step's one all-reduce (asked after it: at the next step), and a
    step that does not validate still issues exactly one all-reduce."""
    r0, r1 = run_distributed(_validate_on_one_rank, 2)
    assert r0["step"] == r1["step"] == 6
    assert r0["validated"] == r1["validated"] == [2, 5]
    assert r0["decided"] == r1["decided"] == {1: False, 2: True, 3: False, 4: False, 5: True, 6: False}
    for r in (r0, r1):
        for step in (1, 3, 4):
            assert r["per_step"][step] == {"all_reduce": 1}, (step, r["per_step"])
    # the validating step: the agreement, the validation's own reductions, the late agreement
    assert r0["per_step"][2] == r1["per_step"][2] and r0["per_step"][2]["all_reduce"] > 1


# ------------------------------------------------------------------------------ the transport
def test_the_trainer_agrees_through_the_transport_it_is_given():
    """A transport of one's own (as the replica groups extend the process group): it combines the
    gradients, sums the step's values, voids a step it did not commit and stops at a step boundary."""
    from hookloop.engine.agreement import AgreementTransport, sum_over_ranks

    trainer = _trainer(hang_timeout_s=None)
    assert type(trainer.agreement.transport) is AgreementTransport  # the plain process group

    class Doubled(AgreementTransport):
        """Every value as if two ranks agreed alike; step 2 not committed; a stop after step 3."""

        spans_processes = True
        ranks_summed = 2

        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def reduce_gradients(self, params) -> None:
            self.calls.append(("gradients", trainer.state.iteration))

        def agree_step(self, values):
            self.committed = trainer.state.iteration != 2
            return [2 * v for v in sum_over_ranks(values, force_read=True)]

        def step_boundary(self) -> bool:
            self.calls.append(("boundary", trainer.state.iteration))
            return trainer.state.iteration == 3

    transport = trainer.agreement.transport = Doubled()
    state = trainer.run(token_batches(6), max_steps=6)
    assert state.step == 3 and trainer.control.decided.stop  # stopped at the boundary of step 3
    assert state.skipped_steps == 1  # step 2 was not committed: skipped, nothing else decided
    assert [c for c in transport.calls if c[0] == "gradients"] == [("gradients", i) for i in (1, 2, 3)]
    assert [c for c in transport.calls if c[0] == "boundary"] == [("boundary", i) for i in (1, 2, 3)]
    assert state.samples_seen == 2 * sum(len(b[0]) for b in token_batches(6)[:3])  # doubled sums


def _kinds_differ(rank: int, world: int) -> list:
    from hookloop.engine.agreement import sum_over_ranks

    _init()
    # Rank 0 gives a tensor where rank 1 gives a number, and the other way round: the sums are
    # still the sums of each place.
    mine = [torch.tensor(1.0), 10] if rank == 0 else [2, torch.tensor(20.0)]
    alike = sum_over_ranks([torch.tensor(4.0), 3], keep=1)  # the same kinds: the kept tensor unread
    return [sum_over_ranks(mine), [float(v) for v in alike], isinstance(alike[0], torch.Tensor)]


def test_ranks_whose_slots_differ_in_kind_still_sum_each_place():
    for summed, alike, kept in run_distributed(_kinds_differ, 2):
        assert summed == [3.0, 30.0]
        assert alike == [8.0, 6.0] and kept
