"""What ``hookloop train`` reads: :data:`TrainingConfig` (every shipped section),
loading it and saving it. Imports no torch: ``hookloop config``, a wrong key or value and a finished
run are answered without it. What is checked beyond the config (the model, the data, step 1) is
:func:`hookloop.run_check.check`'s.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.handlers.run_config import RunConfig, load_run_config

__all__ = [
    "TrainingConfig",
    "load_training_config",
    "report_config_error",
    "resolve_run_dir",
    "config_text",
    "finished_run",
    "save_config",
]


#: What ``hookloop train`` reads: every shipped section.
TrainingConfig = RunConfig


def resolve_run_dir(cfg: Any, config_path: str | os.PathLike | None) -> Path:
    """``train.run_dir`` null becomes ``runs/<config file stem>`` (``runs/gpt_tiny``), so each
    config trains in its own directory; a set one is kept. Returns the run directory."""
    if cfg.train.run_dir is None:
        stem = Path(config_path).stem if config_path is not None else "default"
        cfg.train.run_dir = str(Path("runs") / stem)
    return Path(cfg.train.run_dir)


def load_training_config(
    path: str | os.PathLike | None,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    world_size: int | None = None,
) -> Any:
    """A :data:`TrainingConfig` from a YAML/TOML file and dotted overrides, validated for
    ``world_size`` (default: torchrun's ``WORLD_SIZE``, else 1), with its run directory resolved."""
    cfg = load_run_config(path, overrides, schema=TrainingConfig, world_size=world_size)
    resolve_run_dir(cfg, path)
    return cfg


def report_config_error(error: ConfigError) -> None:
    """One line on stderr, ``config error: <field>: ...``; under torchrun every rank finds the same
    error before any process group exists, and only rank 0 says it. The other ranks wait (at most
    :data:`CONFIG_ERROR_WAIT_S`) in the launcher's store until rank 0 has said it: a rank that
    exited first would have torchrun stop rank 0 before its line. A rank that waited in vain says
    the line itself, so it is never lost."""
    line = f"config error: {error}"
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)  # first: reaching the store may take its timeout
        store = _launcher_store()
        if store is not None:
            store.set(_SAID_KEY, "1")
        return
    store = _launcher_store()
    if store is None:
        return
    try:
        store.wait([_SAID_KEY], timedelta(seconds=CONFIG_ERROR_WAIT_S))
    except Exception:  # rank 0 did not say it in time (or is gone): say it here
        print(line, file=sys.stderr, flush=True)


CONFIG_ERROR_WAIT_S = 30.0
_SAID_KEY = "hookloop/config_error_said"


def _launcher_store() -> Any:
    """A client of torchrun's own store (its agent hosts one at ``MASTER_ADDR:MASTER_PORT`` for
    every attempt), or None outside torchrun, in one process, or when it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("WORLD_SIZE", "1") == "1":
        return None
    try:
        import torch

        return torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=CONFIG_ERROR_WAIT_S),
        )
    except Exception:
        return None


def config_text(cfg: Any) -> str:
    """The resolved config as ``<run_dir>/config.yaml`` holds it."""
    from omegaconf import OmegaConf

    header = "# The resolved config of this run: every field, defaults included.\n"
    return header + OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to ``<run_dir>/config.yaml`` (atomically: a reader never sees half
    a file), creating the run directory. ``hookloop train <run_dir>/config.yaml`` trains the same
    run again."""
    from hookloop.engine.files import atomic_write

    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, config_text(cfg))
    return path


def finished_run(cfg: Any) -> tuple[int, str] | None:
    """``(step, reason)`` when the run directory's own records say, for certain, that ``cfg`` has
    nothing left to train, else None (then the checkpointer decides, after loading the checkpoint).

    Certain means: one process, no replica groups, checkpoints resumed automatically, a
    ``step_scheduler.max_steps``; the run ended with exit code 0 (``exit_status.json``) naming the
    newest complete checkpoint, whose marker says a step >= max_steps and whose files match its
    manifest (sizes and checksums: reads the checkpoint once, as the full start would); and the run's
    ``config.yaml`` is this very config (any change, a new max_steps, LR or model size, is left to
    the full start, which honours or refuses it). Reads a few small files; imports no torch."""
    from hookloop.engine.checkpoint_format.directory import MARKER, read_json, resolve_checkpoint
    from hookloop.engine.exit_status import nothing_left_to_train, read_exit_status

    ckpt, sched = cfg.checkpoint, cfg.step_scheduler
    if os.environ.get("WORLD_SIZE", "1") != "1" or cfg.fault_tolerance.enabled:
        return None
    if not (ckpt.enabled and ckpt.resume == "auto" and sched.enabled and sched.max_steps is not None):
        return None
    run_dir = Path(cfg.train.run_dir)
    try:
        status = read_exit_status(run_dir)
        if not status or status.get("code") != 0 or not status.get("checkpoint"):
            return None
        newest, _ = resolve_checkpoint(ckpt.directory or run_dir / "checkpoints")
        marker = read_json(os.path.join(newest, MARKER))
        step = marker["step"]
        same = os.path.abspath(status["checkpoint"]) == newest
        recorded = (run_dir / "config.yaml").read_text()
        if not (same and step >= sched.max_steps and recorded == config_text(cfg)):
            return None
        if not _intact(newest, marker["manifest"]["files"]):
            return None  # the full start falls back to an older checkpoint: steps are left
    except Exception:  # noqa: BLE001 - anything unusual is the full start's to report
        return None
    return step, nothing_left_to_train(newest, step, sched.max_steps)


def _intact(path: str, files: dict[str, Any]) -> bool:
    """Whether every file the manifest of checkpoint ``path`` lists has its size and CRC-32, as the
    full start verifies before it trusts the checkpoint (a damaged one it falls back from)."""
    from zlib import crc32  # the values of the manifest's (zlib-ng's, without importing torch)

    for name, entry in files.items():
        crc, size = 0, 0
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(4 << 20):
                crc, size = crc32(chunk, crc), size + len(chunk)
        if size != entry["size"] or f"{crc:08x}" != entry["checksum"]:
            return False
    return True
