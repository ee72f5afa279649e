"""Run a test script in N processes on CPU (gloo), as ``torchrun`` would, and collect what each rank wrote.

Every rank is a fresh ``python SCRIPT ARGS...`` with the environment of a ``torchrun`` (or Lightning)
launch: ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port, ``WORLD_SIZE=N``, ``NODE_RANK=0``,
``RANK`` = ``LOCAL_RANK`` = its rank. Lightning sees ``LOCAL_RANK`` and starts no process of its own
(its ``LightningEnvironment`` then treats the processes as created externally); a plain script
calls ``torch.distributed.init_process_group("gloo")``, which reads the same variables. The
repository and ``tests/helpers`` are on ``PYTHONPATH``; the working directory is ``out_dir``.

Each rank's stdout and stderr are kept apart. A rank that fails stops the others after a grace
period (they would wait for it in their next collective), and a run that outlives its timeout is
stopped whole: either way :class:`LaunchError` shows every rank's exit code and the end of its
output. A script whose processes start their own workers (``strategy="ddp_spawn"``) is launched
once with ``rank_env=False``.

Example::

    run = launch("ddp_script.py", "skip", tmp_path, nprocs=2, out_dir=tmp_path, timeout=180)
    ranks = run.results()  # {0: <rank0.json>, 1: <rank1.json>}
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["HELPERS", "REPO", "Launch", "LaunchError", "RankOutput", "free_port", "launch"]

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
# Variables of an outer launch (a test run under torchrun, say) that must not reach a new one, and
# Lightning's global seed (a test's seed_everything sets it; Lightning reseeds every rank from it).
LAUNCH_VARIABLES = (
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)
TAIL = 3000  # characters of each output stream shown in an error


class LaunchError(AssertionError):
    """A launch that failed or left no result: every rank's exit code and the end of its output."""


@dataclass(frozen=True)
class RankOutput:
    """One launched process: its rank, exit code (negative: the signal that ended it) and output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    stopped: bool = False  # still running when the launcher gave up on the run, and stopped by it


@dataclass(frozen=True)
class Launch:
    """A finished launch: the command and what each process printed; :meth:`results` reads what it wrote."""

    command: tuple[str, ...]
    out_dir: Path
    ranks: tuple[RankOutput, ...]

    def results(self, name: str = "rank{rank}.json", ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The JSON file ``name`` (``{rank}`` filled in) of every rank in ``out_dir``, by rank.

        Args:
            name: the file name pattern.
            ranks: the ranks expected to write one (default: one per launched process; a
                ``ddp_spawn`` launch has one process and more ranks).

        Raises:
            LaunchError: a rank wrote no file (with every process's output).
        """
        wanted = list(range(len(self.ranks)) if ranks is None else ranks)
        found = {}
        for rank in wanted:
            path = self.out_dir / name.format(rank=rank)
            if path.exists():
                found[rank] = json.loads(path.read_text(encoding="utf-8"))
        missing = [rank for rank in wanted if rank not in found]
        if missing:
            raise LaunchError(self.report(f"rank(s) {missing} wrote no {name}"))
        return found

    def report(self, problem: str) -> str:
        """``problem``, then each process's exit code and the end of its stdout and stderr."""
        lines = [f"{' '.join(self.command)} in {len(self.ranks)} process(es), in {self.out_dir}: {problem}"]
        for rank in self.ranks:
            code = f"exit code {rank.returncode}"
            if rank.stopped:
                code = f"stopped by the launcher ({code})"
            elif rank.returncode is not None and rank.returncode < 0:
                code = f"killed by signal {-rank.returncode}"
            lines.append(f"--- rank {rank.rank}: {code}")
            for stream, text in (("stdout", rank.stdout), ("stderr", rank.stderr)):
                if text.strip():
                    lines.append(f"{stream} (last {TAIL} characters):\n{text[-TAIL:]}")
        return "\n".join(lines)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    script: str | Path,
    *args: Any,
    nprocs: int,
    out_dir: str | Path,
    timeout: float,
    rank_env: bool = True,
    grace: float = 10.0,
) -> Launch:
    """Run ``python script *args`` in ``nprocs`` processes and wait for all of them.

    Args:
        script: a path, or a file name in ``tests/helpers``.
        args: the script's arguments (``str()`` of each).
        nprocs: the number of processes (the world size).
        out_dir: the working directory of every process, where :meth:`Launch.results` reads.
        timeout: seconds for the whole run: a rank left alone in a collective hangs, and the
            timeout turns that into a failure.
        rank_env: give each process its rank's environment; ``False``: a single process that starts
            its workers itself (``ddp_spawn``), with no launch variables at all.
        grace: seconds the other ranks get to finish once one has failed, before they are stopped.

    Raises:
        LaunchError: a process exited with an error, or the run did not finish in ``timeout``.
    """
    path = Path(script) if Path(script).is_absolute() else HELPERS / script
    if not rank_env and nprocs != 1:
        raise ValueError(f"rank_env=False launches a single process that starts its own workers, not {nprocs}")
    command = (sys.executable, str(path), *map(str, args))
    base = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(HELPERS), os.environ.get("PYTHONPATH")]))
    port = free_port()
    with contextlib.ExitStack() as stack:
        processes, streams = [], []
        for rank in range(nprocs):
            env = dict(base)
            if rank_env:
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    WORLD_SIZE=str(nprocs),
                    NODE_RANK="0",
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                )
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8")) for _ in range(2))
            processes.append(
                subprocess.Popen(command, cwd=out_dir, env=env, stdout=out, stderr=err, start_new_session=True)
            )
            streams.append((out, err))
        problem, stopped = _wait(processes, timeout, grace)
        outputs = tuple(
            RankOutput(rank, process.returncode, _read(out), _read(err), stopped=rank in stopped)
            for rank, (process, (out, err)) in enumerate(zip(processes, streams, strict=True))
        )
    launched = Launch(command, Path(out_dir), outputs)
    failed = [output.rank for output in outputs if output.returncode != 0]
    if problem is not None or failed:
        raise LaunchError(launched.report(problem or f"rank(s) {failed} failed"))
    return launched


def _wait(processes: list[subprocess.Popen[Any]], timeout: float, grace: float) -> tuple[str | None, set[int]]:
    """Wait for every process; stop the rest at the timeout, or ``grace`` seconds after one failed.

    Returns:
        What went wrong (``None``: every process exited by itself) and the ranks stopped.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return None, set()
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if now >= deadline:
            return f"did not finish within {timeout:g} s (a rank waiting alone in a collective hangs)", _stop(processes)
        if failed_at is not None and now - failed_at >= grace:
            return f"a rank failed; the ranks still running {grace:g} s later were stopped", _stop(processes)
        time.sleep(0.05)


def _stop(processes: list[subprocess.Popen[Any]]) -> set[int]:
    """SIGTERM, then SIGKILL, to each running process's group (its own session: workers it started go too).

    Returns:
        The indices of the processes that were still running.
    """
    stopped = {i for i, process in enumerate(processes) if process.poll() is None}
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        running = [process for process in processes if process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait)
    return stopped


def _read(stream: IO[str]) -> str:
    stream.seek(0)
    return stream.read()
