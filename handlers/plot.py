"""Render a run's metrics log to a PNG: ``hookloop plot RUN_DIR [-o out.png]``.

``python -m hookloop.handlers.plot RUN_DIR`` is the same command.

Reads ``RUN_DIR/metrics.jsonl`` (written by :class:`~handlers.jsonl_logger.JSONLLogger`), falling back
to ``RUN_DIR/progress.jsonl`` (written by :class:`~handlers.metrics.MetricsTracker`), and draws three
panels against the step: loss (train, its average, validation, and ``loss/<dataset>`` per dataset),
learning rate, and throughput (tokens/s). A step logged more than once (a run resumed from an
earlier checkpoint) keeps its last record. matplotlib is imported only here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_events", "load_records", "main", "plot_run"]

# progress.jsonl lines that mark a moment of the run rather than carry metrics
_EVENTS = ("start", "resume", "rollback")


def load_events(run_dir: str | os.PathLike) -> dict[str, list[int]]:
    """Steps of the resumes and rollbacks (the step rolled back to) recorded in
    ``run_dir/progress.jsonl`` by the MetricsTracker: ``{"resume": [...], "rollback": [...]}``."""
    events: dict[str, list[int]] = {"resume": [], "rollback": []}
    path = Path(run_dir) / "progress.jsonl"
    if not path.is_file():
        return events
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") in events and "step" in record:
                events[record["event"]].append(int(record["step"]))
    return events


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSONL log by step (the last record of a step wins, values merged), sorted."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n > 1:  # a torn last line from a killed job: skip it
                    continue
                raise
            if not isinstance(record, dict) or "step" not in record or record.get("event") in _EVENTS:
                continue
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_run(run_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> Path:
    """Draw the run in ``run_dir`` to ``output`` (default ``run_dir/metrics.png``); returns the path."""
    run_dir = Path(run_dir)
    source = next((run_dir / n for n in ("metrics.jsonl", "progress.jsonl") if (run_dir / n).is_file()), None)
    if source is None:
        raise FileNotFoundError(
            f"no metrics.jsonl or progress.jsonl in {run_dir}: pass the run directory a JSONLLogger or "
            "MetricsTracker wrote to"
        )
    records = load_records(source)
    if not records:
        raise ValueError(f"{source} holds no step records to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr, ax_tp) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    keys = sorted({k for r in records for k in r})
    for key, label, style in (
        ("loss", "train", "-"),
        ("loss_avg", "train (avg)", "-"),
        ("val_loss", "val", "o-"),
    ):
        xs, ys = _series(records, key)
        if xs:
            ax_loss.plot(xs, ys, style, label=label, markersize=3)
    for key in keys:
        if key.startswith(("loss/", "val_loss/")):
            xs, ys = _series(records, key)
            if xs:
                ax_loss.plot(xs, ys, "--", label=key, linewidth=1)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{run_dir.name} ({source.name})")
    xs, ys = _series(records, "lr")
    if xs:
        ax_lr.plot(xs, ys)
    ax_lr.set_ylabel("learning rate")
    xs, ys = _series(records, "tokens_per_s")
    if xs:
        ax_tp.plot(xs, ys)
    ax_tp.set_ylabel("tokens / s")
    ax_tp.set_xlabel("step")
    markers = load_events(run_dir)
    for kind, color in (("resume", "tab:green"), ("rollback", "tab:red")):
        for i, step in enumerate(markers[kind]):
            for ax in (ax_loss, ax_lr, ax_tp):
                ax.axvline(
                    step,
                    color=color,
                    linestyle=":",
                    linewidth=1,
                    label=kind if ax is ax_loss and i == 0 else None,
                )
    for ax in (ax_loss, ax_lr, ax_tp):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(output) if output is not None else run_dir / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m hookloop.handlers.plot") -> int:
    """``hookloop plot`` (and ``python -m hookloop.handlers.plot``); returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="directory holding metrics.jsonl or progress.jsonl")
    parser.add_argument("-o", "--output", help="PNG path (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
