"""Process groups, device mesh, data-parallel wrapping, and the small collectives decisions use.

``torchrun`` is the launcher: :func:`init_distributed` reads its environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). A single process needs no process
group at all, and every helper here degrades to a no-op then.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hookloop.engine.errors import ConfigError, HookloopError
from hookloop.engine.precision import PRECISIONS
from hookloop.engine.tensor_parallel import is_dtensor

__all__ = [
    "DistInfo",
    "agree_any",
    "all_reduce_sum",
    "collective_device",
    "data_parallel_group",
    "is_peer_failure",
    "destroy_distributed",
    "exit_process",
    "init_distributed",
    "leave_together",
    "parallel_mesh",
    "process_group_store",
    "rank",
    "world_size",
    "wrap_data_parallel",
]

DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass
class DistInfo:
    """Where this process sits: ranks, device, and the device mesh (None for one process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh_dim(self, name: str) -> Any:
        """The 1-D mesh of dimension ``name`` (``"dp"``, ``"tp"``, ``"pp"``), or None when the mesh
        has no such dimension (or there is no mesh: one process)."""
        names = getattr(self.mesh, "mesh_dim_names", None) or ()
        return self.mesh[name] if name in names else None

    def dim_size(self, name: str) -> int:
        """The size of mesh dimension ``name``; 1 without it."""
        sub = self.mesh_dim(name)
        return sub.size() if sub is not None else 1

    def dim_rank(self, name: str) -> int:
        """This rank's coordinate along mesh dimension ``name``; 0 without it."""
        sub = self.mesh_dim(name)
        return sub.get_local_rank() if sub is not None else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_distributed(
    backend: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
) -> DistInfo:
    """Join the process group torchrun describes, or return single-process info without one.

    ``backend`` defaults to nccl with CUDA, else gloo. Every collective on the group times out
    after ``timeout_s`` instead of hanging. The mesh defaults to one ``dp`` dimension; with tensor
    and pipeline parallelism it is ``mesh_shape=(dp, pp, tp), mesh_dim_names=("dp", "pp", "tp")``
    (see :func:`parallel_mesh`), which ``tp_size`` / ``pp_size`` ask for without spelling it out.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if (tp_size, pp_size) != (1, 1):
        if mesh_shape is not None:
            raise ValueError("pass either mesh_shape (and mesh_dim_names) or tp_size / pp_size, not both")
        layout = parallel_mesh(env_world, tp_size, pp_size)
        mesh_shape, mesh_dim_names = layout.get("mesh_shape"), layout.get("mesh_dim_names")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ConfigError("distributed.backend", f"must be 'gloo', 'nccl' or None (auto), got {backend!r}")
    if timeout_s <= 0:
        raise ConfigError("distributed.timeout_s", f"must be > 0 seconds, got {timeout_s!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ConfigError("distributed.backend", "nccl needs CUDA; use 'gloo' on CPU")
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if env_world <= 1 and not dist.is_initialized():
        return DistInfo(device=device)
    global _used_process_group
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    _used_process_group = True
    world = dist.get_world_size()
    shape = mesh_shape or (world,)
    names = mesh_dim_names or (("dp",) if len(shape) == 1 else None)
    if int(torch.tensor(shape).prod()) != world:
        raise ConfigError("distributed", f"mesh shape {shape} does not multiply to the world size {world}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return DistInfo(dist.get_rank(), world, local_rank, device, backend, mesh)


_used_process_group = False


def note_process_group_used() -> None:
    """A process group outside torch's default one was used (torchft's): :func:`exit_process`
    leaves through ``os._exit``."""
    global _used_process_group
    _used_process_group = True


def parallel_mesh(world: int, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """``init_distributed`` keyword arguments for a ``dp x tp x pp`` layout of ``world`` ranks:
    none (one ``dp`` dimension) without tp and pp, ``("dp", "pp")`` with pp alone, else the 3-D
    ``("dp", "pp", "tp")`` mesh: the ranks of a ``tp`` group are neighbours (on one node, where
    the links are fastest: tensor parallelism talks in every layer), a pipeline's stages are ``tp``
    ranks apart, and ``rank // (tp * pp)`` is the data-parallel rank. ``tp * pp`` must divide
    ``world``."""
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConfigError(
            "distributed.tp_size", f"tp ({tp}) x pp ({pp}) must divide the world size ({world})"
        )
    if tp == 1 and pp == 1:
        return {}
    if tp == 1:
        return {"mesh_shape": (world // pp, pp), "mesh_dim_names": ("dp", "pp")}
    return {"mesh_shape": (world // (tp * pp), pp, tp), "mesh_dim_names": ("dp", "pp", "tp")}


def exit_process(code: int) -> None:
    """Flush, leave the process group, and exit with ``code``.

    After a gloo process group was used, the interpreter's own shutdown can abort now and then
    ("terminate called without an active exception"), turning a clean exit into SIGABRT and losing
    the exit code a job script relies on; leaving through ``os._exit`` after the flush avoids it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    destroy_distributed()
    if _used_process_group:
        os._exit(int(code))
    sys.exit(int(code))


