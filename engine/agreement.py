"""The step's agreement: every value ranks must combine in a step, in one small all-reduce.

The loss and token counts summed over data-parallel ranks, and the requests on the trainer's control
point (:class:`~engine.control.StepControl`: skip, stop and its exit code, save) travel together,
once per step, after the ``BEFORE_OPTIMIZER_STEP`` handlers and before the optimizer; the agreed
values replace the requests (``trainer.control.decided``). Handlers add their own *slots*::

    def veto_if_bad(bad_ranks: float) -> None:
        if bad_ranks > 0:
            trainer.control.request_skip()

    trainer.agreement.add("my_hook.bad", fill=lambda: local_flag, on_agreed=veto_if_bad)

``fill()`` gives this rank's value (a bool, a number or a 0-dim tensor) just before the reduction;
``on_agreed`` receives the **sum over ranks**, the same on every rank, so what it requests is agreed
by construction and takes effect in this step. With one process nothing is communicated (its
tensors are never read unless asked for). The loss, gradient norm and token count are summed where
they live and stay there until something reads them (a logger on its log step); host numbers (the
requests, counts, votes) travel in a host tensor, so a step in which no slot gives a tensor reads
nothing from the device (:func:`sum_over_ranks`). A slot that gives a tensor is read in the same
step, one transfer for all of them: that is the step deciding on a device value; a step that
decides anything reads the sums with its decisions (:mod:`engine.step_decisions`). A slot may give a
tensor on some ranks and a number on others (its own group's values, zeros elsewhere): the ranks see
it from the sums and sum that step again in one layout.

A slot added with ``on_device=True`` is not read for its own sake: its ``on_agreed`` receives the
sum as a tensor, unread, on a step that decides nothing else (no skip, stop, save or validation
asked, no other slot read), and as a number on a step that reads anyway. Its handler acts on the
device with it (the NaN detector's skip: a fused optimizer's ``found_inf``) and does its host
bookkeeping at the next step that reads. The flag may change between steps (``slot.on_device``).

Who takes part is the trainer's *agreement transport*, ``trainer.agreement.transport`` (as
Lightning's ``Strategy.reduce_boolean_decision``): :class:`AgreementTransport` is the plain process
group; the replica groups of a fault-tolerant run extend it across the live groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hookloop.engine import parallel
from hookloop.engine.exit_codes import ExitCode

__all__ = [
    "AgreementTransport",
    "Slot",
    "StepAgreement",
    "agreed_exit_code",
    "exit_code_votes",
    "sum_over_ranks",
]

Value = bool | int | float | torch.Tensor
#: The step's agreement leads with the loss, the gradient norm and the token count: summed where
#: they live and read only by whoever reads them (``state.loss``, a logger on its log step).
STEP_VALUES = 3


@dataclass
class Slot:
    """One value a handler adds to the step's agreement (see the module docstring)."""

    name: str
    fill: Callable[[], Value]
    on_agreed: Callable[[Any], None] | None = None
    #: ``on_agreed`` takes the sum as a tensor, unread, on a step that reads nothing else.
    on_device: bool = False


class AgreementTransport:
    """How the ranks of a run agree: the plain process group. Extend it to agree beyond it and set
    it as ``trainer.agreement.transport`` before the run starts."""

    #: False: the latest step's agreement did not hold; the step is skipped, nothing else decided.
    committed = True

    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """After the body's backward, before the norm: combine gradients beyond DDP / FSDP2 (no)."""

    @property
    def spans_processes(self) -> bool:
        """Whether an agreement reaches another process (False: values stay as they are)."""
        return parallel.world_size() > 1

    @property
    def ranks_summed(self) -> int:
        """How many ranks' values the latest step's agreed sums cover."""
        return parallel.world_size()

    def agree_step(self, values: Sequence[Value], keep: int = STEP_VALUES) -> list[Value]:
        """The step's values summed over its ranks: the first ``keep`` (loss, gradient norm, tokens,
        then the ``on_device`` slots) stay on the device, unread (:func:`sum_over_ranks`), the
        decisions are read."""
        return sum_over_ranks(values, keep=keep)

    def agree_late(self, values: Sequence[Value]) -> list[Value]:
        """The late agreement's values (host numbers) summed over its ranks."""
        return sum_over_ranks(values)

    #: This process's replica group (0: the run is one group).
    group = 0

    def across_groups(self, obj: object) -> dict[int, object]:
        """``obj`` of this rank and of the rank in its place in every other live replica group, by
        group (rare decisions only): this group's alone without replica groups."""
        return {self.group: obj}

    def step_boundary(self) -> bool:
        """The step's very end: True when every rank stops now (from values every rank shares)."""
        return False


