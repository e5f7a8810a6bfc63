"""Peak memory of ``hookloop export``: a run of a GPT larger than the tests' (about 100 MB of fp32
weights and twice that of AdamW state in its checkpoint) trained one step, then exported.

    python benchmarks/export.py [--quick] [--json PATH]

Each measurement runs in a fresh process: its resident set after the imports is the baseline,
the kernel's high-water mark is reset there (``/proc/self/clear_refs``), and the figure is the
peak over the baseline divided by the model's bytes. Reference: DCP's own consolidation
(what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does, through the
checkpointer's reader, which reads the tensors' bytes that DCP's own does not), which reads the
whole checkpoint, optimizer included. ``load_model`` (the model built and filled) is measured too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys
import torch
import hookloop.export, hookloop.train
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from hookloop.engine.checkpoint_format.safe_read import SafeReader


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


mode, run_dir, out = sys.argv[1:4]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here
base = rss("VmRSS:")
if mode == "export":
    hookloop.export.export(run_dir, out)
elif mode == "load_model":
    model = hookloop.train.load_model(run_dir)
else:
    newest = sorted(p for p in os.listdir(f"{run_dir}/checkpoints") if p.startswith("step_"))[-1]
    state = {}  # dcp_to_torch_save, through the checkpointer's reader
    reader = SafeReader(f"{run_dir}/checkpoints/{newest}")
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(state, out + ".pt")
print(json.dumps({"base": base, "peak": rss("VmHWM:")}))
"""


def train(run_dir: Path, layers: int, width: int) -> None:
    args = [
        "train",
        str(REPO / "examples" / "configs" / "gpt_tiny.yaml"),
        f"train.run_dir={run_dir}",
        f"data.cache_dir={run_dir.parent / 'cache'}",
        f"model.n_layers={layers}",
        f"model.d_model={width}",
        "model.n_heads=8",
        "train.seq_len=32",
        "train.local_batch_size=1",
        "step_scheduler.global_batch_size=1",
        "step_scheduler.max_steps=1",
        "step_scheduler.ckpt_every_steps=1",
        "step_scheduler.val_every_steps=null",
        "lr.warmup_steps=0",
        "lr.decay_style=constant",
    ]
    proc = subprocess.run([sys.executable, "-m", "hookloop", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])


def measure(mode: str, run_dir: Path, out: Path) -> tuple[int, int]:
    """``(peak RSS over the baseline, baseline)`` of ``mode`` in a fresh process, in bytes."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(run_dir), str(out)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures["peak"] - figures["base"], figures["base"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width = 2, 256
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        train(run_dir, args.layers, args.width)
        newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
        checkpoint_bytes = sum(p.stat().st_size for p in newest.iterdir() if p.suffix == ".distcp")
        exported = Path(tmp) / "out"
        ours, base = measure("export", run_dir, exported)
        model_bytes = (exported / "model.safetensors").stat().st_size
        reference, _ = measure("dcp_to_torch_save", run_dir, Path(tmp) / "dcp")
        loaded, _ = measure("load_model", run_dir, exported)
    mb = 1 << 20
    print(
        f"model {model_bytes / mb:.0f} MiB ({args.layers} layers, d_model {args.width}), checkpoint "
        f"{checkpoint_bytes / mb:.0f} MiB; peak RSS over the baseline: hookloop export {ours / mb:.0f} MiB, "
        f"dcp_to_torch_save {reference / mb:.0f} MiB, load_model {loaded / mb:.0f} MiB (baseline after "
        f"the imports {base / mb:.0f} MiB)"
    )
    export_figure = {
        "figure": "export: peak RSS / model bytes, hookloop export vs dcp_to_torch_save",
        "hookloop": ours / model_bytes,
        "reference": reference / model_bytes,
        "ratio": ours / reference,
    }
    if not args.quick:  # --quick's 7 MiB model: the reader's fixed ~35 MiB decide its ratio
        export_figure.update(target="<= 1.0 (hookloop)", met=ours / model_bytes <= 1.0)
    figures = [
        export_figure,
        {"figure": "export: peak RSS / model bytes, load_model", "hookloop": loaded / model_bytes},
    ]
    result = {"benchmark": "export", "figures": figures}
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
