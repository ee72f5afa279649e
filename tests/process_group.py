"""Leave the process group before a multi-process test script exits.

torch's documented teardown: a gloo process group left to the interpreter's exit can abort the process
("terminate called without an active exception": a worker thread destroyed while still joinable),
after a run that finished well. Lightning's strategies do not destroy the group they created.
"""

from __future__ import annotations

import torch.distributed as dist


def leave_process_group() -> None:
    """Destroy the default process group if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
