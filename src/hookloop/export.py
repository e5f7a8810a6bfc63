"""A run's trained model out of its checkpoints: ``hookloop export`` and :func:`load_model`.

::

    hookloop export RUN_DIR [--step N | --best] [--ema] --out DIR

writes the model weights (``--ema``: their moving average, kept by :mod:`hookloop.handlers.ema`) of
one verified checkpoint of ``RUN_DIR`` (its newest by default) as
``DIR/model.safetensors`` under the plain model's parameter names, whatever layout trained it (one
process, DDP, FSDP2, tensor or pipeline parallel, or a mix: DTensor shards are joined, pipeline
stages' names mapped back), with the run's ``config.yaml`` beside it. For a Hugging Face model
(:mod:`hookloop.models.hf`) ``DIR`` also gets the model's ``config.json``: it is a
``save_pretrained`` folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

Only the model's entries of the checkpoint are read, never the optimizer's, a few tensors at a
time (:data:`READ_BYTES`, 16 MiB, per read), each written out before the next are read. The
checkpoint is verified against its manifest first; a damaged one is refused in one line naming
the file (exit code 2). In Python, :func:`load_model` returns the model built from the run's config with
the weights of a checkpoint, in one process, without a process group.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from hookloop.engine.checkpoint_format.directory import MARKER, complete_checkpoints, step_dir_name
from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointIndexBoundError
from hookloop.engine.checkpoint_format.safe_read import SafeLoadPlanner, SafeReader, verify_checkpoint
from hookloop.engine.errors import ConfigError
from hookloop.engine.files import fsync_fd

__all__ = ["export", "load_model", "main"]

#: The most tensor bytes one read of the checkpoint fills (a larger tensor is read alone).
READ_BYTES = 16 << 20
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class _Checkpoint:
    """One verified checkpoint of a run, its model entries by the plain model's names."""

    def __init__(
        self, run_dir: str | os.PathLike, step: int | None = None, best: bool = False, ema: bool = False
    ) -> None:
        from hookloop.handlers.checkpoint.handler_tensors import HANDLERS
        from hookloop.handlers.checkpoint.model_layout import STAGE_PREFIX
        from hookloop.handlers.ema import WeightEMA
        from hookloop.training_config import load_training_config

        self.run_dir = Path(run_dir)
        self.config_path = self.run_dir / "config.yaml"
        if not self.config_path.is_file():
            raise CheckpointError(
                f"{self.config_path} does not exist: {run_dir} is not a hookloop run directory"
            )
        plain = ["distributed.tp_size=1", "distributed.pp_size=1", "fault_tolerance.enabled=false"]
        self.cfg = load_training_config(self.config_path, plain, world_size=1)
        ckpt = self.cfg.checkpoint
        directory = ckpt.directory or str(self.run_dir / "checkpoints")
        self.index_limit = int(ckpt.max_index_mb * (1 << 20))
        self.path = self._choose(directory, step, best)
        self._reader = _CachedReader(self.path, index_limit=self.index_limit)
        averaged_prefix = f"{HANDLERS}.{WeightEMA.state_key}."
        if ema and not self._holds(averaged_prefix):
            raise CheckpointError(
                f"--ema: checkpoint {self.path} holds no moving average of the weights (no "
                f"WeightEMA trained it): this run has no EMA weights ({run_dir})"
            )
        try:
            problems, verified = verify_checkpoint(self.path, 0, 1, self.index_limit)
        except CheckpointIndexBoundError as e:
            raise CheckpointError(str(e)) from None
        if problems:
            raise CheckpointError(f"checkpoint {self.path} is damaged: {problems[0]}")
        if not verified:
            raise CheckpointError(
                f"checkpoint {self.path} has no manifest in its {MARKER} marker to verify it by"
            )
        index = self._reader.read_metadata().state_dict_metadata

        def tensors(prefix: str) -> dict[str, Any]:
            return {
                k.removeprefix(prefix): (k, v)
                for k, v in index.items()
                if k.startswith(prefix) and hasattr(v, "chunks")  # tensors, not byte entries
            }

        stored = tensors("model.")
        if ema:  # the averaged parameters in place of the trained ones; buffers as trained
            averaged = tensors(averaged_prefix)
            stored.update({k: averaged[k] for k in stored if k in averaged})
        split = bool(stored) and all(STAGE_PREFIX.match(k) for k in stored)
        #: plain name -> (the entry's key in the checkpoint, shape, dtype)
        self.entries = {
            (STAGE_PREFIX.sub("", k) if split else k): (key, tuple(v.size), v.properties.dtype)
            for k, (key, v) in sorted(stored.items())
        }
        if len(self.entries) != len(stored):
            raise CheckpointError(f"checkpoint {self.path}: two pipeline stages hold a parameter of one name")

    def _holds(self, prefix: str) -> bool:
        """Whether the checkpoint's index names an entry under ``prefix`` (True when the index
        cannot be read: the verification that follows says what is wrong)."""
        try:
            return any(k.startswith(prefix) for k in self._reader.read_metadata().state_dict_metadata)
        except CheckpointError:
            self._reader = _CachedReader(self.path, index_limit=self.index_limit)
            return True

    def _choose(self, directory: str, step: int | None, best: bool) -> str:
        complete, _ = complete_checkpoints(directory)
        if step is not None:
            path = os.path.join(directory, step_dir_name(step))
            if (step, path) not in complete:
                have = ", ".join(str(s) for s, _ in complete) or "none"
                raise CheckpointError(f"{path} is not a complete checkpoint (complete steps: {have})")
            return path
        if not complete:
            raise CheckpointError(f"{directory} holds no complete checkpoint")
        if not best:
            return complete[0][1]
        ckpt = self.cfg.checkpoint
        if not ckpt.keep_best:
            raise CheckpointError("--best: this run ranks no checkpoints (checkpoint.keep_best is 0)")
        from hookloop.handlers.checkpoint.store import ranked_by_metric

        ranked = ranked_by_metric(complete, ckpt.metric, ckpt.metric_mode)
        if not ranked:
            raise CheckpointError(f"--best: no checkpoint in {directory} records {ckpt.metric}")
        return ranked[0]

    def build(self, device: str | None = None) -> torch.nn.Module:
        """The plain model, built as ``hookloop train`` builds it (on ``device``, e.g. ``meta``)."""
        from hookloop.recipe import resolve_model

        model = resolve_model(self.cfg).build(device)
        wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = {k: shape for k, (_, shape, _) in self.entries.items()}
        if wanted != have:
            from hookloop.handlers.checkpoint.model_layout import describe_layout_difference

            raise CheckpointError(
                f"checkpoint {self.path} holds another model than {self.config_path} builds: "
                f"{describe_layout_difference(have, wanted) or 'other parameters'}"
            )
        return model

    def read(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (plain name -> tensor of the stored shape) from the checkpoint."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException

        from hookloop.handlers.checkpoint.dcp_calls import last_line, quiet_single_process

        target = {self.entries[k][0]: t for k, t in tensors.items()}  # by their flat keys
        with quiet_single_process():
            try:
                load(target, storage_reader=self._reader, planner=SafeLoadPlanner(), no_dist=True)
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as e:  # DCP's error is a BaseException
                raise CheckpointError(f"reading {self.path} failed: {last_line(e)}") from None


class _CachedReader(SafeReader):
    """The safe reader, its index read and checked once for every read of the checkpoint."""

    _metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def load_model(run_dir: str | os.PathLike, step: int | None = None, ema: bool = False) -> torch.nn.Module:
    """The model of run ``run_dir``, built from its ``config.yaml`` as ``hookloop train`` builds it
    (one process, no process group) with the weights of its checkpoint at ``step`` (None: the
    newest), verified first; ``ema``: the moving average of the weights (:mod:`hookloop.handlers.ema`).
    Raises CheckpointError (damaged, missing, no average) or ConfigError."""
    checkpoint = _Checkpoint(run_dir, step, ema=ema)
    model = checkpoint.build()
    state = model.state_dict()
    checkpoint.read(state)
    model.load_state_dict(state)
    return model


def export(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    step: int | None = None,
    best: bool = False,
    ema: bool = False,
) -> Path:
    """Write ``out/model.safetensors`` and ``out/config.yaml`` (plus ``config.json`` for a Hugging
    Face model) from a checkpoint of ``run_dir``; returns the safetensors file. ``ema``: the
    moving average of the weights instead of the trained ones."""
    checkpoint = _Checkpoint(run_dir, step, best, ema)
    shape = checkpoint.build("meta")  # names and shapes checked; no memory
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    partial = out / ".model.safetensors.partial"
    try:
        _write_safetensors(checkpoint, partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    shutil.copyfile(checkpoint.config_path, out / "config.yaml")
    config = getattr(shape, "config", None)
    if callable(getattr(config, "save_pretrained", None)):  # a Hugging Face model
        config.architectures = [type(shape).__name__]
        config.save_pretrained(out)
    return target


def _write_safetensors(checkpoint: _Checkpoint, path: Path) -> None:
    """The safetensors format written tensor by tensor: an 8-byte header length, the JSON header
    (name -> dtype, shape, byte offsets), then the data in the header's order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = budget = 0
    groups: list[list[str]] = [[]]  # the tensors of one read, at most READ_BYTES (or one tensor)
    for name, (_, shape, dtype) in checkpoint.entries.items():
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"checkpoint {checkpoint.path}: {name} is {dtype}, which safetensors cannot hold"
            )
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        if groups[-1] and budget + size > READ_BYTES:
            groups.append([])
            budget = 0
        groups[-1].append(name)
        budget += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for group in groups:
            tensors = {
                n: torch.empty(checkpoint.entries[n][1], dtype=checkpoint.entries[n][2]) for n in group
            }
            checkpoint.read(tensors)
            for name in group:
                f.write(tensors[name].reshape(-1).view(torch.uint8).numpy().data)
            del tensors
        f.flush()
        fsync_fd(f.fileno())


def main(argv: list[str] | None = None, prog: str = "hookloop export") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml and checkpoints)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the newest)"
    )
    which.add_argument("--best", action="store_true", help="the best checkpoint by checkpoint.metric")
    parser.add_argument("--ema", action="store_true", help="the EMA weights instead of the trained ones")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    args = parser.parse_args(argv)
    try:
        written = export(args.run_dir, args.out, args.step, args.best, args.ema)
    except (CheckpointError, ConfigError, OSError) as e:  # OSError: where --out cannot be written
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"exported {written} ({written.stat().st_size:,} bytes) and {args.out / 'config.yaml'}")
    return 0
