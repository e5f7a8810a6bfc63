"""Replica groups: data parallelism across groups that keeps training when one of them dies.

A :class:`ReplicaGroups` attached to a :class:`~engine.Trainer` makes this process one rank of one
replica group (the ``fault_tolerance`` section, :mod:`engine.fault_tolerance`). It is the trainer's
agreement transport (``trainer.agreement.transport``, :class:`engine.agreement.AgreementTransport`):
the trainer names no layout, it asks the transport. Across groups a torchft ``Manager`` keeps the
quorum of live groups (through the lighthouse), reconfigures the cross-group process group when it
changes, and sends a live group's state to a recovering one. The trainer's step, with what this
adds marked ``+``::

    TRAIN_START   ... a checkpoint resume (RESTORE) ...
                + quorum()              join the live groups; a group behind them (restarted, or
                                        at its first step) receives a peer's whole state here
    step k        fetch, STEP_START, forward/backward (DDP inside the group)
                + reduce_gradients()    one flat all-reduce of the gradients over the live groups
                  grad norm, BEFORE_OPTIMIZER_STEP
                  the step's agreement  the packed vector summed inside the group, then
                +                       over the live groups, then ``should_commit``: a step
                                        that is not committed (a group died mid-step, too few
                                        groups) is a skipped step whose other decisions are void
                  optimizer, LR scheduler (unless skipped), STEP_END handlers, the step's end
                + quorum()              at the step boundary (``step_boundary``, the trainer's
                                        end of the step): a group that died is dropped (the
                                        others stall about the lighthouse's heartbeat timeout), a
                                        restarted one joins and is healed before the next fetch

Every decision the engine agrees on (skip, stop and its exit code, save, validate) is summed over
the live groups, so all of them take it at the same step. Healing (every group but one of a fresh
start too): the recovering group receives the model and optimizer (by value, over torchft's HTTP
transport: a pickle from a peer of the same job), the run's snapshot (:mod:`engine.run_snapshot`:
what a checkpoint holds, handlers' tensor state included), a stop the peer decided, and the peer's
:func:`shared_settings`: one that differs from this group's refuses it by name before anything is
applied (exit 2; groups that join without a heal compare theirs at the quorum). torchft's own
step (the count of committed steps) travels in checkpoints as the state ``replica_groups``, so
after a whole-job restart the group that resumed the newest checkpoint is the one the others heal
from. No lighthouse or no quorum in time ends the group with 77 in one line.

torchft is imported when the first run starts, never by importing this module, through its one
adapter (:mod:`engine.fault_tolerance`: the version check and torchft's private attributes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
import re
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hookloop.engine import fault_tolerance, parallel, run_snapshot
from hookloop.engine.agreement import AgreementTransport, sum_over_ranks
from hookloop.engine.errors import ConfigError, TrainingAborted
from hookloop.engine.events import Events, Priority
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.fault_tolerance import FaultToleranceConfig

__all__ = ["STATE_KEY", "ReplicaGroups", "shared_settings"]

logger = logging.getLogger("hookloop.replica_groups")

#: Where torchft's commit count sits in a checkpoint (a registered stateful object).
STATE_KEY = "replica_groups"
_HOLDER = "replica groups (an uncommitted step)"
#: The config sections every replica group trains with alike, and the fields in them that are each
#: group's own (where and how its processes run); docs/distributed.md lists both.
SHARED_SECTIONS = ("model", "train", "optimizer", "lr", "data", "step_scheduler")
OWN_FIELDS = ("train.run_dir", "train.device", "train.num_threads", "data.cache_dir", "data.num_workers")


def shared_settings(cfg: Any) -> dict[str, Any]:
    """Dotted field -> value of the settings of run config ``cfg`` every replica group must share."""
    out = {"fault_tolerance.num_replica_groups": cfg.fault_tolerance.num_replica_groups}
    for name in SHARED_SECTIONS:
        section = getattr(cfg, name, None)
        fields = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else dict(section or {})
        out.update({f"{name}.{k}": v for k, v in fields.items() if f"{name}.{k}" not in OWN_FIELDS})
    return out


class ReplicaGroups(AgreementTransport):
    """This process's replica group in a fault-tolerant run (see the module docstring).

    Args:
        config: the ``fault_tolerance`` section (validated here: a ``ConfigError`` names the field).
        settings: what this group must share with the others (:func:`shared_settings`), compared
            with a peer's when this group joins (at its heal, or at the quorum); None: nothing.

    ``attach(trainer)`` wires it in as the trainer's agreement transport; the trainer then averages
    gradients and agrees decisions over the live groups. :attr:`group` is this group's id,
    :attr:`live` the ids of the groups in the current quorum, :attr:`committed` whether the current
    step committed, :attr:`uncommitted_steps` how many did not in this run. :meth:`shutdown` leaves
    (the composition root calls it)."""

    def __init__(self, config: FaultToleranceConfig, settings: Mapping[str, Any] | None = None) -> None:
        config.validate()
        if not config.enabled:
            raise ValueError("ReplicaGroups needs a fault_tolerance section with enabled=true")
        self.config = config
        self.settings = json.loads(json.dumps(dict(settings or {}), sort_keys=True, default=str))
        self.group = config.group_id()
        self.groups = config.num_replica_groups
        self.lighthouse = config.lighthouse_address()
        self.manager: Any = None
        self.trainer: Any = None
        self.live: tuple[int, ...] = ()
        self.committed = True
        self.uncommitted_steps = 0
        self._in_a_row = 0
        self._quorum_id = -1
        self._pg: Any = None
        self._heal_transport: Any = None
        self._store: Any = None
        self._stop_now = False  # healed at the step boundary from a group that stopped there
        self._saved_commits: dict[str, int] | None = None  # from a checkpoint, until the manager exists
        self._healed: dict[str, Any] | None = None
        self._at_start = True
        #: ``(group, step)`` of the last heal: which group sent this one its state, at which step.
        self.healed_from: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return f"ReplicaGroups(group {self.group} of {self.groups}, lighthouse {self.lighthouse})"

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: Any) -> ReplicaGroups:
        if self.trainer is not None:
            raise RuntimeError("this ReplicaGroups is already attached to a trainer; build one per trainer")
        self.trainer = trainer
        trainer.agreement.transport = self  # the step agrees over the live groups (engine.agreement)
        # After a checkpoint resume (RESTORE, order 0): a peer's state overrides what the disk said.
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=Priority.RESTORE - 500)
        trainer.register_stateful(STATE_KEY, self)
        return self

    def state_dict(self) -> dict[str, int]:
        """torchft's commit count (``step``, ``batches_committed``), for a checkpoint."""
        if self.manager is None:
            return dict(self._saved_commits or {"step": 0, "batches_committed": 0})
        return {k: int(v) for k, v in self.manager.state_dict().items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        commits = {"step": int(state["step"]), "batches_committed": int(state["batches_committed"])}
        if self.manager is None:
            self._saved_commits = commits
        else:
            self.manager.load_state_dict(commits)

    # ------------------------------------------------------------------ starting and leaving
    def _start(self) -> None:
        """The torchft manager for this process: its store (a one-process group hosts its own),
        the cross-group process group, the heal transport, the lighthouse connection."""
        cfg = self.config
        self.manager, self._pg, self._heal_transport, self._store = fault_tolerance.start_manager(
            cfg, group_name=fault_tolerance.group_dir_name(self.group), rank=parallel.rank(),
            world=parallel.world_size(),
        )  # fmt: skip
        self.manager.register_state_dict_fn("hookloop", self._receive, self._payload)
        if self._saved_commits is not None:
            self.manager.load_state_dict(self._saved_commits)
        parallel.note_process_group_used()  # leave through os._exit: torchft's threads never join

    def shutdown(self) -> None:
        """Leave the replica groups: a peer still receiving this group's state gets all of it
        (bounded by ``timeout_s``), then the manager, its servers and threads stop."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        with contextlib.suppress(Exception):
            self._heal_transport.disallow_checkpoint()  # waits for a transfer in progress
        with contextlib.suppress(Exception):
            manager.shutdown(wait=False)

    # ------------------------------------------------------------------ the quorum
    def _on_train_start(self) -> None:
        self._quorum(at_start=True)

    def step_boundary(self) -> bool:
        """The trainer's end of the step (:meth:`engine.agreement.AgreementTransport.step_boundary`):
        the next quorum; True when this group was healed from a group that stopped at this step."""
        self._stop_now = False
        self._quorum(at_start=False)
        return self._stop_now

    def _quorum(self, at_start: bool) -> None:
        """Join the next quorum (a heal lands here), then say what changed."""
        trainer = self.trainer
        self._healed = None
        self._at_start = at_start  # how _receive applies a peer's state
        watchdog = getattr(trainer, "watchdog", None)
        wait = watchdog.suspended() if watchdog is not None else contextlib.nullcontext()
        try:
            with wait:  # bounded by connect_timeout_s, quorum_timeout_s, and timeout_s for a heal
                if self.manager is None:
                    self._start()
                self.manager.start_quorum()
        except (ConfigError, TrainingAborted):  # a peer's settings differ (_receive); no torchft
            raise
        except Exception as e:  # noqa: BLE001 - no lighthouse reached, or it or every peer is gone
            logger.debug("replica group %d: no quorum", self.group, exc_info=e)  # torchft's error in full
            bound = "quorum_timeout_s" if self.manager is not None else "connect_timeout_s"
            raise TrainingAborted(
                f"no quorum of replica groups within {getattr(self.config, bound):g} s (fault_tolerance."
                f"{bound}; lighthouse {self.lighthouse}): {type(e).__name__}: "
                f"{_last_line(e).split(', details:')[0].rsplit(': ', 1)[-1]}",
                int(ExitCode.HEALTH_CHECK_FAILED),
            ) from e
        trainer.save_policy.release_saves(_HOLDER)
        quorum_id = fault_tolerance.quorum_id(self.manager)
        if quorum_id != self._quorum_id:
            self._quorum_id = quorum_id
            self._quorum_changed(quorum_id)
        if self._healed is not None:
            self._after_heal(at_start)

    def _quorum_changed(self, quorum_id: int) -> None:
        """Learn which groups are live (one small all-reduce over them) and say it in one line."""
        before, mine = self.live, json.dumps(self.settings, sort_keys=True).encode()
        votes = torch.zeros(3 * self.groups, dtype=torch.float64)  # per group: live, settings' crc, length
        votes[self.group :: self.groups] = torch.tensor([1.0, zlib.crc32(mine), len(mine)])
        if self._sum(votes):
            live, crcs, lengths = votes.view(3, self.groups).tolist()
            self.live = tuple(g for g, v in enumerate(live) if v > 0)
            if len({crcs[g] for g in self.live}) > 1:  # every live group sees it: all exchange
                self._compare_all(mine, [int(n) for n in lengths])
        else:  # a group died right away: the next quorum says who is left
            self.live = (self.group,)
        change = [f"groups {', '.join(str(g) for g in self.live)}"]
        lost = sorted(set(before) - set(self.live))
        joined = sorted(set(self.live) - set(before)) if before else []
        change += [f"lost group {g}" for g in lost] + [f"group {g} joined" for g in joined]
        if parallel.rank() == 0:
            logger.info(
                "replica groups: quorum %d, %d of %d live (%s) at step %d",
                quorum_id,
                len(self.live),
                self.groups,
                "; ".join(change),
                self.trainer.state.iteration,
            )

    def _compare_all(self, mine: bytes, lengths: list[int]) -> None:
        """Every live group's settings, one row each in one all-reduce, compared with this group's
        when it is joining (groups that joined without a heal: all of them after a whole-job restart
        at one step); the groups already training go on and leave the refusal to the joining one."""
        rows = torch.zeros(self.groups, max(lengths), dtype=torch.float64)
        rows[self.group, : len(mine)] = torch.tensor(list(mine), dtype=torch.float64)
        if self._sum(rows) and self._at_start:  # else a group died: the next quorum compares again
            for g in self.live:
                self._compare(json.loads(bytes(int(b) for b in rows[g, : lengths[g]].tolist())), g)

    def _compare(self, theirs: dict[str, Any], peer: Any) -> None:
        """A ``ConfigError`` naming the first setting in which replica group ``peer`` differs."""
        mine = self.settings
        for name in sorted(set(mine) | set(theirs)) if mine else ():
            if mine.get(name, "unset") != theirs.get(name, "unset"):
                raise ConfigError(
                    name,
                    f"is {mine.get(name, 'unset')!r} here but {theirs.get(name, 'unset')!r} on replica "
                    f"group {peer}: every replica group trains with the same settings "
                    "(docs/distributed.md); start this group with the others' value",
                )

    # ------------------------------------------------------------------ the step (the transport)
    spans_processes = True

    def agree_step(self, values: Sequence[Any], keep: int = 0) -> list[Any]:
        """The step's values summed inside the group, then over the live groups (:meth:`_agree_step`):
        every value read (``keep`` does not apply across groups)."""
        return sum_over_ranks(values, across=self._agree_step)

    def agree_late(self, values: Sequence[Any]) -> list[Any]:
        return sum_over_ranks(values, across=self._agree_late)

    def across_groups(self, obj: Any) -> dict[int, Any]:
        """``obj`` of this rank and of the rank in its place in every other live group, by group:
        pickled, one row per group, summed over the live groups (the lengths, then the bytes); this
        group's alone when that fails (the step will not commit)."""
        mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(torch.int32)
        lengths = torch.zeros(self.groups, dtype=torch.int32)
        lengths[self.group] = len(mine)
        if not self._sum(lengths):
            return {self.group: obj}
        rows = torch.zeros(self.groups, int(lengths.max()), dtype=torch.int32)
        rows[self.group, : len(mine)] = mine
        if not self._sum(rows):
            return {self.group: obj}
        return {
            g: pickle.loads(rows[g, :n].to(torch.uint8).numpy().tobytes())  # noqa: S301 - a peer of this job
            for g, n in enumerate(lengths.tolist())
            if n
        }

    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """The gradients averaged over the live groups (one flat all-reduce; a failure is recorded
        and the step will not commit)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.detach().reshape(-1) for g in grads])
        # Straight on the process group (torchft's managed all-reduce adds thread hops, ~1 ms here).
        if self._sum(flat):
            flat /= self.manager.num_participants()
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            part = flat[offset : offset + n].view_as(g)
            offset += n
            if p.grad is not None:
                p.grad.copy_(part)
            elif part.any():  # no gradient here, one in another group
                p.grad = part.clone()

    @property
    def ranks_summed(self) -> int:
        """The ranks the step's agreed sums cover: the group's, times the participating groups if
        it committed."""
        return parallel.world_size() * (self.manager.num_participants() if self.committed else 1)

    def _agree_step(self, packed: torch.Tensor) -> None:
        """The step's agreement vector (already summed inside the group) summed over the live
        groups, then whether the step commits. An uncommitted step keeps this group's own sums."""
        local = packed.clone()
        self._sum(packed)
        try:
            self.committed = bool(self.manager.should_commit())
        except Exception as e:  # noqa: BLE001 - the group's own commit vote failed
            logger.warning("replica group %d: the commit vote failed: %s", self.group, e)
            self.committed = False
        if self.committed:
            self._in_a_row = 0
            return
        packed.copy_(local)
        # No save of a state the other groups never had; released once the boundary's quorum (and
        # a heal, which must not change what a save is copying) is over.
        self.trainer.save_policy.hold_saves(_HOLDER)
        self.uncommitted_steps += 1
        self._in_a_row += 1
        error = self.manager.errored()
        why = f"a cross-group collective failed ({_last_line(error)})" if error else "too few replica groups"
        step = self.trainer.state.iteration
        if parallel.rank() == 0:
            logger.warning(
                "step %d not committed across replica groups: %s; skipped here, its samples dropped",
                step,
                why,
            )
        if self._in_a_row > self.config.max_uncommitted_steps:
            raise TrainingAborted(
                f"step {step}: {self._in_a_row} steps in a row not committed across replica groups "
                f"(fault_tolerance.max_uncommitted_steps={self.config.max_uncommitted_steps}): {why}",
                int(ExitCode.HEALTH_CHECK_FAILED),
            )

    def _agree_late(self, packed: torch.Tensor) -> None:
        """The late agreement (stop and rollback votes after the step's handlers) summed over the
        live groups; when that fails nothing is decided late (a stop request stays latched and is
        agreed at the next step)."""
        if not self._sum(packed):
            packed.zero_()

    def _sum(self, tensor: torch.Tensor) -> bool:
        """``tensor`` summed over the live groups, in place, on the cross-group process group;
        False (and the step will not commit) when that failed."""
        if self.manager.errored():
            return False
        from torch.distributed import AllreduceOptions, ReduceOp

        try:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            self._pg.allreduce([tensor], opts).wait()
        except Exception as e:  # noqa: BLE001 - a group died mid-collective
            self.manager.report_error(e)
            return False
        return True

    # ------------------------------------------------------------------ healing
    def _payload(self) -> dict[str, Any]:
        """What a recovering group receives from this one (torchft calls it on its quorum thread
        while the main thread waits for the quorum)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        trainer = self.trainer
        model, optim = get_state_dict(
            trainer.model, trainer.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        decided, reason = trainer.control.decided, trainer.control.stop_reason
        return {
            "group": self.group,
            "settings": self.settings,
            "model": model,
            "optim": optim,
            "snapshot": run_snapshot.capture(trainer),
            "tensors": run_snapshot.tensor_states(trainer),  # handlers' state at the model's scale
            "stop": {"stop": decided.stop, "exit_code": int(decided.exit_code), "reason": reason},
        }

    def _receive(self, payload: dict[str, Any]) -> None:
        """A peer's state, applied in the main thread inside ``start_quorum``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        self._compare(payload.get("settings", {}), payload.get("group"))  # before anything is applied
        start = time.perf_counter()
        trainer = self.trainer
        set_state_dict(
            trainer.model,
            trainer.optimizer,
            model_state_dict=payload["model"],
            optim_state_dict=payload["optim"],
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        snapshot = payload["snapshot"]
        run_snapshot.apply(
            trainer,
            snapshot,
            resume=self._at_start,
            keep_counters=False,
            keep_data_position=snapshot.get("data") == run_snapshot.capture(trainer)["data"],
            skip_handlers=(STATE_KEY,),
        )
        run_snapshot.restore_tensor_states(trainer, payload.get("tensors") or {})
        self._healed = {
            "group": payload.get("group"),
            "stop": payload.get("stop") or {},
            "size": _size(sum(t.numel() * t.element_size() for t in _tensors(payload))),
            "seconds": time.perf_counter() - start,
        }

    def _after_heal(self, at_start: bool) -> None:
        healed, trainer = self._healed, self.trainer
        self.healed_from = (healed["group"], trainer.state.iteration)
        if parallel.rank() == 0:
            logger.info(
                "replica group %d healed from replica group %s at step %d (%s, applied in %.2f s)",
                self.group,
                healed["group"],
                trainer.state.iteration,
                healed["size"],
                healed["seconds"],
            )
        stop, control = healed["stop"], trainer.control
        if stop.get("stop"):  # the peer stopped at this step: so does this group
            reason = stop.get("reason") or "stopped on another replica group"
            control.request_stop(reason, stop.get("exit_code"))
            # at the step boundary every rank of the group stops now, at the peer's step (a value
            # every rank shares: the trainer's end of the step carries it out); TRAIN_START agrees it
            self._stop_now = not at_start
            return
        max_steps = trainer.limits[0]
        if at_start and max_steps is not None and trainer.state.iteration >= max_steps:
            control.request_stop(
                f"healed at step {trainer.state.iteration} >= max_steps ({max_steps}): nothing left to train"
            )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


def _last_line(error: Any) -> str:
    """The gist of a collective's error: its last line without gloo's source location, its first
    sentence."""
    lines = str(getattr(error, "original_exception", error)).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]) if lines else type(error).__name__
    return text.split(". ")[0]
