"""What a training step does inside NanGuard, counted without a clock: operator calls and host reads.

Two torch modes stay installed around a whole ``trainer.fit`` (:meth:`OpCounter.modes`) and count
only while the guard's own code runs. "The guard's own code" is what runs under its
:class:`~lightning_nanguard.core.timing.GuardClock`: the package's contract (``core/timing.py``) is
that every callable NanGuard installs (callback hooks, the strategy's after-step work, the recording
batch sampler) runs under ``guard.clock``. :func:`install` swaps that clock for a
:class:`CountingClock`, so every ``clock.measure(...)`` region is counted whatever the hooks are
called: the count survives renames and refactors of the hooks themselves. Work the guard does
elsewhere (the attention probe inside the forward of a sampled step) shows in
:attr:`OpCounter.all_ops`, compared between a guarded and an unguarded run.

What is counted:

- **operator calls**: every ``func`` a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
  sees, one aten operator each (:attr:`OpCounter.views` of them only make views: host work, no
  kernel; on a GPU each other call is about one kernel launch);
- **host reads** (each a synchronisation with a GPU): ``aten._local_scalar_dense`` (``item()``,
  ``bool(t)``, ``float(t)``, ``if t:``), ``aten.equal``, operators whose output size depends on the
  values (``nonzero``, ``masked_select``, ``unique``...: a sync on CUDA), a blocking copy from a
  device to the host, and ``tolist()`` / ``numpy()`` of a CPU tensor (on CPU these reach no
  operator: a :class:`~torch.overrides.TorchFunctionMode` sees them). Reading a *host copy* (a
  tensor copied to the CPU by an operator, as ``DeferredRead`` does without waiting on CUDA) is
  not a read: the copy was, and it is counted when it blocks (from a device, ``non_blocking=False``).
- **Python calls** (:class:`PythonCalls`, in a run without the two modes): function calls, of
  Python and C functions, made while the guard's code runs (``sys.setprofile``).

Example:
    >>> import torch
    >>> counter = OpCounter()
    >>> with counter.modes(), counter.counting():
    ...     flag = torch.isfinite(torch.ones(3)).all()
    ...     _ = flag.item()
    ...     copy = flag.to("cpu", copy=True)
    ...     _ = copy.tolist()  # a host copy: no read
    >>> dict(counter.reads), counter.ops["aten._local_scalar_dense.default"]
    ({'_local_scalar_dense': 1}, 1)
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.detect.attention import AttentionProbe

__all__ = ["CountingClock", "OpCounter", "PythonCalls", "StepCounts", "install", "probe_ops_added"]

_aten = torch.ops.aten
_READ_OPS = {_aten._local_scalar_dense.default, _aten.equal.default}
_VALUE_SHAPED = {  # output size depends on the values: a synchronisation on CUDA
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "argwhere",
    "repeat_interleave",
}
_HOST_FUNCTIONS = {"tolist", "numpy", "__array__"}


class OpCounter:
    """Counts operator calls and host reads in :meth:`counting` regions (inside :meth:`modes`).

    Attributes:
        ops: operator calls in counted regions, by overload name (``"aten.add.Tensor"``).
        reads: host reads in counted regions, by kind (``"_local_scalar_dense"``, ``"tolist"``,
            ``"copy to host"``, ...).
        views: how many of :attr:`ops` only made a view (no kernel on any device).
        all_ops: operator calls anywhere, counted region or not.
        regions: counted regions entered (outermost ``measure`` calls of a :class:`CountingClock`).
    """

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.views = 0
        self.all_ops = 0
        self.regions = 0
        self._depth = 0
        self._copies: dict[int, weakref.ref[torch.Tensor]] = {}  # host copies by storage address

    @property
    def op_calls(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(self.reads.values())

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what runs in the body (nested regions count once)."""
        self._depth += 1
        self.regions += self._depth == 1
        try:
            yield
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def modes(self) -> Iterator[None]:
        """Install both modes; enter them before the fit, so they sit below every mode the guard pushes."""
        with _FunctionCounter(self), _DispatchCounter(self):
            yield

    def _remember_copy(self, tensor: torch.Tensor) -> None:
        self._copies[_address(tensor)] = weakref.ref(tensor)

    def _is_copy(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return False
        ref = self._copies.get(_address(tensor))
        return ref is not None and ref() is not None

    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is _aten._to_copy.default or func is _aten.copy_.default:
            copy_ = func is _aten.copy_.default
            source, target = (args[1], args[0]) if copy_ else (args[0], out)
            if isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor) and target.device.type == "cpu":
                self._remember_copy(target)
                non_blocking = kwargs.get("non_blocking") or (copy_ and len(args) > 2 and args[2])
                if self._depth and source.device.type != "cpu" and not non_blocking:
                    self.reads["copy to host"] += 1
        self.all_ops += 1
        if not self._depth:
            return
        self.ops[str(func)] += 1
        self.views += bool(func.is_view)
        if func in _READ_OPS:
            if not (args and self._is_copy(args[0])):
                self.reads[func._opname] += 1
        elif func._opname in _VALUE_SHAPED:
            self.reads[func._opname] += 1

    def _on_function(self, name: str, args: tuple[Any, ...]) -> None:
        if self._depth and name in _HOST_FUNCTIONS and args:
            tensor = args[0]
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not self._is_copy(tensor):
                self.reads[name] += 1


