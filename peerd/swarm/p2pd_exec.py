"""Becomes p2pd (``argv[1:]``) in a process group of its own that dies with the daemon that started it.

Run as a script (``python -I -S p2pd_exec.py <p2pd> <flags...>``, by ``inprocess.py``), with no import of
peerd or of anything beyond the standard library, and replaced by p2pd at once: the process id hivemind
started, and will stop, is p2pd's.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent = os.getppid()
    os.setpgid(0, 0)  # a Ctrl-C in the terminal reaches the daemon only, which stops p2pd after leaving
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # kept across exec
        sys.exit(f"p2pd_exec: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the daemon died before the signal was armed
        sys.exit("p2pd_exec: the daemon that started p2pd is gone")
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
