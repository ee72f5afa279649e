"""The instruments of a localisation run: a forward tracer that tags autograd nodes, a backward tracer.

:class:`ForwardTracer` (a ``TorchFunctionMode`` plus module hooks) tags the autograd node of every
op's output with the innermost module, the torch function and the user's source stack, and keeps
the first forward origin; :class:`BackwardTracer` hooks every node of the graph and keeps the first
node that turns finite gradients into NaN/Inf. :func:`~lightning_nanguard.diagnose.localization.localize`
runs them and turns what they found into the origin (a ``Localization``).

The forward origin is the first op that gives birth to a non-finite value:

- NaN/Inf from finite inputs (``log(0)``, ``0 / 0``, an overflowing ``exp``), or
- NaN from inputs that hold infinities but no NaN: a deliberate ``-inf`` (a mask, a padding value)
  met another infinity or a zero (the softmax of a row masked entirely, ``inf - inf``, ``0 * inf``).

Ops that write infinities on purpose (``masked_fill``, ``full``, ``where``...) are never origins, and
an op that merely carries an infinity on (``scores + mask``) is not one either, nor is an op that
only moves values (``view``, ``flatten``, ``t``, ``cat``, indexing...). An op's inputs are judged by
the test that saw its outputs' NaN/Inf (:meth:`Rows.showing`): by the followed rows, or whole when
only a tensor whose first dimension is no followed size shows it (a reshaped batch, a buffer). A NaN born inside a
composite function that the mode sees as one call (``F.multi_head_attention_forward``) is named by
the autograd node whose saved result first holds it (``SoftmaxBackward0``), when there is one.

Custom autograd Functions (``torch.autograd.Function`` subclasses) are not seen by a
``TorchFunctionMode``: :meth:`ForwardTracer.custom_functions` wraps ``Function.apply`` for the
duration of the run, so a Function defined outside torch is treated as one op, named
``<module>.<Class>.apply`` at the line that calls ``.apply(...)``, and its backward node is tagged
with that site (the ops inside its forward belong to it).
"""

from __future__ import annotations

import contextlib
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