def probe_ops_added(net: torch.nn.Sequential, x: torch.Tensor, passes: int = 3) -> int:
    """The aten calls an attention probe's watched pass adds to ``net(x)`` (after it found the attention modules).

    Every block of ``net`` must make one attention call (checked).
    """
    probe = AttentionProbe(net, rows=4, queries=64)
    for _ in range(passes):
        with probe.measuring():
            net(x)
        probe.take_calls()
    plain, watched = OpCounter(), OpCounter()
    with plain.modes():
        net(x)
    with watched.modes():
        with probe.measuring():
            net(x)
        calls = probe.take_calls()
    assert sum(len(part.names) for part in calls) == len(net)
    return watched.all_ops - plain.all_ops


def _address(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: OpCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._on_op(func, args, kwargs, out)
        return out


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, owner: OpCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.owner._on_function(getattr(func, "__name__", ""), args)
        return func(*args, **(kwargs or {}))


class PythonCalls(OpCounter):
    """An :class:`OpCounter` that counts Python and C function calls in its regions instead (no modes needed).

    Attributes:
        calls: calls by ``"file:function"`` (C functions: ``"C:qualified name"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def python_calls(self) -> int:
        return sum(self.calls.values())

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            self.calls[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        elif event == "c_call":
            self.calls[f"C:{getattr(arg, '__qualname__', arg)}"] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        outer = self._depth == 0
        previous = sys.getprofile()
        with super().counting():
            if outer:
                sys.setprofile(self._profile)
            try:
                yield
            finally:
                if outer:  # the few calls of entering and leaving a region are counted too: a constant
                    sys.setprofile(previous)


class CountingClock(GuardClock):
    """A :class:`GuardClock` whose every measured region is also counted by ``counter``."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__(enabled=True)  # the hooks enter a measured region only when the clock is on
        self.counter = counter

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        with self.counter.counting(), super().measure(name):
            yield


def install(guard: Any, counter: OpCounter) -> None:
    """Count ``guard``'s own work with ``counter``; before the fit (the strategy wrapper takes the clock at setup)."""
    guard.clock = CountingClock(counter)


class StepCounts:
    """What each optimizer step counted, from its ``on_train_batch_start`` to the next step's (or the fit's end).

    Call :meth:`mark` from a callback placed before the guard in the Trainer's callback list.
    """

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter
        self._marks: list[tuple[int, tuple[int, ...]]] = []

    def _totals(self) -> tuple[int, ...]:
        counter = self.counter
        calls = counter.python_calls if isinstance(counter, PythonCalls) else 0
        return counter.op_calls, counter.host_reads, counter.all_ops, calls

    def mark(self, step: int) -> None:
        if not self._marks or self._marks[-1][0] != step:
            self._marks.append((step, self._totals()))

    def per_step(self) -> dict[int, tuple[int, ...]]:
        """``{step: (ops in the guard, host reads in the guard, ops anywhere, Python calls in the guard)}``."""
        ends = [totals for _, totals in self._marks[1:]] + [self._totals()]
        return {
            step: tuple(end - start for start, end in zip(begin, stop, strict=True))
            for (step, begin), stop in zip(self._marks, ends, strict=True)
        }
