"""The ``replica_check`` section (:class:`hookloop.handlers.replica_check.ReplicaCheck`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookloop.engine.checks import check_bool, check_int, dotted
from hookloop.engine.errors import ConfigError

__all__ = ["ReplicaCheckConfig"]


@dataclass
class ReplicaCheckConfig:
    """The ``replica_check`` section: compare the data-parallel replicas' weights for silent data
    corruption (see :class:`~hookloop.handlers.replica_check.ReplicaCheck`, ``docs/replica_check.md``).

    The weights steps ``every_steps``, 2 x ``every_steps``, ... leave (what a checkpoint of those
    steps holds) are fingerprinted and compared in the next step's agreement. A replica that differs
    is named (rank and host); the run rolls back to the newest checkpoint whose weights were seen
    equal, at most ``max_rollbacks`` times, then exits 79 (requeue without the node).
    """

    enabled: bool = False
    every_steps: int = 100  # compare the weights every this many steps (no cost on other steps)
    optimizer_state: bool = False  # fingerprint the optimizer state too
    max_rollbacks: int = 1  # rollbacks to the last equal checkpoint; then (0: at once) exit 79

    def validate(self, prefix: str = "replica_check") -> None:
        """The only copy of the section's rules."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_int(dotted(prefix, "every_steps"), self.every_steps, low=1)
        check_bool(dotted(prefix, "optimizer_state"), self.optimizer_state)
        check_int(dotted(prefix, "max_rollbacks"), self.max_rollbacks, low=0)

    def cross_check(self, cfg: Any, prefix: str = "replica_check") -> None:
        """FSDP2 shards the weights over the data-parallel ranks: no two hold the same to compare."""
        distributed = getattr(cfg, "distributed", None)
        if self.enabled and distributed is not None and distributed.dp_mode == "fsdp":
            raise ConfigError(
                dotted(prefix, "enabled"),
                "compares the data-parallel replicas' weights, but distributed.dp_mode=fsdp (FSDP2) "
                "shards them so that no two ranks hold the same; set distributed.dp_mode=ddp or "
                f"{dotted(prefix, 'enabled')}=false",
            )