from lightning_nanguard.diagnose.finiteness import Rows, bn_bad_channels, bn_channels_of, finite, floating
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
# Ops that create deliberate infinities (attention masks, sentinels): never an "origin".
_CONSTANT_OPS = frozenset(
    {
        "empty",  # uninitialised memory (FSDP2's all-gather buffers, allocated inside the traced forward)
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
# Ops that only move, copy or select values (reshapes, permutations, indexing, joins): they cannot
# make a NaN/Inf, so one in their output was in their input (a healthy sample's deliberate -inf, or
# memory not yet written, such as FSDP2's all-gather buffers, viewed before the collective fills them).
# Never an origin: read by rows, the input of one that reshapes or permutes the batch dimension is
# not the same samples' rows as its output, and would look finite.
_MOVING_OPS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "transpose_",
        "t",
        "t_",
        "swapaxes",
        "swapdims",
        "movedim",
        "moveaxis",
        "squeeze",
        "squeeze_",
        "unsqueeze",
        "unsqueeze_",
        "expand",
        "expand_as",
        "broadcast_to",
        "repeat",
        "tile",
        "repeat_interleave",
        "narrow",
        "select",
        "__getitem__",
        "index_select",
        "gather",
        "take",
        "take_along_dim",
        "masked_select",
        "split",
        "split_with_sizes",
        "tensor_split",
        "chunk",
        "unbind",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "hstack",
        "vstack",
        "dstack",
        "flip",
        "fliplr",
        "flipud",
        "roll",
        "rot90",
        "as_strided",
        "unfold",
        "diagonal",
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
    """Where an op ran: the innermost module, its class, the user's frames and the torch function.

    ``custom_function``: the op is a custom autograd Function (``function`` is ``<module>.<Class>.apply``).
    """

    module: str
    module_type: str
    frames: tuple[Frame, ...]
    function: str | None = None
    forward_nonfinite: bool = False
    custom_function: bool = False


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
        # The origin's inputs held infinities (a mask, a padding value) and it made NaN of them.
        self.origin_from_infinity = False
        self._inside_function = 0  # depth inside custom autograd Functions' forwards
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

    def _site(self, frame: FrameType | None, function: str, nonfinite: bool, custom: bool = False) -> Site:
        name, type_name, _ = self.stack[-1] if self.stack else ("", type(self.root).__name__, frozenset())
        return Site(name, type_name, self._frames(frame), function, nonfinite, custom)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._inside_function:  # an op of a custom Function's forward: the Function is the op
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if outputs:
            name = getattr(func, "__name__", str(func))
            self._observe(name, lambda: function_name(func), (args, kwargs or {}), outputs, sys._getframe(1))
        return out

    def _observe(
        self,
        name: str,
        label: Callable[[], str],
        inputs: Any,
        outputs: list[Tensor],
        frame: FrameType | None,
        custom: bool = False,
    ) -> None:
        """Tag the autograd nodes an op created and decide whether it is the origin.

        Args:
            name: the op's short name (``"masked_fill"``), to recognise ops that write infinities on purpose.
            label: the readable torch function, computed only when needed.
            inputs: the op's arguments (any nesting).
            outputs: the tensors it returned.
            frame: the frame that called the op (the user's frames are read from it outwards).
            custom: the op is a custom autograd Function.
        """
        nonfinite = not self.rows.finite(outputs)
        site: Site | None = None
        created: list[Any] = []
        for tensor in outputs:
            node = tensor.grad_fn
            if node is None:
                continue
            site = site or self._site(frame, label(), nonfinite, custom)
            # nodes created by this op are exactly the untagged ones; a tagged node's ancestors are all
            # tagged already (they were walked when it was), so stopping there keeps this linear
            for inner in _nodes(node, stop=_tagged):
                inner.metadata[_TAG] = site
                created.append(inner)
        if not nonfinite or name in _CONSTANT_OPS:
            return
        tracked = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
        if self.first_nonfinite is None and tracked is not None:
            self.first_nonfinite = (tracked.name(), site or self._site(frame, label(), True, custom))
        if self.origin is not None:
            return
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, Tensor)]
        if not tensors:  # an op of no tensor makes a constant, not a NaN/Inf of the run
            return
        if _moves(name, tensors, outputs):  # what it outputs was in its inputs
            return
        # the inputs are judged by the test that saw the outputs' NaN/Inf: by the followed rows, or
        # whole when only a tensor tested whole (a reshaped batch, a reduction, a buffer) shows it
        shown = self.rows.showing(outputs)
        if shown is not None and shown.finite(tensors):  # NaN/Inf from finite inputs
            born = _birth_node(created, nan_only=False)
        elif (nan_shown := self.rows.showing(outputs, nan_only=True)) is not None and nan_shown.nan_free(tensors):
            born = _birth_node(created, nan_only=True)  # NaN from infinities
            self.origin_from_infinity = True
        else:  # infinities carried on (scores + mask), or a NaN that was there already
            return
        op = born or (tracked.name() if tracked is not None else name)
        self.origin = (op, site or self._site(frame, label(), True, custom))

    @contextlib.contextmanager
    def custom_functions(self) -> Iterator[None]:
        """Within the block, every ``Function.apply`` is an op of this tracer (see the module docs)."""
        function_class = torch.autograd.Function
        original = function_class.__dict__["apply"]
        apply = original.__func__
        tracer = self

        def traced_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if _torch_owned(cls):  # torch's own Functions (checkpointing) stay transparent: their ops are seen
                out = apply(cls, *args, **kwargs)
                tracer._tag_function(cls, args, kwargs, out, sys._getframe(1), observe=False)
                return out
            tracer._inside_function += 1
            try:
                out = apply(cls, *args, **kwargs)
            finally:
                tracer._inside_function -= 1
            if not tracer._inside_function:
                tracer._tag_function(cls, args, kwargs, out, sys._getframe(1), observe=True)
            return out

        function_class.apply = classmethod(traced_apply)  # type: ignore[assignment,method-assign]
        try:
            yield
        finally:
            function_class.apply = original  # type: ignore[method-assign]

    def _tag_function(
        self, cls: type, args: Any, kwargs: Any, out: Any, frame: FrameType | None, observe: bool
    ) -> None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if not outputs or self._inside_function:
            return
        label = f"{cls.__module__}.{cls.__qualname__}.apply"
        if observe:
            self._observe("apply", lambda: label, (args, kwargs), outputs, frame, custom=True)
            return
        site: Site | None = None  # transparent: only the Function's own node gets the call's site
        for tensor in outputs:
            node: Any = tensor.grad_fn
            if node is not None and not _tagged(node):
                site = site or self._site(frame, label, False)
                node.metadata[_TAG] = site


def _moves(name: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> bool:
    """Whether the op only moves its inputs' values: one of :data:`_MOVING_OPS`, keeping their dtype.

    A view that reinterprets other bits as floating point (``x.view(torch.float32)`` of integers)
    can make a NaN of finite data: that is no move.
    """
    if name not in _MOVING_OPS:
        return False
    dtypes = {t.dtype for t in inputs}
    return all(t.dtype in dtypes for t in outputs if floating(t))


def _torch_owned(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


def _birth_node(created: Sequence[Any], nan_only: bool) -> str | None:
    """The node, among those one composite op created, whose saved result first holds the NaN (or Inf).

    A composite function the mode sees as one call (``F.multi_head_attention_forward``, ``F.ctc_loss``)
    creates several autograd nodes; the one that was born non-finite is the earliest (by sequence
    number) whose saved result is non-finite. ``None`` when no node saved such a result, or when an
    earlier node saved a non-finite input (the value was born in a node that keeps no result).

    Args:
        created: the nodes the op created.
        nan_only: look for NaN only (the op's inputs held infinities already).
    """
    if len(created) < 2:
        return None
    first: tuple[int, str] | None = None
    earliest_input: int | None = None
    for node in created:
        try:
            order = int(node._sequence_nr())
        except (AttributeError, RuntimeError):
            return None
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed, or not a tensor
                continue
            if not floating(value):
                continue
            bad = torch.isnan(value).any() if nan_only else ~torch.isfinite(value).all()
            if not bool(bad):
                continue
            if attr.startswith("_saved_result"):
                if first is None or order < first[0]:
                    first = (order, node.name())
            elif earliest_input is None or order < earliest_input:
                earliest_input = order
    if first is None or (earliest_input is not None and earliest_input < first[0]):
        return None
    return first[1]


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
            # the incoming gradients are judged by the test that saw the NaN/Inf of the outgoing ones
            shown = self.rows.showing(list(grad_inputs))
            if shown is not None and shown.finite(list(grad_outputs)):
                self.origin = (node.name(), node.metadata.get(_TAG))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
