"""ReplicaCheck: find silent data corruption by comparing the data-parallel replicas' weights.

Data-parallel replicas apply the same reduced gradients to the same weights, so their weights stay
bitwise equal; a replica whose weights differ was corrupted (a flipped bit in memory, a rank that
computes wrong) and poisons every later step without anything going non-finite. Every
``every_steps`` steps (the ``replica_check`` section, :class:`ReplicaCheckConfig`) each rank takes
an exact 64-bit fingerprint of its parameters (and, with ``optimizer_state``, of its optimizer
state): the weights steps N, 2N, ... leave, what a checkpoint of those steps holds, compared at
steps N+1, 2N+1, ...

**Inside the step's one agreement.** The comparison rides the step's all-reduce (a sum,
:mod:`engine.agreement`) as nine values per group of replicas: a count, the fingerprint's four
16-bit pieces and their squares. For each piece, ``count * sum(c^2) == sum(c)^2`` exactly when every
replica's piece is the same (equality in Cauchy-Schwarz); the integers stay below 2^53, so the
float64 sums are exact. On other steps the values are zeros: no collective is added, and no tensor
is read to the host. The groups are the replicas of the same shard: under tensor or pipeline
parallelism, the ranks of one ``dp`` group (equal tp / pp coordinates, ``dp_group``); with replica
groups (torchft) the agreement sums across the groups, so the check spans them.

**A mismatch** (from agreed sums, so every rank sees it alike) gathers each rank's fingerprint and
host (one ``all_gather_object``, only then; with replica groups, every live group's through the
transport's ``across_groups``) and names the replicas that differ from the majority of
their group; with two replicas (or a tie) it cannot tell which is wrong and names each. Saves are
held, then the run rolls back to the newest checkpoint at or before the last step whose weights were
seen equal (each checkpoint records that step: this handler's state), at most ``max_rollbacks``
times; after that (at once with ``max_rollbacks=0``) it stops with exit code 79,
``REQUEUE_WITHOUT_NODE``, and ``exit_status.json`` names the hosts (``"nodes"``; also when no
checkpoint is old enough to roll back to).
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from hookloop.engine import ConfigError, Events, ExitCode, Trainer, parallel
from hookloop.engine.events import Priority
from hookloop.engine.handler import Handler, checked_settings
from hookloop.handlers.sections.replica_check import ReplicaCheckConfig

__all__ = ["ReplicaCheck", "ReplicaCheckConfig", "fingerprint"]

logger = logging.getLogger(__name__)

#: ROLLBACK: take the restored step after the checkpointer restored (late in CLEANUP).
REPLICA_ROLLBACK_DONE = Priority.CLEANUP - 800
#: Per group of replicas: a count, four 16-bit pieces of the fingerprint, their squares.
PIECES = 4
VALUES = 1 + 2 * PIECES
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """An exact 64-bit fingerprint (a 0-dim int64 tensor, on the tensors' device, not read) of the
    bit patterns of ``tensors`` (a DTensor's local shard): any single flipped bit changes it."""
    sums = []
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        flat = local.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        bits = flat.view(_INT[flat.element_size()]).to(torch.int64)
        odd = torch.arange(1, 2 * flat.numel(), 2, device=flat.device, dtype=torch.int64)
        sums.append((bits * odd).sum())
    if not sums:
        return torch.zeros((), dtype=torch.int64)
    stacked = torch.stack(sums)
    mix = torch.arange(len(sums), device=stacked.device, dtype=torch.int64) * 0x9E3779B1 + 1
    return (stacked * mix).sum()


class ReplicaCheck(Handler):
    """Compare the replicas' weights every ``every_steps`` steps (see the module docstring).

    ``dp_group``: the replicas of this rank's shard, a process group or a 1-D device mesh (the
    mesh's ``dp`` dimension under tensor / pipeline parallelism); None: every rank holds a replica.
    """

    state_key = "replica_check"
    restore_on_rollback = False  # the rollbacks made and the mismatches seen outlive a restore
    asks_after_agreement = False
    Config = ReplicaCheckConfig
    section = "replica_check"
    doc = "docs/replica_check.md"

    def __init__(
        self,
        *,
        every_steps: int = 100,
        optimizer_state: bool = False,
        max_rollbacks: int = 1,
        dp_group: Any = None,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k not in ("self", "dp_group", "__class__")}
        checked_settings(ReplicaCheckConfig, {**settings, "enabled": True}, "replica_check")
        self.every_steps, self.optimizer_state, self.max_rollbacks = (
            every_steps,
            optimizer_state,
            max_rollbacks,
        )
        self.dp_group = dp_group
        #: The last step whose weights every replica was seen to hold alike (0: the start).
        self.verified_step = 0
        self.rollbacks = 0
        #: Each mismatch: ``{"step", "checked_step", "ranks", "hosts", "tie"}`` (and the replica
        #: ``"groups"`` of the ranks named, with replica groups).
        self.mismatches: list[dict[str, Any]] = []
        self._groups, self._group = 1, 0
        self._values: list[Any] = []
        self._agreed: list[float] = []
        self._fingerprint: torch.Tensor | None = None
        self._asked = False

    @classmethod
    def from_config(cls, cfg: ReplicaCheckConfig, dp_group: Any = None, **_: Any) -> ReplicaCheck | None:
        if not cfg.enabled:
            return None
        return cls(
            every_steps=cfg.every_steps,
            optimizer_state=cfg.optimizer_state,
            max_rollbacks=cfg.max_rollbacks,
            dp_group=dp_group,
        )

    def attach(self, trainer: Trainer) -> ReplicaCheck:
        _refuse_data_parallel_shards(trainer.model)
        if self.max_rollbacks > 0:
            if not trainer.has_event_handler_for(Events.ROLLBACK):
                raise ConfigError(
                    "replica_check.max_rollbacks",
                    "rolling back needs a checkpointer that answers Events.ROLLBACK: attach an "
                    "AsyncCheckpointer before the ReplicaCheck, or set max_rollbacks=0 (exit 79 at once)",
                )
            trainer.save_policy.want_initial_save()  # a corruption before the first save rolls back to 0
        self._groups, self._group = _replica_groups(self.dp_group)
        for i in range(self._groups * VALUES):
            last = i == self._groups * VALUES - 1
            trainer.agreement.add(
                f"replica_check.{i}", self._filler(i), self._on_agreed if last else self._keep
            )
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_done, priority=REPLICA_ROLLBACK_DONE)
        return super().attach(trainer)

    def due(self, step: int) -> bool:
        """Whether step ``step``'s agreement compares the weights (those step ``step - 1`` left)."""
        return step > 1 and (step - 1) % self.every_steps == 0

    def _filler(self, i: int) -> Any:
        def fill() -> Any:
            if i == 0:
                self._values = self._local_values()
                self._agreed = []
            return self._values[i] if self._values else 0

        return fill

    def _local_values(self) -> list[Any]:
        """This rank's values of the agreement: its group's nine values, zeros elsewhere (nothing
        at all but zeros on a step that does not compare)."""
        trainer = self.trainer
        if not self.due(trainer.state.step):
            self._fingerprint = None
            return []
        tensors = list(trainer.model.parameters())
        if self.optimizer_state:
            for state in trainer.optimizer.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        fp = self._fingerprint = fingerprint(tensors)
        pieces = [((fp >> (16 * j)) & 0xFFFF).to(torch.float64) for j in range(PIECES)]
        # every value a tensor, on every rank: the agreement packs host numbers and tensors apart,
        # so each rank's values must be of the same kinds in the same places
        zero = torch.zeros((), dtype=torch.float64, device=fp.device)
        mine = [zero + 1, *pieces, *(p * p for p in pieces)]
        values: list[Any] = [zero] * (self._groups * VALUES)
        values[self._group * VALUES : (self._group + 1) * VALUES] = mine
        return values

    def _keep(self, value: float) -> None:
        self._agreed.append(value)

    def _on_agreed(self, value: float) -> None:
        self._agreed.append(value)
        trainer = self.trainer
        step = trainer.state.step
        if not self.due(step):
            return
        differ = [g for g in range(self._groups) if not _equal(self._agreed[g * VALUES : (g + 1) * VALUES])]
        if not differ:
            self.verified_step = step - 1
            trainer.save_policy.protect(self.verified_step, by=self.state_key)
            return
        self._mismatch(trainer, step, differ)

    def _mismatch(self, trainer: Trainer, step: int, groups: list[int]) -> None:
        """Every rank alike (from agreed sums): name the replicas that differ, then roll back or stop."""
        assert self._fingerprint is not None
        mine = (parallel.rank(), socket.gethostname(), self._group, int(self._fingerprint))
        # this replica group's ranks, then (with replica groups) every live group's, by group
        by_group = trainer.agreement.transport.across_groups(parallel.gather_objects(mine))
        rows = [(rg, *row) for rg, rows_of in sorted(by_group.items()) for row in rows_of]
        named, tie = [], False
        for g in groups:
            members = [r for r in rows if r[3] == g]
            counts = Counter(r[4] for r in members).most_common()
            top = [fp for fp, n in counts if n == counts[0][1]]
            tie = tie or len(top) > 1
            named += [r for r in members if len(top) > 1 or r[4] != top[0]]
        ranks, hosts = [r[1] for r in named], list(dict.fromkeys(r[2] for r in named))
        mismatch = {"step": step, "checked_step": step - 1, "ranks": ranks, "hosts": hosts, "tie": tie}
        if len(by_group) > 1:
            mismatch["groups"] = [r[0] for r in named]
        self.mismatches.append(mismatch)
        if named:
            group = (lambda r: f"replica group {r[0]} ") if len(by_group) > 1 else (lambda r: "")
            who = ", ".join(f"{group(r)}rank {r[1]} on {r[2]}" for r in named)
            who += " (a tie: cannot tell which replica is wrong)" if tie else " differs"
        else:  # the other replica groups could not be asked (one died): this group's ranks agree
            who = "another replica group differs (this group's ranks agree; the group is not known)"
        what = (
            f"step {step}: replica_check: the weights step {step - 1} left differ between data-parallel "
            f"replicas: {who}; the last step seen equal is {self.verified_step}"
        )
        trainer.save_policy.hold_saves(by=self.state_key)  # nothing saves the differing weights
        if self.rollbacks < self.max_rollbacks:
            self.rollbacks += 1
            self._asked = True
            logger.error(
                "%s; rolling back to the newest checkpoint at or before step %d (rollback %d of %d)",
                what,
                self.verified_step,
                self.rollbacks,
                self.max_rollbacks,
            )
            trainer.control.request_rollback(
                self.verified_step, reason=what, exit_code=ExitCode.REQUEUE_WITHOUT_NODE, nodes=tuple(hosts)
            )
            return
        requeue = f"requeue without {', '.join(hosts)}" if hosts else "requeue (the node is not named)"
        logger.error("%s; exiting %d: %s", what, ExitCode.REQUEUE_WITHOUT_NODE, requeue)
        trainer.control.request_stop(f"{what}: {requeue}", ExitCode.REQUEUE_WITHOUT_NODE, nodes=tuple(hosts))

    def _on_rollback_done(self, trainer: Trainer) -> None:
        """After the checkpointer restored (whoever asked): every replica holds the restored weights
        alike, so a later rollback of this check goes no further than here."""
        self.verified_step = trainer.state.step
        trainer.save_policy.protect(self.verified_step, by=self.state_key)
        if not self._asked:
            return
        self._asked = False
        trainer.save_policy.release_saves(by=self.state_key)
        logger.warning(
            "replica_check: rolled back to step %d; the replicas hold the same weights", self.verified_step
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "verified_step": self.verified_step,
            "rollbacks": self.rollbacks,
            "mismatches": self.mismatches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.verified_step = int(state["verified_step"])
        self.rollbacks = int(state["rollbacks"])
        self.mismatches = list(state["mismatches"])


def _equal(values: list[float]) -> bool:
    """Whether every replica of a group held the same fingerprint, from the group's agreed sums."""
    count = round(values[0])
    if count <= 1:
        return True
    sums, squares = values[1 : 1 + PIECES], values[1 + PIECES :]
    return all(count * round(s2) == round(s1) ** 2 for s1, s2 in zip(sums, squares))


def _replica_groups(dp_group: Any) -> tuple[int, int]:
    """How many groups of replicas the world has, and this rank's group's index among them."""
    world = parallel.world_size()
    if dp_group is None or world == 1:
        return 1, 0
    group = dp_group.get_group() if hasattr(dp_group, "get_group") else dp_group
    members = dist.get_process_group_ranks(group)
    if world % len(members):
        raise ValueError(f"replica_check: a dp group of {len(members)} ranks does not divide {world} ranks")
    firsts = sorted(set(parallel.gather_objects(min(members))))
    return len(firsts), firsts.index(min(members))


def _refuse_data_parallel_shards(model: torch.nn.Module) -> None:
    """FSDP2 shards the weights over the data-parallel ranks: no two ranks of a process group hold
    the same weights, so there is nothing to compare (tensor-parallel shards are fine)."""
    for name, p in model.named_parameters():
        placements = getattr(p, "placements", ())
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ("",) * len(placements)
        if any(pl.is_shard() and dim != "tp" for pl, dim in zip(placements, names)):
            raise ConfigError(
                "replica_check.enabled",
                f"parameter {name!r} is sharded over the data-parallel ranks (FSDP2): no two ranks hold "
                "the same weights to compare; set distributed.dp_mode=ddp or replica_check.enabled=false",
            )
