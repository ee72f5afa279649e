"""The instruments of a localisation run: a forward tracer that tags autograd nodes, a backward tracer.

:class:`ForwardTracer` (a ``TorchFunctionMode`` plus module hooks) tags the autograd node of every
op's output with the innermost module, the torch function and the user's source stack, and keeps
the first forward origin; :class:`BackwardTracer` hooks every node of the graph and keeps the first
node that turns finite gradients into NaN/Inf. :func:`~lightning_nanguard.diagnose.localization.localize`
runs them and turns what they found into a verdict.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_nanguard.core.dtensor import local_tensor
from lightning_nanguard.core.host import all_true
from lightning_nanguard.diagnose.frames import Frame, UserCode, class_files, library_dirs

__all__ = [
    "BackwardTracer",
    "ForwardTracer",
    "Rows",
    "Site",
    "bn_channels_of",
    "finite",
    "function_name",
    "graph_leaves",
    "user_frame",
]


_TAG = "nanguard"
# Ops that create deliberate infinities (attention masks, sentinels), or uninitialised memory (FSDP2's
# all-gather buffers, allocated inside the traced forward): never an "origin".
_CONSTANT_OPS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "masked_fill",
        "masked_fill_",
        "fill_",
        "full",
        "full_like",
        "where",
        "tensor",
        "as_tensor",
        "new_full",
        "__setitem__",
        "index_fill",
        "index_fill_",
        "clone",
        "to",
        "detach",
        "contiguous",
    }
)
# Python operators, shown as the torch function they call
_OPERATORS = {
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__div__": "div",
    "__rdiv__": "div",
    "__floordiv__": "floor_divide",
    "__rfloordiv__": "floor_divide",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "sub",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__neg__": "neg",
    "__mod__": "remainder",
    "__rmod__": "remainder",
}


def function_name(func: Any) -> str:
    """A readable name for the torch function ``func`` seen by a ``TorchFunctionMode``.

    Tensor methods and operators are shown as the ``torch`` function of the same name.

    Example:
        >>> function_name(torch.Tensor.div), function_name(torch.Tensor.__rsub__)
        ('torch.div', 'torch.sub')
        >>> function_name(torch.log), function_name(torch.nn.functional.cross_entropy)
        ('torch.log', 'torch.nn.functional.cross_entropy')
        >>> function_name(torch.Tensor.__getitem__)
        'torch.Tensor.__getitem__'
    """
    name = getattr(func, "__name__", None) or str(func)
    if name in _OPERATORS:
        return f"torch.{_OPERATORS[name]}"
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", name)
    owner = qualname.rpartition(".")[0]
    if owner in ("TensorBase", "Tensor", "_VariableFunctionsClass") or module in ("torch", "torch._tensor"):
        return f"torch.{name}" if hasattr(torch, name) and not name.startswith("_") else f"torch.Tensor.{name}"
    return f"{module}.{qualname}" if module else qualname


def user_frame(frame: FrameType | None, skip_dirs: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """The innermost frame of user code (outside torch, Lightning, the standard library and this package).

    Example:
        >>> import sys
        >>> user_frame(sys._getframe()) is None  # a doctest runs in "<doctest ...>", then in the stdlib
        False
    """
    frames = UserCode(skip_dirs=skip_dirs if skip_dirs is not None else library_dirs()).frames(frame, limit=1)
    return (frames[0].path, frames[0].line) if frames else None


@dataclass(frozen=True)
class Site:
    """Where an op ran: the innermost module, its class, the user's frames and the torch function."""

    module: str
    module_type: str
    frames: tuple[Frame, ...]
    function: str | None = None
    forward_nonfinite: bool = False


