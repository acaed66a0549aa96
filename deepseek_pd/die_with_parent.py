"""`python -m deepseek_pd.die_with_parent PARENT_PID PROGRAM [ARGS...]`: asks the kernel to
SIGTERM this process when its parent dies (PR_SET_PDEATHSIG, which survives exec), then execs
PROGRAM in its place.

Why a program and not `subprocess.Popen(preexec_fn=...)`: a preexec_fn runs Python between fork
and exec of a multi-threaded parent (grpc, asyncio and test threads), which Python documents as
unsafe; a launch of the router was seen to hang inside Popen that way. This wrapper runs after a
plain fork+exec instead. PARENT_PID closes the race of a parent that died before the prctl.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent (thread) dies; call it in the child itself."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux/glibc: the launcher's own signal handling still applies


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m deepseek_pd.die_with_parent PARENT_PID PROGRAM [ARGS...]")
    die_with_parent()
    if os.getppid() != int(argv[0]):
        sys.exit(0)  # the launcher is already gone: nobody wants this process any more
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