class StepAgreement:
    """Handler slots of the per-step all-reduce, and the packing that makes it one collective;
    :attr:`transport` says who takes part."""

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        #: How the ranks agree (:class:`AgreementTransport`; the plain process group by default).
        self.transport = AgreementTransport()

    def add(
        self,
        name: str,
        fill: Callable[[], Value],
        on_agreed: Callable[[Any], None] | None = None,
        *,
        on_device: bool = False,
    ) -> Slot:
        """Add a slot: ``fill()`` -> this rank's value just before the reduction,
        ``on_agreed(sum over ranks)`` on every rank right after it, before the optimizer step;
        ``on_device``: the sum may come as an unread tensor (see the module docstring)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a slot needs a non-empty name, got {name!r}")
        if name in self._slots:
            raise ValueError(f"the step agreement already has a slot named {name!r}; pick another name")
        if not callable(fill) or (on_agreed is not None and not callable(on_agreed)):
            raise TypeError("fill and on_agreed must be callables: fill() -> value, on_agreed(sum)")
        slot = Slot(name, fill, on_agreed, bool(on_device))
        self._slots[name] = slot
        return slot

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots.values())


def sum_over_ranks(
    values: Sequence[Value],
    *,
    keep: int = 0,
    force_read: bool = False,
    across: Callable[[torch.Tensor], None] | None = None,
) -> list[Value]:
    """``values`` summed over every rank in one all-reduce (two on a GPU): host numbers come back as floats,
    tensors as floats too (read in one transfer), except the first ``keep`` values, which stay
    tensors, unread, when they are tensors (their sums, on the collective device).

    Host numbers travel in a host tensor (through a CPU process group when the collective device is
    a GPU), so reading them never waits for the device; tensors are summed where they live
    (with gloo, on the host, both share one buffer and one all-reduce). A step whose values are host
    numbers plus ``keep`` tensors reads nothing from the device.

    ``across``: a further sum over other groups of ranks, applied in place to one packed vector
    after the sum over this group (an :class:`AgreementTransport` reaching further, e.g. the replica
    groups of a fault-tolerant run); everything is then read, as with ``force_read``. Where a tensor
    after the first ``keep`` is read, the first ``keep`` come along in the same transfer. One process
    and nothing across: nothing is communicated, and tensors are read as with several."""
    keep = 0 if force_read else keep
    if across is not None:
        device = parallel.collective_device()
        packed = pack(values, device)
        if parallel.world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        across(packed)
        return packed.tolist()
    read = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and i >= keep]
    if read:  # the device is read anyway: the kept values come along in the same transfer
        keep = 0
        read = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if parallel.world_size() == 1:
        return read_now(values) if read else list(values)
    out = list(values)
    host_at = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    kept = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and i < keep]
    tensor_at = read + kept
    # The packing follows where this rank's tensors are; the first two host numbers say so, so ranks
    # whose slots differ in kind (a tensor here, a number there) find out from the sums, all alike,
    # and sum again in one layout instead of adding values that do not line up.
    shape = _layout(i for i, v in enumerate(values) if isinstance(v, torch.Tensor))
    host = [shape, shape * shape, *(float(values[i]) for i in host_at)]
    host_values = torch.tensor(host, dtype=torch.float64)
    device = parallel.collective_device()
    if device.type == "cpu":  # gloo: one buffer, one all-reduce; the host numbers a view of it
        buffer = torch.empty(2 + len(host_at) + len(tensor_at), dtype=torch.float64)
        host, tensors = buffer[: 2 + len(host_at)], buffer[2 + len(host_at) :]
        host.copy_(host_values)
        if tensor_at:
            tensors.copy_(pack([values[i] for i in tensor_at], device))
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    else:  # a GPU: the host numbers through a CPU group, the tensors on the device
        host = host_values
        tensors = pack([values[i] for i in tensor_at], device)
        if tensor_at:
            dist.all_reduce(tensors, op=dist.ReduceOp.SUM)
        dist.all_reduce(host, op=dist.ReduceOp.SUM, group=_host_group())
    summed = host.tolist()
    if summed[0] * summed[0] != parallel.world_size() * summed[1]:  # not every rank packed alike
        return sum_over_ranks(values, force_read=True, across=lambda _: None)
    for i, v in zip(host_at, summed[2:]):
        out[i] = v
    for i, v in zip(read, tensors[: len(read)].tolist() if read else []):
        out[i] = v
    for j, i in enumerate(kept):
        out[i] = tensors[len(read) + j]
    return out


def _layout(tensor_at: Any) -> float:
    """A number for which of a rank's values are tensors (exact in float64 when squared and summed
    over thousands of ranks): ranks packed alike iff (sum)^2 == ranks x sum of squares."""
    code = 1
    for i in tensor_at:
        code = (code * 1_000_003 + i + 1) % 1_048_573
    return float(code)


def read_now(values: Sequence[Value]) -> list[Value]:
    """``values`` with every tensor among them read to a float, in one transfer."""
    out = list(values)
    at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if len(at) == 1:
        out[at[0]] = float(values[at[0]].item())
    elif at:
        for i, v in zip(at, pack([values[i] for i in at], torch.device("cpu")).tolist()):
            out[i] = v
    return out


@functools.lru_cache(maxsize=1)
def _cpu_group(world: Any) -> Any:
    return dist.new_group(backend="gloo")


def _host_group() -> Any:
    """A gloo group over every rank, for host numbers when the default group is a GPU's (made on
    every rank at their first agreement, in step)."""
    return _cpu_group(dist.group.WORLD)


def pack(values: Sequence[Value], device: torch.device) -> torch.Tensor:
    """One float64 vector on ``device`` from host numbers and 0-dim tensors, with no host read."""
    tensor_at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    host_at = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    host = [float(values[i]) for i in host_at]
    if not tensor_at:
        return torch.tensor(host, dtype=torch.float64, device=device)
    out = torch.empty(len(values), dtype=torch.float64, device=device)
    out[tensor_at] = torch.stack(
        [values[i].detach().reshape(()).to(device, torch.float64) for i in tensor_at]
    )
    if host_at:
        out[host_at] = torch.tensor(host, dtype=torch.float64, device=device)
    return out


#: Exit codes voted for one-hot; any other code travels as (sum, count) in two more places.
EXIT_CODES = tuple(int(c) for c in ExitCode if c != ExitCode.SUCCESS)
N_EXIT_VOTES = len(EXIT_CODES) + 2


def exit_code_votes(code: int) -> list[int]:
    """This rank's vote for the run's exit code (0: none), as values to sum over ranks."""
    votes = [int(code == c) for c in EXIT_CODES]
    other = code not in EXIT_CODES and code != 0
    return [*votes, code if other else 0, int(other)]


def agreed_exit_code(summed: Sequence[float]) -> int:
    """The exit code every rank ends with: the largest one any rank voted for (0: none)."""
    chosen = [c for c, n in zip(EXIT_CODES, summed) if n > 0]
    other_sum, other_count = summed[len(EXIT_CODES)], summed[len(EXIT_CODES) + 1]
    if other_count > 0:
        chosen.append(round(other_sum / other_count))
    return max(chosen, default=0)
