"""``python -m hookloop``: the ``hookloop`` command (see :mod:`hookloop.cli`)."""

from hookloop.cli import run

run()
