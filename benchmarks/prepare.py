"""Throughput of ``hookloop prepare`` with a tokenizer against a plain ``encode_batch`` loop.

The corpus is the standard library's source (``--quick``: its first 60 files) written as four
``.jsonl`` files; the tokenizer a byte-level BPE of 4,096 ids trained here on Python's bundled
documentation. Each round, in this one process and in turn:

* reference -- what a user writes by hand: the same files read the same way
  (``datasets.load_dataset("json", ...)`` into a fresh cache), then ``tokenizer.encode_batch`` over
  batches of 1,000 documents, each document's ids and the eos id appended to a uint16 file;
* ``hookloop prepare --num-proc 1`` and ``--num-proc 2`` (the command's own function, in process:
  the interpreter's start-up is not counted).

The three files must be byte-identical (checked). Figures are tokens per second of wall time,
medians over rounds. Usage: ``python benchmarks/prepare.py [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from hookloop.engine.data import stdlib_docs_topics, stdlib_source_files  # noqa: E402
from hookloop.engine.data.prepare import prepare_command  # noqa: E402
from hookloop.engine.data.text_files import documents_from_texts  # noqa: E402
from hookloop.engine.data.tokenizer import train_bpe_tokenizer  # noqa: E402

VOCAB = 4096
SHARDS = 4


def write_corpus(directory: Path, limit: int | None) -> tuple[list[Path], int]:
    """The stdlib source as ``SHARDS`` jsonl files, one document per file of the source."""
    texts = [f.read_text(encoding="utf-8") for f in stdlib_source_files(limit)]
    files = []
    for shard in range(SHARDS):
        path = directory / f"stdlib_{shard}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for text in texts[shard::SHARDS]:
                fh.write(json.dumps({"text": text}) + "\n")
        files.append(path)
    return files, sum(len(t.encode()) for t in texts)


def reference(files: list[Path], tokenizer_dir: Path, out: Path) -> None:
    """The plain loop: read with datasets, encode_batch, append ids + eos to a file."""
    import datasets
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    cache = tempfile.mkdtemp(dir=out.parent)
    try:
        ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=cache)
        with open(out, "wb") as fh:
            for batch in ds.iter(batch_size=1000):
                ids: list[int] = []
                for encoding in tokenizer.encode_batch(batch["text"], add_special_tokens=False):
                    ids.extend(encoding.ids)
                    ids.append(eos)
                np.array(ids, dtype="<u2").tofile(fh)
    finally:
        shutil.rmtree(cache)


def hookloop_prepare(files: list[Path], tokenizer_dir: Path, out: Path, num_proc: int) -> None:
    args = [str(out), "--files", *map(str, files), "--tokenizer", str(tokenizer_dir)]
    args += ["--num-proc", str(num_proc)]
    with contextlib.redirect_stdout(io.StringIO()):
        code = prepare_command(args)
    if code != 0:
        raise SystemExit(f"hookloop prepare exited {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 source files, 2 rounds")
    parser.add_argument("--json", type=Path, help="also write the figures here (see benchmarks/run.py)")
    args = parser.parse_args()
    limit, rounds = (60, 2) if args.quick else (None, 5)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files, size = write_corpus(work, limit)
        tokenizer_dir = work / "bpe"
        train_bpe_tokenizer([stdlib_docs_topics()], tokenizer_dir, VOCAB)
        ds = documents_from_texts(["x"])  # warm datasets' imports before anything is timed
        del ds
        runs = {
            "reference": lambda out: reference(files, tokenizer_dir, out),
            "num_proc_1": lambda out: hookloop_prepare(files, tokenizer_dir, out, 1),
            "num_proc_2": lambda out: hookloop_prepare(files, tokenizer_dir, out, 2),
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        tokens = 0
        load = os.getloadavg()
        for _ in range(rounds):
            outputs = {}
            for name, run in runs.items():
                out = work / f"{name}.bin"
                start = time.perf_counter()
                run(out)
                seconds[name].append(time.perf_counter() - start)
                outputs[name] = out.read_bytes()
            if len(set(outputs.values())) != 1:
                raise SystemExit("the three token files differ: the benchmark would compare different work")
            tokens = len(outputs["reference"]) // 2
        load_after = os.getloadavg()
    rate = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    print(f"python {platform.python_version()}, {os.cpu_count()} cores")
    print(f"load average (1 min) {load[0]:.1f} before, {load_after[0]:.1f} after; BPE of {VOCAB} ids")
    print(f"corpus: {len(files)} jsonl files, {size / 1e6:.1f} MB of stdlib source, {tokens} tokens")
    for name, times in seconds.items():
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name}: median {statistics.median(times):.2f} s ({shown}), {rate[name] / 1e6:.3f} M tokens/s")
    one, two, ref = rate["num_proc_1"], rate["num_proc_2"], rate["reference"]
    print(f"prepare --num-proc 1 / reference: {one / ref:.3f}; --num-proc 2 / --num-proc 1: {two / one:.3f}")
    if args.json:
        table = [
            {
                "figure": "tokens/s, hookloop prepare --num-proc 1 vs a plain encode_batch loop",
                "hookloop": one / 1e6,
                "reference": ref / 1e6,
                "ratio": one / ref,
                "target": ">= 0.9",
                "met": one / ref >= 0.9,
                "unit": "M tokens/s",
            },
            {
                "figure": "tokens/s, hookloop prepare --num-proc 2 vs --num-proc 1",
                "hookloop": two / 1e6,
                "reference": one / 1e6,
                "ratio": two / one,
                "target": "> 1",
                "met": two / one > 1,
                "unit": "M tokens/s",
            },
        ]
        raw = {"seconds": seconds, "tokens": tokens, "bytes": size}
        notes = (
            "The reference and `hookloop prepare` read the same four .jsonl files with `datasets` and write "
            "the same uint16 file (checked byte for byte each round); `--num-proc 1` tokenizes in the main "
            "process (tokenizers' own threads), `--num-proc 2` in two single-thread workers. The command's "
            "start-up (Python importing torch and datasets) is not in these figures."
        )
        result = {"benchmark": "prepare", "figures": table, "raw": raw, "notes": notes}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
