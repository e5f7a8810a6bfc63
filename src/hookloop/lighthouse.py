"""``hookloop lighthouse``: the quorum server a fault-tolerant run's replica groups report to.

::

    hookloop lighthouse --bind 0.0.0.0:29510 --min-replicas 1

starts torchft's lighthouse (the optional extra: ``pip install 'hookloop[torchft]'``), prints one
line with the address to give the groups (``fault_tolerance.lighthouse`` or ``TORCHFT_LIGHTHOUSE``)
and serves until SIGTERM or Ctrl-C (exit 0). It is torchft's ``torchft_lighthouse`` with defaults
chosen for training rather than for torchft's own tests: a group that stops heartbeating is dropped
after ``--heartbeat-timeout-ms`` (1000 ms: the survivors' stall per failure; torchft's default is
5000), and a quorum waits ``--join-timeout-ms`` (5000 ms) for groups that heartbeat but have not
asked yet. ``--min-replicas`` must not exceed the groups that survive a failure (1 for 2 groups).
See docs/distributed.md, "Fault tolerance across replica groups".
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from urllib.parse import urlsplit

__all__ = ["advertised_address", "main"]

DEFAULT_BIND = "[::]:29510"


def advertised_address(served: str, bind: str) -> str:
    """The address groups should use: the lighthouse's own (``http://<host name>:<port>``), with the
    bind address's host instead of the host name when the bind names one (``127.0.0.1:0`` ->
    ``http://127.0.0.1:<port>``): a host name may not resolve where the groups run."""
    port = urlsplit(served).port
    host = bind.rsplit(":", 1)[0]
    if host in ("", "[::]", "0.0.0.0", "::"):
        return served.rstrip("/")
    return f"http://{host}:{port}"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="serve the quorum of a fault-tolerant run's replica groups (torchft)"
    )
    parser.add_argument(
        "--bind", default=DEFAULT_BIND, help=f"host:port to listen on (default {DEFAULT_BIND})"
    )
    for flag, default, text in (
        ("--min-replicas", 1, "groups a new quorum needs, at most the groups that survive a failure"),
        ("--heartbeat-timeout-ms", 1000, "drop a group silent this long (the survivors' stall per failure)"),
        ("--join-timeout-ms", 5000, "how long a quorum waits for heartbeating groups not asking yet"),
        ("--quorum-tick-ms", 100, "quorum check interval"),
    ):
        parser.add_argument(flag, type=_positive, default=default, help=f"{text} (default {default})")
    return parser


def main(argv: list[str] | None = None, prog: str = "hookloop lighthouse") -> int:
    """Serve until SIGTERM or SIGINT; return the exit code (2: bad arguments or no torchft)."""
    args = _parser(prog).parse_args(argv)
    if ":" not in args.bind:
        print(f"{prog}: --bind must be host:port (e.g. 0.0.0.0:29510), got {args.bind!r}", flush=True)
        return 2
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-request INFO lines
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        print(f"{prog} needs torchft ({e}): pip install 'hookloop[torchft]' (torchft==0.2.0)", flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except Exception as e:  # noqa: BLE001 - a port in use, an address that does not parse
        print(f"{prog}: cannot serve on {args.bind}: {e}", flush=True)
        return 2
    address = advertised_address(server.address(), args.bind)
    print(
        f"lighthouse: {address} (min replicas {args.min_replicas}, heartbeat timeout "
        f"{args.heartbeat_timeout_ms} ms); give the replica groups fault_tolerance.lighthouse={address}",
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.shutdown()
    print("lighthouse: stopped", flush=True)
    return 0