def finite(tensors: Sequence[Any]) -> bool:
    """Whether every floating-point (or complex) tensor among ``tensors`` is finite (one read per device).

    A ``DTensor`` is read on its local shard (no collective inside a traced pass).
    """
    checks = [
        torch.isfinite(_stored(local_tensor(t))).all()
        for t in tensors
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    return all_true(checks)


def _stored(tensor: Tensor) -> Tensor:
    """The values a tensor stores: a sparse tensor's non-zero values (``isfinite`` refuses sparse layouts)."""
    return tensor.detach().coalesce().values() if tensor.is_sparse else tensor


class Rows:
    """Finiteness of the rows of chosen samples (tensors whose first dimension is the batch), or of whole tensors.

    Example:
        >>> x = torch.tensor([[1.0], [float("nan")], [2.0]])
        >>> Rows([0, 2], 3).finite([x]), Rows(None, 3).finite([x])
        (True, False)
    """

    def __init__(self, rows: Sequence[int] | None, size: int | None) -> None:
        self.rows = list(rows) if rows is not None and size is not None else None
        self.size = size
        self._index: dict[torch.device, Tensor] = {}

    def _index_on(self, device: torch.device) -> Tensor:
        if device not in self._index:
            self._index[device] = torch.as_tensor(self.rows, dtype=torch.long, device=device)
        return self._index[device]

    def finite(self, tensors: Sequence[Any]) -> bool:
        if self.rows is None:
            return finite(tensors)
        checks = []
        for t in tensors:
            if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
                continue
            t = local_tensor(t)
            if t.dim() > 0 and t.shape[0] == self.size and not t.is_sparse:
                t = t.detach().index_select(0, self._index_on(t.device))
            checks.append(torch.isfinite(_stored(t)).all())
        return all_true(checks)


def _nodes(root: Any, stop: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Every autograd node reachable from ``root``; the ancestors of nodes where ``stop`` holds are skipped."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if stop is not None and stop(node):
            continue
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def graph_leaves(loss: Tensor) -> list[Tensor]:
    """The leaf tensors requiring grad that ``loss`` was computed from (its ``AccumulateGrad`` nodes).

    What ``backward`` would write ``.grad`` of. Under FSDP2 these are the *unsharded* parameters the
    forward used (the sharded ``DTensor`` parameters are not in the graph: ``torch.autograd.grad``
    returns ``None`` for them), so the gradients of a re-run are this rank's own, before any
    reduction over ranks.

    Example:
        >>> w = nn.Parameter(torch.ones(2))
        >>> [leaf is w for leaf in graph_leaves((w * 3).sum())]
        [True]
    """
    if loss.grad_fn is None:
        return [loss] if loss.requires_grad else []
    leaves = (getattr(node, "variable", None) for node in _nodes(loss.grad_fn))
    return [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]


def _tagged(node: Any) -> bool:
    return _TAG in node.metadata


def _module_files(module: nn.Module, cache: dict[type, frozenset[str]]) -> frozenset[str]:
    cls = type(module)
    if cls not in cache:
        cache[cls] = frozenset(class_files(cls))
    return cache[cls]


class ForwardTracer(TorchFunctionMode):
    """Tags autograd nodes with module, function and user stack; records the first forward origin."""

    def __init__(self, root: nn.Module, rows: Rows) -> None:
        super().__init__()
        self.root = root
        self.rows = rows
        self.stack: list[tuple[str, str, frozenset[str]]] = []
        self.origin: tuple[str, Site] | None = None
        # First op with a non-finite output that autograd tracks, whatever its inputs: where
        # non-finite weights enter the model (used when the weights are bad).
        self.first_nonfinite: tuple[str, Site] | None = None
        # First BatchNorm whose running statistics a forward turned non-finite, and its call site.
        self.bn_origin: Site | None = None
        files: dict[type, frozenset[str]] = {}
        self.code = UserCode(root_files=_module_files(root, files))
        self._handles: list[Any] = []
        for name, module in root.named_modules():
            if module is root:
                continue
            entry = (name, type(module).__name__, _module_files(module, files))
            self._handles.append(module.register_forward_pre_hook(self._push(entry)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                self._handles.append(module.register_forward_hook(self._check_stats(name, type(module).__name__)))

    def _push(self, entry: tuple[str, str, frozenset[str]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(entry)

        return hook

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def _frames(self, frame: FrameType | None) -> tuple[Frame, ...]:
        extra: frozenset[str] = frozenset().union(*(files for _, _, files in self.stack))
        return tuple(self.code.frames(frame, extra))

    def _check_stats(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.bn_origin is None and bn_bad_channels(module):
                self.bn_origin = Site(name, type_name, self._frames(sys._getframe(1)), None, True)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _site(self, func: Any, nonfinite: bool) -> Site:
        name, type_name, _ = self.stack[-1] if self.stack else ("", type(self.root).__name__, frozenset())
        return Site(name, type_name, self._frames(sys._getframe(2)), function_name(func), nonfinite)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if not outputs:
            return out
        func_name = getattr(func, "__name__", str(func))
        nonfinite = not self.rows.finite(outputs)
        site: Site | None = None
        for tensor in outputs:
            node = tensor.grad_fn
            if node is None:
                continue
            site = site or self._site(func, nonfinite)
            # nodes created by this op are exactly the untagged ones; a tagged node's ancestors are all
            # tagged already (they were walked when it was), so stopping there keeps this linear
            for inner in _nodes(node, stop=_tagged):
                inner.metadata[_TAG] = site
        if nonfinite and self.first_nonfinite is None and func_name not in _CONSTANT_OPS:
            tracked = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
            if tracked is not None:
                self.first_nonfinite = (tracked.name(), site or self._site(func, True))
        if nonfinite and self.origin is None and func_name not in _CONSTANT_OPS:
            inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)]
            if inputs and self.rows.finite(inputs):  # an op of no tensor makes a constant, not a NaN/Inf of the run
                grad_fn = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
                op = grad_fn.name() if grad_fn is not None else func_name
                self.origin = (op, site or self._site(func, True))
        return out


class BackwardTracer:
    """Hooks every node of a graph; remembers the first that turns finite grads into NaN/Inf."""

    def __init__(self, loss: Tensor, rows: Rows) -> None:
        self.origin: tuple[str, Site | None] | None = None
        self.rows = rows
        self._handles = [node.register_hook(self._make_hook(node)) for node in _nodes(loss.grad_fn)]

    def _make_hook(self, node: Any) -> Callable[..., None]:
        def hook(grad_inputs: Sequence[Tensor | None], grad_outputs: Sequence[Tensor | None]) -> None:
            if self.origin is not None:
                return
            if self.rows.finite(list(grad_outputs)) and not self.rows.finite(list(grad_inputs)):
                self.origin = (node.name(), node.metadata.get(_TAG))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def bn_bad_channels(bn: nn.Module) -> list[int]:
    """Channels of a BatchNorm whose running mean/var is non-finite (or whose variance is negative)."""
    mean, var = getattr(bn, "running_mean", None), getattr(bn, "running_var", None)
    if not isinstance(mean, Tensor) or not isinstance(var, Tensor):
        return []
    mean, var = local_tensor(mean), local_tensor(var)
    bad = ~torch.isfinite(var) | ~torch.isfinite(mean) | (var < 0)
    return [int(c) for c in bad.nonzero().flatten().tolist()]


def bn_channels_of(module: nn.Module) -> dict[str, list[int]]:
    """BatchNorm module name -> channels whose running statistics are non-finite (or a negative variance)."""
    found: dict[str, list[int]] = {}
    for name, child in module.named_modules():
        if isinstance(child, _BatchNorm):
            channels = bn_bad_channels(child)
            if channels:
                found[name] = channels
    return found
