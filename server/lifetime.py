"""Tie a child process's life to this one: it dies when the launcher dies, even by SIGKILL.

``prctl(PR_SET_PDEATHSIG)`` asks the kernel to signal the child when its parent goes. The
kernel's "parent" is the *thread* that forked, so start children from a thread that lives as
long as the process (the launcher's main thread does). The setting survives ``exec`` (not of a
set-user-ID binary) and is not inherited by the child's own children: tritonserver's python
backend stubs watch their parent themselves, nginx's master stops its workers on SIGTERM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

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
