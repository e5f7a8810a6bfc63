"""The ``hookloop`` command (also ``python -m hookloop``)::

    hookloop train CONFIG [section.field=value ...]     train (under torchrun too: -m hookloop train)
    hookloop check CONFIG [overrides] [--nproc N]        check everything a run can check up front
                   [--order]                             and print its handlers' order, event by event
    hookloop config [CONFIG] [overrides] [--markdown]    the resolved config, every field explained
    hookloop prepare OUT --files F ... [--tokenizer PATH] write a token file (docs/data.md)
    hookloop plot RUN_DIR [-o PNG]                       draw a run's metrics
    hookloop export RUN_DIR [--step N|--best] --out DIR  a checkpoint's model as one safetensors file
    hookloop lighthouse [--bind H:P] [--min-replicas N]  the quorum server of replica groups (torchft)

``train`` exits with the run's exit code (:class:`hookloop.engine.ExitCode`); every command exits
with 2 and one line naming the field when the config is wrong, before any process group, data or
model exists.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hookloop import threads

__all__ = ["main", "run", "train_script"]

OVERRIDES_HELP = "dotted overrides, e.g. step_scheduler.max_steps=50 train.run_dir=runs/try"


def _command_parser(command: str, prog: str = "hookloop") -> argparse.ArgumentParser:
    helps = {
        "train": "train the model a config names, with the shipped handlers",
        "check": "check a config without starting anything (exit 0 or 2)",
        "config": "print a config resolved, or the reference of every field",
    }
    parser = argparse.ArgumentParser(prog=f"{prog} {command}", description=helps[command])
    if command == "config":
        parser.add_argument("config", type=Path, nargs="?", default=None, help="YAML or TOML run config")
        parser.add_argument("--markdown", action="store_true", help="the reference page as Markdown")
    else:
        parser.add_argument("config", type=Path, help="YAML or TOML run config")
    parser.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    if command == "check":
        parser.add_argument(
            "--nproc",
            type=int,
            default=None,
            help="the world size to check for (default: WORLD_SIZE, else 1)",
        )
        parser.add_argument(
            "--order", action="store_true", help="print every event's handlers in run order, with places"
        )
    return parser


COMMANDS = ("train", "check", "config")
# Commands whose parser and work live in their own module: name -> (module, function, help).
DELEGATED = {
    "prepare": ("hookloop.engine.data.prepare", "prepare_command", "write a token file from text"),
    "plot": ("hookloop.handlers.plot", "main", "draw a run's metrics to a PNG"),
    "export": ("hookloop.export", "main", "write a checkpoint's model as one safetensors file"),
    "lighthouse": (
        "hookloop.lighthouse",
        "main",
        "serve the quorum of a fault-tolerant run's replica groups (torchft)",
    ),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] not in COMMANDS:  # --help, a typo, nothing: argparse explains
        parser = argparse.ArgumentParser(
            prog="hookloop", description="Train, check or explain a hookloop run config."
        )
        sub = parser.add_subparsers(dest="command", required=True)
        for command in COMMANDS:
            sub.add_parser(command, help=_command_parser(command).description, add_help=False)
        for command, (_, _, help_text) in DELEGATED.items():
            sub.add_parser(command, help=help_text, add_help=False)
        parser.parse_args(argv[:1])
    # Overrides may come before or after the options: parse them intermixed.
    args = _command_parser(argv[0]).parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    threads.apply_environment()  # OMP_WAIT_POLICY before torch is imported (not when it is)
    if argv and argv[0] in DELEGATED:
        import importlib

        module, function, _ = DELEGATED[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:], prog=f"hookloop {argv[0]}")
    args = _parse(argv)
    if args.command == "config" and args.config is not None and "=" in args.config.name:
        if not args.config.exists():  # `hookloop config a.b=1`: overrides of the defaults
            args.overrides.insert(0, str(args.config))
            args.config = None
    from hookloop.engine.errors import ConfigError

    if args.command == "train":
        try:
            _refuse_held_run_dir(args.config, args.overrides)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    # The config is loaded, refused or printed without torch (hookloop.training_config).
    from hookloop import training_config

    if args.command == "config" and args.markdown:
        from hookloop.handlers.config_reference import render

        sys.stdout.write(render(training_config.TrainingConfig))
        return 0
    try:
        if args.command == "check" and args.nproc is not None and args.nproc < 1:
            raise ConfigError("--nproc", f"must be a world size >= 1, got {args.nproc}")
        world = args.nproc if args.command == "check" else None
        if args.command == "config" and args.config is None and not args.overrides:
            cfg = training_config.TrainingConfig()  # every field at its default, as the reference lists them
        else:
            cfg = training_config.load_training_config(args.config, args.overrides, world_size=world)
    except ConfigError as e:
        training_config.report_config_error(e)
        return 2
    if args.command == "config":
        from hookloop.handlers.config_reference import annotated_yaml

        sys.stdout.write(annotated_yaml(cfg))
        return 0
    if args.command == "train" and (finished := training_config.finished_run(cfg)) is not None:
        import logging

        from hookloop.engine.logging_setup import install_default

        install_default()  # the lifecycle line the trainer would log, through the same logger
        step, reason = finished
        logging.getLogger("hookloop.train").info("stopping after step %d: %s", step, reason)
        print(f"done: step {step}, no step left to train, exit code 0 (SUCCESS)", flush=True)
        return 0
    from hookloop import train as training

    try:
        checked = training.check(cfg, world)
    except ConfigError as e:
        training.report_config_error(e)
        return 2
    if args.command == "check":
        own = f", {len(checked.handlers)} handler(s) of its own" if checked.handlers else ""
        tried = f"; {checked.first_step.summary()}" if checked.first_step is not None else ""
        print(
            f"config ok: {args.config} (model {checked.target}{own}, run directory {cfg.train.run_dir})"
            f"{tried}"
        )
        if args.order:
            print(checked.first_step.order)
        return 0
    from hookloop.engine import run_end

    run_end.exit_after_run()  # this process leaves once the run ends (see run_end.exit_after_run)
    return training.train(cfg, checked=checked)


_READ_HERE = (("train", "run_dir"), ("fault_tolerance", "enabled"))


def _refuse_held_run_dir(config: Path, overrides: list[str]) -> None:
    """A run directory another run holds is refused before torch, model or data are loaded: the
    ``train.run_dir`` the file and overrides set (else ``runs/<config stem>``) is read without the
    schema, and its lock taken and given back at once (:mod:`hookloop.engine.run_lock`). Nothing
    is decided here that the full start does not decide again: anything unusual (an unreadable
    file, a run directory that is not a plain string, a launch of several processes, whose ranks
    must agree on it, replica groups, each holding a directory of its own in it) is left to that."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    try:
        import tomllib

        import yaml

        text = config.read_text()
        raw = tomllib.loads(text) if config.suffix == ".toml" else yaml.safe_load(text)
        found = {f"{s}.{k}": (raw.get(s) or {}).get(k) for s, k in _READ_HERE}
        for item in overrides:
            key, _, value = item.partition("=")
            if key.strip() in found:
                found[key.strip()] = yaml.safe_load(value)
    except Exception:  # noqa: BLE001 - the full load reports what is wrong with the file
        return
    run_dir = found["train.run_dir"]
    if found["fault_tolerance.enabled"]:
        return
    if run_dir is None:
        run_dir = str(Path("runs") / config.stem)
    if not isinstance(run_dir, str) or not Path(run_dir).is_dir():
        return  # a directory that does not exist is held by nobody
    from hookloop.engine.run_lock import RunDirLock

    lock = RunDirLock(run_dir)
    lock.acquire()  # RunDirInUse, naming the holder, when a live run holds it
    lock.release()


def train_script(default_config: str | os.PathLike, argv: list[str] | None = None) -> int:
    """A training script's ``main``: ``[--config CONFIG] [overrides]``, ``default_config`` when no
    ``--config`` is given, then ``hookloop train``. Returns the exit code."""
    parser = argparse.ArgumentParser(description=f"hookloop train, with {default_config} by default")
    parser.add_argument("--config", type=Path, default=Path(default_config), help="YAML or TOML config")
    parser.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    args = parser.parse_intermixed_args(argv)
    return main(["train", str(args.config), *args.overrides])


def run(main_function: Callable[[], int] | None = None) -> None:
    """The console script: :func:`main` (or ``main_function``, a training script's), then leave the
    way a gloo process group allows. Torch is imported after the thread settings are made
    (:mod:`hookloop.threads`) when the script has not imported it before."""
    code = main() if main_function is None else main_function()
    if "torch" not in sys.modules:  # a refusal answered before torch: no process group to leave
        sys.exit(code)
    from hookloop.engine.parallel import exit_process

    exit_process(code)


if __name__ == "__main__":
    run()
