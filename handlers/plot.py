"""Render a run's metrics log to a PNG: ``hookloop plot RUN_DIR [-o out.png]``.

``python -m hookloop.handlers.plot RUN_DIR`` is the same command.

Reads ``RUN_DIR/metrics.jsonl`` (written by :class:`~handlers.jsonl_logger.JSONLLogger`), falling back
to ``RUN_DIR/progress.jsonl`` (written by :class:`~handlers.metrics.MetricsTracker`), and draws every
logged metric against the step, one panel per kind (:func:`panels`): loss (train, its average,
validation and ``loss/<dataset>``), the other validation metrics (``val_accuracy``), learning rate,
throughput (``*_per_s``, TFLOP/s, MFU; a log scale), times, optimizer figures (grad norm, skipped
steps), memory, counts, and the user's own metrics. Resumes and rollbacks are marked on every panel.
A step logged more than once keeps its last record. matplotlib is imported only here.
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

__all__ = ["load_events", "load_records", "main", "panels", "plot_run"]

# progress.jsonl lines that mark a moment of the run rather than carry metrics
_EVENTS = ("start", "resume", "rollback")
# keys of a record that are not metrics
_NOT_METRICS = ("step", "time", "event", "job_start")
# the panels in the order drawn; the user's own metrics (any other name) come last
_OWN = "your metrics"
_KINDS = (
    "loss",
    "validation",
    "learning rate",
    "throughput",
    "time (s)",
    "optimizer",
    "memory (MB)",
    "counts",
)
_KINDS += (_OWN,)


def _kind(name: str) -> str:
    """The panel a metric is drawn on."""
    if "loss" in name:
        return "loss"
    if name.startswith(("val_", "val/")):
        return "validation"
    if name == "lr" or name.startswith("lr/"):
        return "learning rate"
    if name.endswith("_per_s") or "tflops" in name or name == "mfu":
        return "throughput"
    if name.endswith("_time_s"):
        return "time (s)"
    if name in ("grad_norm", "skipped_steps"):
        return "optimizer"
    if name.endswith("_mb"):
        return "memory (MB)"
    if name in ("tokens_seen", "samples_seen", "flops"):
        return "counts"
    return _OWN


def panels(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{panel: [metric, ...]}``: every metric with a finite number in ``records``, grouped by kind
    (the panels :func:`plot_run` draws, in its order; empty panels left out)."""
    names = sorted({k for r in records for k in r if k not in _NOT_METRICS and _series([r], k)[0]})
    grouped: dict[str, list[str]] = {kind: [] for kind in _KINDS}
    for name in names:
        grouped[_kind(name)].append(name)
    for kind in ("loss", "validation"):  # the train loss and val_loss first, then per dataset
        grouped[kind].sort(key=lambda n: ("/" in n, n.startswith("val"), n))
    return {kind: names for kind, names in grouped.items() if names}


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

    drawn = panels(records)
    fig, axes = plt.subplots(len(drawn), 1, figsize=(9, 2.6 * len(drawn) + 0.6), sharex=True, squeeze=False)
    axes = [row[0] for row in axes]
    markers = load_events(run_dir)
    for ax, (kind, names) in zip(axes, drawn.items()):
        for name in names:
            xs, ys = _series(records, name)
            sparse = len(xs) < 0.5 * len(records)  # validation: a point now and then
            ax.plot(
                xs, ys, "o-" if sparse else "-", label=name, markersize=3, linewidth=1 if "/" in name else 1.5
            )
        if kind == "throughput" and all(y > 0 for name in names for y in _series(records, name)[1]):
            ax.set_yscale("log")
        ax.set_ylabel(kind)
        for event, color in (("resume", "tab:green"), ("rollback", "tab:red")):
            for i, step in enumerate(markers[event]):
                label = event if ax is axes[0] and i == 0 else None
                ax.axvline(step, color=color, linestyle=":", linewidth=1, label=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title(f"{run_dir.name} ({source.name})")
    axes[-1].set_xlabel("step")
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
