"""The ``fault_tolerance`` section: data parallelism across replica groups that survives losing one.

A fault-tolerant run is several *replica groups*, each launched like a job of its own (one process,
or ``torchrun`` for several), every one holding a whole copy of the model (DDP inside a group works
as usual). Across groups, torchft (an optional extra: ``pip install 'hookloop[torchft]'``) keeps a
quorum of the live groups through a *lighthouse* (``hookloop lighthouse``), averages the gradients
over them each step, and lets a restarted group receive the model, optimizer and run state from a
live peer instead of reading a checkpoint. The runtime is the replica groups' handler
(``handlers/replica_groups.py``); this module holds the section, its rules, and the one adapter
over torchft (:func:`start_manager`, :func:`quorum_id`: the version check and every private
attribute of torchft that hookloop reads), and imports no torchft until a manager is started.
The fields are the dataclass's below (docs/distributed.md has the table).

Group-owned files go under ``<train.run_dir>/replica_group_<g>/`` (:func:`group_run_dir`): the run
directory's lock, ``exit_status.json``, ``config.yaml``, metrics, traces, and the group's checkpoints
(``checkpoint.directory`` null: ``<group dir>/checkpoints``; set: ``<directory>/replica_group_<g>``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from hookloop.engine.checks import check_bool, check_int, check_number, check_str
from hookloop.engine.errors import ConfigError, TrainingAborted
from hookloop.engine.exit_codes import ExitCode

__all__ = [
    "GROUP_ENV",
    "LIGHTHOUSE_ENV",
    "FaultToleranceConfig",
    "check_fault_tolerance",
    "group_dir_name",
    "group_run_dir",
    "quorum_id",
    "start_manager",
    "torchft_installed",
]

logger = logging.getLogger(__name__)

# OmegaConf resolves annotations at run time, so sections spell Optional the old way.
# ruff: noqa: UP045

#: Where a null ``replica_group_id`` / ``lighthouse`` is read from (torchft's own names).
GROUP_ENV = "REPLICA_GROUP_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: The torchft release whose private attributes the adapter below reads.
TORCHFT_VERSION = "0.2.0"
INSTALL_HINT = f"pip install 'hookloop[torchft]' (torchft=={TORCHFT_VERSION})"
_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
_ADDRESS = re.compile(r"^https?://[^\s/:]+(:\d+)?/?$|^https?://\[[0-9a-fA-F:]+\](:\d+)?/?$")


def torchft_installed() -> bool:
    """Whether torchft can be imported (looked up, not imported)."""
    return importlib.util.find_spec("torchft") is not None


def group_dir_name(group: int) -> str:
    return f"replica_group_{group}"


def group_run_dir(run_dir: str | os.PathLike, group: int) -> Path:
    """Where replica group ``group`` keeps its own files: ``<run_dir>/replica_group_<group>``."""
    return Path(run_dir) / group_dir_name(group)


@dataclass
class FaultToleranceConfig:
    """Fault-tolerant data parallelism across replica groups with torchft (see
    :mod:`engine.fault_tolerance`). With ``enabled: false`` (the default) nothing changes and
    torchft is never imported."""

    enabled: bool = False  # data parallelism across replica groups that survives losing one (torchft)
    replica_group_id: Optional[int] = None  # this group: 0..num_replica_groups-1; null: env REPLICA_GROUP_ID
    num_replica_groups: int = 2  # the most groups the run has (fixes each group's share of the data)
    min_replicas: int = 1  # a step commits only when at least this many groups took part
    lighthouse: Optional[str] = None  # the lighthouse, http://host:port; null: env TORCHFT_LIGHTHOUSE
    timeout_s: float = 30.0  # cross-group collectives, a step's commit, a recovering group's transfer
    quorum_timeout_s: float = 120.0  # no quorum of replica groups this long: exit 77
    connect_timeout_s: float = 10.0  # reaching the lighthouse and a peer group's manager
    max_uncommitted_steps: int = 20  # this many uncommitted steps in a row: exit 77

    def validate(self, prefix: str = "fault_tolerance") -> None:
        p = prefix
        check_bool(f"{p}.enabled", self.enabled)
        check_int(f"{p}.num_replica_groups", self.num_replica_groups)
        check_int(f"{p}.replica_group_id", self.replica_group_id, low=0, allow_none=True)
        check_int(f"{p}.min_replicas", self.min_replicas)
        check_str(f"{p}.lighthouse", self.lighthouse, allow_none=True, what="an address http://host:port")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            check_number(f"{p}.{name}", getattr(self, name), positive=True)
        check_int(f"{p}.max_uncommitted_steps", self.max_uncommitted_steps)
        if not self.enabled:
            return
        if self.min_replicas > self.num_replica_groups:
            raise ConfigError(
                f"{p}.min_replicas",
                f"({self.min_replicas}) cannot exceed {p}.num_replica_groups ({self.num_replica_groups}); "
                "to keep training when a group dies it must be at most the groups that remain "
                "(1 for 2 groups)",
            )
        group = self.group_id(p)
        if group >= self.num_replica_groups:
            raise ConfigError(
                f"{p}.replica_group_id",
                f"is {group}, but the groups are 0..{self.num_replica_groups - 1} "
                f"({p}.num_replica_groups={self.num_replica_groups})",
            )
        address = self.lighthouse_address(p)
        if not _ADDRESS.match(address):
            raise ConfigError(
                f"{p}.lighthouse",
                f"{address!r} is not a lighthouse address: write http://host:port (what `hookloop "
                "lighthouse` prints)",
            )
        if not torchft_installed():
            raise ConfigError(f"{p}.enabled", f"needs torchft, which is not installed: {INSTALL_HINT}")

    def group_id(self, prefix: str = "fault_tolerance") -> int:
        """This replica group's id: ``replica_group_id``, else the ``REPLICA_GROUP_ID`` variable."""
        if self.replica_group_id is not None:
            return int(self.replica_group_id)
        value = os.environ.get(GROUP_ENV)
        if value is None or not value.strip().isdigit():
            got = "is not set" if value is None else f"is {value!r}, not a group id"
            raise ConfigError(
                f"{prefix}.replica_group_id",
                f"is null and {GROUP_ENV} {got}: set {prefix}.replica_group_id=<0..N-1> or export "
                f"{GROUP_ENV} for each group's launch",
            )
        return int(value)

    def lighthouse_address(self, prefix: str = "fault_tolerance") -> str:
        """The lighthouse's address: ``lighthouse``, else the ``TORCHFT_LIGHTHOUSE`` variable."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ConfigError(
                f"{prefix}.lighthouse",
                f"is null and {LIGHTHOUSE_ENV} is not set: start one with `hookloop lighthouse` and set "
                f"{prefix}.lighthouse=http://host:port (or export {LIGHTHOUSE_ENV})",
            )
        return address.rstrip("/")


def check_fault_tolerance(cfg: Any, world: int, prefix: str = "fault_tolerance") -> None:
    """The rules that relate ``fault_tolerance`` to the other sections of a run config ``cfg``
    (each section's own rules ran before) for ``world`` ranks per replica group: what runs inside a
    group, the timeouts, and the global batch shared by the groups."""
    ft = getattr(cfg, "fault_tolerance", None)
    if ft is None or not ft.enabled:
        return
    dist = cfg.distributed
    for name, value in (("pp_size", dist.pp_size), ("tp_size", dist.tp_size)):
        if value > 1:
            raise ConfigError(
                f"distributed.{name}",
                f"({value}) is not supported with {prefix}.enabled yet: inside a replica group use "
                f"data parallelism (distributed.dp_mode=ddp), or set {prefix}.enabled=false",
            )
    if dist.dp_mode == "fsdp":
        raise ConfigError(
            "distributed.dp_mode",
            f"'fsdp' is not supported with {prefix}.enabled yet (the recovering group's transfer sends "
            "whole tensors): use distributed.dp_mode=ddp inside each replica group",
        )
    if dist.hang_timeout_s is not None and ft.timeout_s >= dist.hang_timeout_s:
        raise ConfigError(
            f"{prefix}.timeout_s",
            f"({ft.timeout_s} s) must be below distributed.hang_timeout_s ({dist.hang_timeout_s} s): a "
            "lost replica group must end a cross-group collective before the watchdog ends this one",
        )
    nan = getattr(cfg, "nan", None)
    if nan is not None and nan.enabled and nan.action == "rollback":
        raise ConfigError(
            "nan.action",
            f"'rollback' is not supported with {prefix}.enabled yet (each group would restore from its "
            "own checkpoints): use nan.action=warn (a bad step is skipped on every group) or raise",
        )
    sched = getattr(cfg, "step_scheduler", None)
    if sched is not None and sched.enabled:
        share = cfg.train.local_batch_size * world * ft.num_replica_groups
        if sched.global_batch_size % share:
            raise ConfigError(
                "step_scheduler.global_batch_size",
                f"({sched.global_batch_size}) must be a multiple of train.local_batch_size x ranks per "
                f"group x {prefix}.num_replica_groups ({cfg.train.local_batch_size} x {world} x "
                f"{ft.num_replica_groups} = {share}): the global batch is shared by every group",
            )


# ---------------------------------------------------------------------- the adapter over torchft
def check_torchft_version() -> bool:
    """Whether the installed torchft is the release whose private attributes :func:`start_manager`
    and :func:`quorum_id` read; a warning says so when it is not."""
    try:
        found = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        found = "unknown"
    if found != TORCHFT_VERSION:
        logger.warning(
            f"fault_tolerance: torchft {found} is installed, but hookloop is tested with torchft=="
            f"{TORCHFT_VERSION} and reads private parts of it (the manager's quorum id, its HTTP "
            f"transport's server); install {INSTALL_HINT}"
        )
    return found == TORCHFT_VERSION


def start_manager(cfg: FaultToleranceConfig, *, group_name: str, rank: int, world: int) -> tuple:
    """torchft's ``Manager`` for this process of replica group ``group_name``: ``(manager, process
    group, heal transport, store)``. Its store: a one-process group hosts its own (``store`` is then
    that ``TCPStore``, else None); the cross-group process group; the HTTP heal transport, its
    server's line per request silenced; the lighthouse connection."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's INFO lines cost 2-3x per step
    try:
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise TrainingAborted(f"fault_tolerance needs torchft ({e}): {INSTALL_HINT}", ExitCode.ERROR) from e
    check_torchft_version()
    for name in _TORCHFT_LOGGERS:  # hookloop says what matters in one line; torchft's stay quiet
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torch.load of a received state over a read-only buffer: harmless, tensors are copied in
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    import torch

    store = None
    if world == 1:  # no launcher store: host the group's own
        host = socket.gethostname()
        store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = host, store.port
    else:
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=cfg.timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=cfg.min_replicas,
        use_async_quorum=False,  # the quorum (and a heal) lands before the step's data is fetched
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
        rank=rank,
        world_size=world,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=cfg.lighthouse_address(),
        replica_id=group_name,
        checkpoint_transport=transport,
    )
    with contextlib.suppress(AttributeError):  # its HTTP server's line per request, on stderr
        transport._server.RequestHandlerClass.log_message = lambda *args: None
    return manager, pg, transport, store


def quorum_id(manager: Any) -> int:
    """The id of ``manager``'s current quorum (torchft keeps it private): it changes when the set
    of live groups does."""
    return manager._quorum_id
