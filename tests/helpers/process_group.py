"""Leave the process group before a multi-process test script's processes exit.

torch's documented teardown: a gloo process group left to the interpreter's exit can abort the process
("terminate called without an active exception": a worker thread destroyed while still joinable),
after a run that finished well. Lightning's strategies do not destroy the group they created.
:func:`leave_process_group_at_exit`, called when a script is imported, covers the processes it
launches itself and the workers ``ddp_spawn`` starts (they import the script too).
"""

from __future__ import annotations

import atexit

import torch.distributed as dist


def leave_process_group() -> None:
    """Destroy the default process group if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process_group_at_exit() -> None:
    """Destroy the default process group when this process exits (before the interpreter tears down)."""
    atexit.register(leave_process_group)
