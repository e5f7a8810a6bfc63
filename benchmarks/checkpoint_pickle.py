"""How fast the bounded checkpoint unpickler decides: real indexes, the slowest crafted pickles,
and the crafted files that used to crash or stall the loader.

    python benchmarks/checkpoint_pickle.py [--quick] [--json PATH]

Reference: Python's own pure-Python unpickler (``pickle._Unpickler``, no allowlist, no bounds) on
the same real ``.metadata``, side by side. The crafted pickles are the slowest opcode patterns we
could write within the bounds (1-byte opcodes that each do bounded work); their rate bounds how
long the largest index allowed (``METADATA_MAX_BYTES``) takes to decide.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import write_result  # noqa: E402

from hookloop.engine import Trainer  # noqa: E402
from hookloop.engine.checkpoint_format import dcp_pickles as cp  # noqa: E402
from hookloop.handlers.checkpoint import AsyncCheckpointer  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402


def real_index(layers: int) -> bytes:
    """The ``.metadata`` of a real checkpoint (GPT of ``layers`` blocks, AdamW, one rank)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=layers, d_model=32, n_heads=2))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    with tempfile.TemporaryDirectory() as tmp:
        AsyncCheckpointer(tmp, mode="sync").attach(trainer)
        x = torch.randint(0, 64, (2, 17))
        trainer.run([(x[:, :-1], x[:, 1:])], max_steps=1)
        return (Path(tmp) / "step_00000001" / ".metadata").read_bytes()


def _global(module: str, name: str) -> bytes:
    text = b""
    for part in (module, name):
        raw = part.encode()
        text += pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw
    return text + pickle.STACK_GLOBAL


def crafted(size: int) -> dict[str, bytes]:
    """The slowest patterns within the bounds, about ``size`` bytes each."""
    head = pickle.PROTO + b"\x04"
    args = pickle.MARK + pickle.MARK + (pickle.BININT1 + b"\x02") * 100 + pickle.TUPLE + pickle.TUPLE
    p61 = (1 << 61) - 1
    return {
        "DUP POP (no check runs)": head + pickle.NONE + (pickle.DUP + pickle.POP) * (size // 2) + pickle.STOP,
        "DUP TUPLE1 POP (nesting check)": head
        + pickle.NONE
        + (pickle.DUP + pickle.TUPLE1 + pickle.POP) * (size // 3)
        + pickle.STOP,
        "torch.Size REDUCE from the memo (call check)": head
        + _global("torch", "Size")
        + pickle.MEMOIZE
        + args
        + pickle.MEMOIZE
        + pickle.POP
        + (pickle.BINGET + b"\x00" + pickle.BINGET + b"\x01" + pickle.REDUCE + pickle.POP) * (size // 6)
        + pickle.NONE
        + pickle.STOP,
        "1 MB: a dict key nested a million deep": head
        + pickle.EMPTY_DICT
        + pickle.NONE
        + pickle.TUPLE1 * 1_000_000
        + pickle.NONE
        + pickle.SETITEM
        + pickle.STOP,
        "1 MB: 80,000 int keys with one hash": head
        + pickle.EMPTY_DICT
        + pickle.MARK
        + b"".join(
            pickle.LONG1 + b"\x0a" + (k * p61).to_bytes(10, "little", signed=True) + pickle.NONE
            for k in range(1, 80_001)
        )
        + pickle.SETITEMS
        + pickle.STOP,
    }


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            fn()
        except pickle.UnpicklingError:
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--crafted-mb", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.crafted_mb, args.layers = 2, 0.25, 4
    torch.set_num_threads(1)
    figures = []
    data = real_index(args.layers)
    mb = len(data) / 1e6
    ours = seconds(lambda: cp.load_index(data), args.repeats)
    plain = seconds(lambda: pickle._Unpickler(io.BytesIO(data)).load(), args.repeats)
    print(
        f"real index, {len(data)} bytes: bounded {mb / ours:.2f} MB/s, "
        f"pure-Python unpickler {mb / plain:.2f} MB/s"
    )
    figures.append(
        {
            "figure": f"read a real .metadata ({len(data) // 1000} kB), bounded vs pure-Python unpickler",
            "hookloop": mb / ours,
            "reference": mb / plain,
            "ratio": plain / ours,
            "unit": "MB/s",
        }
    )
    slowest = float("inf")
    for name, payload in crafted(int(args.crafted_mb * 1e6)).items():
        repeats = max(1, args.repeats // 3)
        took = seconds(lambda payload=payload: cp.MetadataUnpickler(payload).load(), repeats)
        rate = len(payload) / 1e6 / took
        attack = name.startswith("1 MB")
        if not attack:
            slowest = min(slowest, rate)
        print(f"{name}: {len(payload)} bytes decided in {took:.3f} s ({rate:.2f} MB/s)")
        figures.append(
            {
                "figure": f"crafted pickle, {name}: {'seconds to refuse' if attack else 'MB/s'}",
                "hookloop": took if attack else rate,
                "unit": "s" if attack else "MB/s",
            }
        )
    slowest = min(slowest, mb / ours)  # a real index may read slower than the crafted patterns
    bound = cp.METADATA_MAX_BYTES / 1e6 / slowest
    limit = cp.METADATA_MAX_BYTES >> 20
    print(f"largest index allowed by default ({limit} MiB) at the slowest rate above: {bound:.1f} s")
    figure = f"largest index allowed by default ({limit} MiB), decided at the slowest rate above"
    figures.append({"figure": figure, "hookloop": bound, "unit": "s"})
    result = {"benchmark": "checkpoint_pickle", "figures": figures}
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
