"""``hookloop plot RUN_DIR`` (or ``python -m hookloop.handlers.plot``) renders a run's JSONL log to a PNG."""

from __future__ import annotations

import json
import sys

import pytest
from matplotlib.figure import Figure

from hookloop.cli import main as hookloop_main
from hookloop.handlers.plot import load_records, main, panels, plot_run
from tests.dist_utils import run_process

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir) -> None:
    lines = []
    for step in range(2, 21, 2):
        lines.append(
            {
                "step": step,
                "loss": 5.0 - step / 10,
                "lr": 1e-3,
                "tokens_per_s": 1000.0 + step,
                "loss/docs": 5.1 - step / 10,
            }
        )
        if step % 6 == 0:
            lines.append({"step": step, "val_loss": 5.2 - step / 10})
    # a resumed job that re-ran steps 18-20 appends them again: the later record wins
    lines.append({"step": 20, "loss": 1.0})
    (run_dir / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in lines) + "\n" + '{"step": 22, "lo'
    )


def test_load_records_merges_and_keeps_the_last(tmp_path):
    _write_run(tmp_path)
    records = load_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(2, 21, 2)), "the torn last line is skipped"
    assert records[2]["val_loss"] == 5.2 - 0.6 and records[2]["loss"] == 5.0 - 0.6
    assert records[-1]["loss"] == 1.0


def test_plot_command_writes_a_png(tmp_path):
    _write_run(tmp_path)
    result = run_process([sys.executable, "-m", "hookloop.handlers.plot", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr
    png = tmp_path / "metrics.png"
    assert result.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_falls_back_to_the_progress_log_and_explains_a_missing_log(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics.jsonl or progress.jsonl" in capsys.readouterr().err
    (tmp_path / "progress.jsonl").write_text(
        '{"event": "start", "step": 0}\n{"event": "progress", "step": 10, "tokens_per_s": 5.0}\n'
    )
    out = tmp_path / "sub" / "p.png"
    assert main([str(tmp_path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_is_a_subcommand_of_hookloop(tmp_path, capsys):
    _write_run(tmp_path)
    out = tmp_path / "p.png"
    assert hookloop_main(["plot", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit) as exit_info:
        hookloop_main(["plot"])
    assert exit_info.value.code == 2 and "usage: hookloop plot [-h]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hookloop_main(["--help"])
    listing = capsys.readouterr().out
    assert "prepare" in listing and "draw a run's metrics to a PNG" in listing


def test_every_logged_metric_is_drawn_grouped_by_kind(tmp_path, monkeypatch):
    rows = [
        {"step": s, "time": 1.0, "loss": 3.0 - s / 10, "loss_avg": 3.0, "lr": 1e-3, "grad_norm": 0.5,
         "tokens_per_s": 900.0 + s, "samples_per_s": 8.0, "step_time_s": 0.1, "rss_mb": 300.0,
         "tokens_seen": 64 * s, "my_perplexity": 20.0 - s}
        for s in range(1, 11)
    ]  # fmt: skip
    rows += [
        {"step": 5, "val_loss": 2.8, "val_accuracy": 0.4},
        {"step": 10, "val_loss": 2.5, "val_accuracy": 0.6},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = panels(load_records(tmp_path / "metrics.jsonl"))
    assert drawn == {
        "loss": ["loss", "loss_avg", "val_loss"],
        "validation": ["val_accuracy"],
        "learning rate": ["lr"],
        "throughput": ["samples_per_s", "tokens_per_s"],
        "time (s)": ["step_time_s"],
        "optimizer": ["grad_norm"],
        "memory (MB)": ["rss_mb"],
        "counts": ["tokens_seen"],
        "your metrics": ["my_perplexity"],
    }
    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == PNG_MAGIC
    (figure,) = figures
    on_axes = {ax.get_ylabel(): [line.get_label() for line in ax.get_lines()] for ax in figure.axes}
    assert on_axes == drawn  # each metric drawn once, on its kind's panel
