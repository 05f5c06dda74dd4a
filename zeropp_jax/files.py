"""Writing an output file (metrics, an export) the way its path means it.

A regular file, or a new one, is replaced atomically: the data goes to a
temporary file beside it, renamed over it, so a kill leaves the old file
whole. The path may be a symlink: its target is replaced, the link kept.
Anything else that exists there (a named pipe a reader waits on,
``/dev/stdout``, ``/dev/null``) is a stream: it is opened and written, never
renamed over (which would leave a plain file in its place).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Mapping


# Names of an open file (a process's descriptor) rather than of a file of
# their own: /dev/stdout of a run redirected to run.log is run.log, never to
# be renamed over. /dev/shm and the like hold ordinary files.
_DESCRIPTOR = re.compile(r"^/dev/(stdout|stderr|fd/\d+)$|^/proc/(self|\d+)/fd/\d+$")


def is_stream(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists and is written into rather than replaced: not
    a regular file or a directory (a FIFO, a character device), symlinks
    followed, or a name of an open descriptor (``/dev/stdout`` redirected
    to a file, ``/dev/fd/N``, ``/proc/self/fd/N``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        return False
    return not stat.S_ISREG(mode) or bool(_DESCRIPTOR.match(os.path.abspath(path)))


def output_problem(what: str, path: str | os.PathLike,
                   inputs: Mapping[str, str | None] | None = None) -> str | None:
    """Why ``path`` cannot be written as ``what`` (e.g. ``"--metrics-out"``;
    one line), or ``None``: a stream must be writable, any other path must
    not be a directory and its (symlink-resolved) directory must exist and be
    writable, for the temporary file beside it; and it must not be one of
    ``inputs`` (``flag -> path`` of the run's input files, ``None`` if not
    given), which it would overwrite."""
    path = os.fspath(path)
    for flag, given in (inputs or {}).items():
        if given is not None and os.path.realpath(path) == os.path.realpath(given):
            return f"{what} {path} is the {flag} file, which it would overwrite; give another file"
    if is_stream(path):
        return None if os.access(path, os.W_OK) else f"{what} {path} is not writable"
    if os.path.isdir(path):
        return f"{what} {path} is a directory; give a file name"
    parent = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(parent):
        return f"{what} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{what} {path}: the directory {parent} is not writable"
    return None


def write_file(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path``: a stream directly, a file atomically (see
    the module docstring)."""
    if is_stream(path):
        with open(path, "wb") as f:
            f.write(data)
        return
    real = os.path.realpath(path)
    tmp = f"{real}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        if os.path.isfile(real):  # the replaced file's permissions are kept
            os.chmod(tmp, stat.S_IMODE(os.stat(real).st_mode))
        os.replace(tmp, real)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
