"""How a gyre-hpc process ends once its work is done: what must happen on the way out happens
(threads that are not daemons joined, the atexit hooks run — the sandbox's cgroups closed,
logging flushed —, MPI finalized where this process initialised it, the standard streams
flushed), and the interpreter's own teardown of torch and a model's objects is skipped. That
teardown took ~1.2 s a rank with the tiny model (0.4 s for torch alone), and a world's end,
every restart's and every command's exit waited for it.

It knows nothing of what the process did: whoever calls ``leave`` has closed what it opened.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """End this process with ``code`` (see the module doc)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes MPI in the teardown skipped here
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a full disk: nothing more to say there
            pass
    os._exit(code)