def process_group_store() -> Any:
    """The key-value store the default process group was set up with (TCPStore, or the one
    torchrun's agent hosts), or None without a process group: a channel between ranks that no
    collective uses. Its operations wait at most the process group's timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a torch without it, or a group without one
        return None


def bounded_call(operation: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """``operation()`` on a daemon thread of its own (``name``), waited for at most ``timeout_s``:
    its value, or None when it raised or did not answer in time. For store operations, which a
    store hosted by a stopped process never answers."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = operation()
        except Exception as e:  # noqa: BLE001 - a store gone or silent: no value
            logging.getLogger(__name__).debug("%s: %r", name, e)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result.get("value")


_leaving = 0  # how many times this process left together (a key per time)


def leave_together(store: Any, world: int, timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until all ``world`` ranks have called this with the process
    group's ``store`` (:func:`process_group_store`, taken before the group is destroyed). Ranks that
    reached an agreed end then exit within moments of each other, so a launcher that stops the
    other workers once one exits non-zero (torchrun, on the 75 of an agreed stop) never cuts off a
    rank still writing the run's records. False when a rank did not arrive in time."""
    global _leaving
    _leaving += 1
    key = f"hookloop/leaving/{_leaving}"

    def arrive() -> bool:
        if store.add(key, 1) == world:  # the last to arrive lets everyone go
            store.set(f"{key}/all", b"1")
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
        return True

    return bool(bounded_call(arrive, timeout_s + 1.0, "hookloop-leave-together"))


def destroy_distributed() -> None:
    """Leave the process group (call before exit, after checkpoints are drained)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _per_block(wrap: Callable[..., Any], model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """``wrap`` each of the model's repeated layers (``blocks`` or ``layers``, also under a Hugging
    Face model's decoder, ``model.model.layers``) as its own FSDP2 unit, then the model itself."""
    inner = getattr(model, "base_model_prefix", None)
    for owner in (model, getattr(model, inner, None) if isinstance(inner, str) and inner else None):
        blocks = getattr(owner, "blocks", None) or getattr(owner, "layers", None)
        if isinstance(blocks, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            for block in blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks:
                wrap(block, **kwargs)
            break
    wrap(model, **kwargs)
    return model


def wrap_data_parallel(
    model: torch.nn.Module, mode: str = "ddp", *, mesh: Any = None, mixed_precision: Any = None
) -> torch.nn.Module:
    """Wrap ``model`` for data parallelism: ``"ddp"`` (DistributedDataParallel), ``"fsdp"``
    (FSDP2 ``fully_shard`` on each block, a Hugging Face decoder's layers too, then the root) or
    ``"none"``. One process: unchanged.

    ``mixed_precision`` (FSDP2 only; DDP ignores it): ``"bf16-mixed"`` shards with
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (bf16 compute copies of
    the fp32 shards, gradients reduced in fp32), or pass a ``MixedPrecisionPolicy`` itself;
    None, ``"fp32"`` and ``"fp16-mixed"`` (autocast and a GradScaler do that) keep fp32 params.

    A tensor-parallel model (DTensor parameters, :mod:`engine.tensor_parallel`) is wrapped over
    ``mesh``, its data-parallel mesh dimension: ``"fsdp"`` shards it there too (2-D parameters),
    ``"ddp"`` replicates it with torch's FSDP2-based ``replicate`` (DDP's semantics; plain
    ``DistributedDataParallel`` cannot hold DTensors). A mesh of size 1 leaves the model as it is."""
    if mode not in ("ddp", "fsdp", "none"):
        raise ConfigError("distributed.dp_mode", f"must be 'ddp', 'fsdp' or 'none', got {mode!r}")
    if isinstance(mixed_precision, str) and mixed_precision not in PRECISIONS:
        names = ", ".join(repr(p) for p in PRECISIONS)
        raise ConfigError(
            "mixed_precision", f"must be {names}, a MixedPrecisionPolicy or None, got {mixed_precision!r}"
        )
    if mode == "none" or world_size() == 1 or (mesh is not None and mesh.size() == 1):
        return model
    if mode == "ddp" and any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return _per_block(replicate, model, mesh=mesh)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        process_group = mesh.get_group() if mesh is not None else None
        return DistributedDataParallel(model, device_ids=device_ids, process_group=process_group)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision is None or isinstance(mixed_precision, str):
        policy = MixedPrecisionPolicy()
    elif isinstance(mixed_precision, MixedPrecisionPolicy):
        policy = mixed_precision
    else:
        raise TypeError(
            "mixed_precision must be a precision name or a MixedPrecisionPolicy, "
            f"got {type(mixed_precision).__name__}"
        )
    return _per_block(fully_shard, model, mesh=mesh, mp_policy=policy)


def collective_device(group: Any = None) -> torch.device:
    """Where tensors for a collective must live: CUDA for nccl, CPU for gloo (and without a group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks (a copy on the input's device). One process: unchanged."""
    if world_size() == 1:
        return tensor
    out = tensor.detach().to(collective_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(tensor.device)


def data_parallel_group(dp: Any = None, *, positions: tuple[int, ...] = ()) -> Any:
    """The process group of this rank's data-parallel peers: the ranks holding the same part of the
    model, whose samples differ (tensor-parallel ranks see the same samples, pipeline stages the
    same batches). None when this rank is its own group (one process, or a data-parallel size of 1).

    ``dp``: the group, given as a process group or a 1-D device mesh (``info.mesh_dim("dp")``).
    Without it the group is found from ``positions``, this rank's place in the model (e.g. its
    tensor-parallel rank and pipeline rank; none: the whole world is data-parallel): one all-gather
    over the world and, when the peers are a strict part of it, new process groups. Every rank must
    call it together."""
    if world_size() == 1:
        return None
    if dp is not None:
        if hasattr(dp, "get_group"):  # a 1-D device mesh
            return dp.get_group() if dp.size() > 1 else None
        return dp if dist.get_world_size(dp) > 1 else None
    if not positions:
        return dist.group.WORLD
    peers: dict[Any, list[int]] = {}
    for r, position in enumerate(gather_objects(tuple(positions))):
        peers.setdefault(position, []).append(r)
    groups = sorted(peers.values())
    if len(groups) == 1:
        return dist.group.WORLD
    if all(len(g) == 1 for g in groups):
        return None
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine if len(peers[tuple(positions)]) > 1 else None


_PEER_FAILURE_MARKS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "socket timeout",
    "gloo/transport",
    "nccl communicator was aborted",
    "watchdog caught collective operation timeout",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank is gone or hung."""
    if world_size() == 1 or not isinstance(error, RuntimeError) or isinstance(error, HookloopError):
        return False
    backend_error = getattr(dist, "DistBackendError", ())
    network_error = getattr(dist, "DistNetworkError", ())
    message = str(error).lower()
    if isinstance(error, (backend_error, network_error)):
        return True
    return any(mark in message for mark in _PEER_FAILURE_MARKS) and (
        "gloo" in message or "nccl" in message or "peer" in message or "timed out" in message
    )


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (one ``all_gather_object``: for rare decisions only)."""
    if world_size() == 1:
        return [obj]
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def agree_any(flag: bool, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on any rank: how skip/stop/save are agreed."""
    if world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t[0])
