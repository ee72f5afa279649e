"""Find the runs of a log directory that hold NanGuard events, named as TensorBoard names runs.

A run is a directory with a ``nanguard/events.jsonl`` below the log directory; its name is its path
relative to the log directory (``"."`` for the log directory itself), prefixed with the group name
under ``--logdir_spec name:path``: the names TensorBoard gives runs. A run directory without
TensorBoard event files (a ``CSVLogger`` only) is found too.

Only names found by walking the log directory are ever mapped to a directory: a run name taken
from a request is looked up, never joined to a path. Every file the dashboard opens is checked
to resolve inside the run's directory (symbolic links leading elsewhere are refused).

Example:
    >>> import os, tempfile
    >>> logdir = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(logdir, "exp", "version_0", "nanguard"))
    >>> open(os.path.join(logdir, "exp", "version_0", "nanguard", "events.jsonl"), "w").close()
    >>> sorted(discover_runs([(logdir, None)]))
    ['exp/version_0']
    >>> RunIndex([(logdir, None)]).get("../etc") is None
    True
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_nanguard_tensorboard.layout import EVENTS_FILENAME, NANGUARD_DIRNAME

__all__ = ["RunIndex", "RunLocation", "discover_runs", "inside", "logdir_roots"]

MAX_DIRECTORIES = 50_000
"""Directories visited per scan at most, so a huge log directory cannot stall TensorBoard."""

_URI = re.compile(r"[a-zA-Z][0-9a-zA-Z.]*://")


@dataclass(frozen=True)
class RunLocation:
    """A run with NanGuard events.

    Args:
        name: the run's name, as TensorBoard names it.
        directory: the run directory, resolved (``os.path.realpath``).
        shown: the run directory as the user wrote the log directory (for commands to copy).
    """

    name: str
    directory: str
    shown: str

    @property
    def nanguard_dir(self) -> str:
        return os.path.join(self.directory, NANGUARD_DIRNAME)

    @property
    def events_path(self) -> str:
        return os.path.join(self.directory, NANGUARD_DIRNAME, EVENTS_FILENAME)

    def path(self, *parts: str) -> str | None:
        """``<run>/nanguard/<parts...>`` if it resolves inside the run directory, else ``None``."""
        candidate = os.path.join(self.nanguard_dir, *parts)
        return candidate if inside(self.directory, candidate) else None


def inside(root: str, path: str) -> bool:
    """Whether ``path`` resolves (symbolic links followed) to ``root`` or below it.

    Example:
        >>> inside("/tmp", "/tmp/a/../b"), inside("/tmp", "/tmp/../etc/passwd")
        (True, False)
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def logdir_roots(logdir: str | None, logdir_spec: str | None = None) -> list[tuple[str, str | None]]:
    """``(directory, group name)`` pairs from TensorBoard's ``--logdir`` or ``--logdir_spec`` flags.

    Remote paths (``gs://``, ``s3://``) are left out: the dashboard reads local files only.

    Example:
        >>> logdir_roots("runs")
        [('runs', None)]
        >>> logdir_roots(None, "a:/x,b:/y")
        [('/x', 'a'), ('/y', 'b')]
    """
    if logdir:
        pairs: list[tuple[str, str | None]] = [(logdir, None)]
    elif logdir_spec:
        pairs = []
        for spec in logdir_spec.split(","):
            if not _URI.match(spec) and ":" in spec and not spec.startswith("/") and not os.path.splitdrive(spec)[0]:
                name, _, path = spec.partition(":")
                pairs.append((path, name))
            else:
                pairs.append((spec, None))
    else:
        pairs = []
    return [(os.path.expanduser(path), name) for path, name in pairs if path and not _URI.match(path)]


def discover_runs(roots: Iterable[tuple[str, str | None]]) -> dict[str, RunLocation]:
    """Every run below ``roots`` that holds ``nanguard/events.jsonl``, by run name."""
    runs: dict[str, RunLocation] = {}
    visited = 0
    for root, group in roots:
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, _ in os.walk(root, followlinks=False):
            visited += 1
            if visited > MAX_DIRECTORIES:
                return runs
            if NANGUARD_DIRNAME in dirnames and os.path.isfile(
                os.path.join(dirpath, NANGUARD_DIRNAME, EVENTS_FILENAME)
            ):
                relative = os.path.relpath(dirpath, root)
                name = os.path.join(group, relative) if group else relative
                name = name.replace(os.sep, "/")  # like TensorBoard: "." is the log directory itself
                runs[name] = RunLocation(name, os.path.realpath(dirpath), os.path.normpath(dirpath))
            # bundles and incident folders hold no runs; hidden folders (.git, .venv) neither
            dirnames[:] = sorted(d for d in dirnames if d != NANGUARD_DIRNAME and not d.startswith("."))
    return runs


class RunIndex:
    """The runs of the log directory, rescanned at most every ``ttl_s`` seconds (thread-safe).

    Args:
        roots: ``(directory, group name)`` pairs, see :func:`logdir_roots`.
        ttl_s: how long a scan is reused.
    """

    def __init__(self, roots: Iterable[tuple[str, str | None]], ttl_s: float = 5.0) -> None:
        self.roots = list(roots)
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._runs: dict[str, RunLocation] = {}
        self._scanned_at = -float("inf")

    def runs(self) -> dict[str, RunLocation]:
        with self._lock:
            now = time.monotonic()
            if now - self._scanned_at > self.ttl_s:
                self._runs = discover_runs(self.roots)
                self._scanned_at = now
            return dict(self._runs)

    def get(self, name: Any) -> RunLocation | None:
        """The run called ``name``, or ``None`` for any other value (unknown names, non-strings)."""
        return self.runs().get(name) if isinstance(name, str) else None
