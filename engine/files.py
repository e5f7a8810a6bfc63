"""Writing files so a crash leaves the old version or the whole new one, never through a link, and
probing directories.

The one place that knows how: checkpoints (markers, ``latest``, per-rank state), the exit status,
the resolved config and a prepared token file's sidecar all write through :func:`atomic_write`
(a sample trace or a RecordFile is appended to, and cut by truncation and :func:`fsync_fd`); the
run config and the checkpointer check their directories with :func:`check_writable_dir`.

A run writes nothing through a symbolic link: a file it opens in place (the run directory's lock,
``metrics.jsonl``, ``progress.jsonl``, a sample trace, a checkpoint's files) is opened by
:func:`open_no_link`, which refuses a link at that name in one line naming it; a file replaced
whole (:func:`atomic_write`) replaces a link at its name, never the link's target.
"""

from __future__ import annotations

import errno
import os
import uuid

from hookloop.engine.errors import ConfigError

__all__ = ["atomic_write", "check_writable_dir", "fsync_dir", "fsync_fd", "fsync_file", "open_no_link"]


def open_no_link(
    path: str | os.PathLike, flags: int, mode: int = 0o644, *, field: str = "train.run_dir"
) -> int:
    """``os.open(path, flags)`` that never follows a symbolic link at ``path`` (``O_NOFOLLOW``), so
    nothing the run writes lands at the link's target, outside its directory; a link there (to a
    file, a directory, or nowhere) is a :class:`ConfigError` naming ``field`` and the link, and its
    target is left untouched."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno != errno.ELOOP or not os.path.islink(path):
            raise
        raise ConfigError(
            field,
            f"{os.fspath(path)} is a symbolic link (to {os.readlink(path)}); a run writes no file through "
            "a link: remove the link",
        ) from None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in the directory ``path`` durable (as :func:`fsync_file`, the
    contents of the closed file at ``path``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_file = fsync_dir


def fsync_fd(fd: int) -> None:
    """Make the contents of the file open as ``fd`` durable (a writer that fsyncs before it closes)."""
    os.fsync(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` so a reader sees the old file or the whole new one,
    durably: a temporary file of its own beside ``path`` (writers on several nodes may share a pid,
    not a uuid), fsync, rename, fsync of the directory. The temporary file never outlives a failure."""
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with os.fdopen(open_no_link(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def check_writable_dir(field_name: str, directory: str | os.PathLike, *, create: bool = False) -> None:
    """``directory`` is a directory a file can be written in, or can be created as one; a
    :class:`ConfigError` naming ``field_name`` otherwise.

    ``create=False`` checks the nearest existing parent and creates nothing; ``create=True`` makes
    the directory (and its parents) and writes a probe file into it. ``os.access`` says yes to root
    and on read-only file systems, so a probe is always tried; each probe has a name of its own
    (ranks checking at once, on nodes whose pids may be the same, do not collide)."""
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
            _write_probe(directory, "write-test")
        except OSError as e:
            raise ConfigError(
                field_name,
                f"{directory} is not a writable directory ({e}); "
                "pass a directory this process can create and write",
            ) from None
        return
    path = os.path.abspath(directory)
    missing = []
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    problem = None
    if not os.path.isdir(path):
        problem = f"{path} is not a directory"
    elif not os.access(path, os.W_OK | os.X_OK):
        problem = f"{path} is not writable by this user"
    if problem is None:
        try:
            if missing:
                probe = os.path.join(path, f".hookloop-mkdir-test-{uuid.uuid4().hex}")
                os.mkdir(probe)
                os.rmdir(probe)
            else:
                _write_probe(path, "hookloop-write-test")
        except OSError as e:
            problem = f"cannot {'create a directory' if missing else 'write'} in {path} ({e.strerror or e})"
    if problem is not None:
        raise ConfigError(field_name, f"{directory}: {problem}; pick a directory this user can write")


def _write_probe(directory: str | os.PathLike, name: str) -> None:
    probe = os.path.join(directory, f".{name}-{uuid.uuid4().hex}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)
