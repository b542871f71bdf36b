"""No orphans: a child process this package starts ends when the process that started it dies.

``die_with_parent`` runs in the child between fork and exec (``subprocess.Popen(preexec_fn=…)``)
and asks the kernel for SIGTERM once the parent is gone (Linux ``PR_SET_PDEATHSIG``). Elsewhere
it does nothing: the caller's own cleanup is then the only one.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
