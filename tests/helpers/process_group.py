"""Leave the process group, and the process, so that a finished multi-process test run cannot abort.

torch's documented teardown: a gloo process group left to the interpreter's exit can abort the process
("terminate called without an active exception": a worker thread destroyed while still joinable),
after a run that finished well. Lightning's strategies do not destroy the group they created, and
destroying it is not always enough: objects that outlive the call (a DDP reducer, a FSDP2 device mesh)
keep gloo's threads to the interpreter's teardown. A fresh-clone CI run saw rank 0 of the FSDP2
several-loaders script abort there after all three fits had written their results.

- :func:`finish_script` ends a script's ``__main__`` once its results are written: every rank meets
  at a barrier, then the process leaves without the interpreter's teardown (``os._exit``).
- :func:`leave_process_group_at_exit`, called when a script is imported, covers the processes a
  script does not end itself: the workers ``ddp_spawn`` starts (they import the script, they do not
  run its ``__main__``).

Example::

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])  # writes rank<N>.json
        finish_script()
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave_process_group() -> None:
    """Destroy the default process group if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process_group_at_exit() -> None:
    """Destroy the default process group when this process exits (before the interpreter tears down)."""
    atexit.register(leave_process_group)


def finish_script() -> NoReturn:
    """End a script whose results are written: meet the other ranks, then exit 0 without a teardown.

    The barrier makes sure no rank still uses the group (or rank 0's store) when another one leaves;
    ``os._exit`` skips the destructors of gloo's objects, where the abort happens. A process that
    joined no group (``ddp_spawn``'s launching process) just exits.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
