"""Tie a child process's life to this one: it dies when the launcher dies, even by SIGKILL.

``prctl(PR_SET_PDEATHSIG)`` asks the kernel to signal the child when its parent goes. The
kernel's "parent" is the *thread* that forked, so start children from a thread that lives as
long as the process (the launcher's main thread does). The setting survives ``exec`` (not of a
set-user-ID binary) and is not inherited by the child's own children: tritonserver's python
backend stubs watch their parent themselves, nginx's master stops its workers on SIGTERM.

Where util-linux's ``setpriv`` is installed (Debian's base), the child is started through it
(``setpriv --pdeathsig SIG -- command``: :func:`tied_command`) rather than with a
``preexec_fn``: a ``preexec_fn`` makes ``subprocess`` fork instead of vfork, and a fork runs
the parent's atfork handlers in the child. gRPC's abort or crash there when another thread of
the parent is inside gRPC (the tests' clients; the child dies with SIGABRT or SIGSEGV before
it execs). A vfork runs none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl


def tie_to_parent(signame: str = "SIGKILL"):
    """A ``preexec_fn`` for subprocess.Popen: the child gets ``signame`` when we die.

    Returns None where prctl does not exist (not Linux); the child then outlives a killed
    launcher as before.
    """
    if not sys.platform.startswith("linux"):
        return None
    signum = int(getattr(signal, signame))
    parent = os.getpid()
    prctl = _prctl()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            os._exit(126)
        # The parent may have died between fork and prctl: then no signal would ever come.
        if os.getppid() != parent:
            os._exit(126)

    return preexec


def tied_command(command: list[str], signame: str = "SIGKILL") -> tuple[list[str], Callable[[], None] | None]:
    """(command, preexec_fn) for subprocess.Popen such that the child gets ``signame`` when we
    die: through setpriv where it is installed (no preexec_fn: subprocess can vfork), else the
    command as it is with :func:`tie_to_parent`'s preexec_fn."""
    if not sys.platform.startswith("linux"):
        return list(command), None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return list(command), tie_to_parent(signame)
    return [setpriv, f"--pdeathsig={signame}", "--", *command], None
