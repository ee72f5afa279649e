"""Name the module, autograd op and source line where the first non-finite value is produced.

:func:`localize` runs one forward pass and one backward pass (``torch.autograd.grad``, so
``.grad`` is untouched) of a bad (sub-)batch with instrumentation that exists only for that call:

- forward: a ``TorchFunctionMode`` sees every torch op; forward hooks keep a stack of the modules
  being run. Each op's output gets its autograd node tagged with the innermost module, the torch
  function and the user's source line and short stack (:mod:`~lightning_nanguard.frames`). The
  first op turning finite inputs into a NaN/Inf output is the *forward origin* (constants such as
  a ``masked_fill(-inf)`` attention mask are deliberate and ignored).
- backward: a hook on every node of the graph finds the first node that turns finite incoming
  gradients into NaN **or Inf** (anomaly mode checks NaN only, and only reports the node that
  *returned* it): the *backward origin*, e.g. ``SqrtBackward0`` at an exact 0.

The phase reported is "forward" when the loss itself is non-finite, "backward" when the loss is
finite but gradients are not. A batch that already holds NaN/Inf is the origin before any op
(op ``"<input>"``, no module, the batch fields in ``input_fields``); weights that already hold
NaN/Inf are named where they enter the model (the first op with a non-finite output, e.g.
``AddmmBackward0`` in the first ``Linear``, with a hint naming the real cause).

Rows: on a batch of ``batch_size`` samples, ``rows`` restricts every finiteness test to those
samples' rows of tensors whose first dimension is the batch (other tensors are tested whole). The
diagnosis runs the *full* bad batch and follows the offending samples, so the origin named is one
that happens in the real batch, and non-finite values that healthy samples produce and mask on
purpose are not mistaken for it.
When only BatchNorm statistics go non-finite, the op is ``"running_var"``, the module is the first
BatchNorm whose statistics went bad and the source line is where that module is called.
All hooks and modes are removed on exit, also on error.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_nanguard.batching import BatchField, nonfinite_fields
from lightning_nanguard.frames import Frame, UserCode, class_files, display_path, library_dirs
from lightning_nanguard.hints import hint_for

__all__ = ["Localization", "function_name", "localize", "user_frame"]

_TAG = "nanguard"
# Ops that create deliberate infinities (attention masks, sentinels): never an "origin".
_CONSTANT_OPS = frozenset(
    {
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
class _Site:
    module: str
    module_type: str
    frames: tuple[Frame, ...]
    function: str | None = None
    forward_nonfinite: bool = False


@dataclass(frozen=True)
class Localization:
    """Where the first non-finite value came from.

    Attributes:
        phase: ``"forward"``, ``"backward"``, or ``None`` when nothing non-finite was reproduced.
        module: qualified module name (``""`` = the LightningModule's own code), ``None`` if unknown
            or not a module (the batch itself).
        module_type: class name of that module.
        op: autograd node name (``"SqrtBackward0"``) or, without autograd, the torch function name;
            ``"running_var"`` for BatchNorm statistics, ``"<input>"`` when the batch itself holds
            NaN/Inf, ``"<parameters>"`` when non-finite weights could not be traced to an op.
        source_line: ``"path/file.py:LINE"`` of the op in user code (path relative to the source root
            when under it, else absolute).
        source_text: that line's text, stripped.
        hint: a one-line fix for well-known origins.
        input_nonfinite: the batch itself holds NaN/Inf.
        nonfinite_params: parameters that are already non-finite before the forward.
        bn_channels: BatchNorm module -> channels whose running statistics went non-finite.
        loss_finite: whether the re-run's loss was finite.
        grads_finite: whether the re-run's gradients were finite.
        source_path: absolute path of the source file.
        function: the torch function whose output (forward) or gradient (backward) turned
            non-finite, readable (``"torch.div"``), when known.
        stack: the short user stack of the op, innermost last: ``(display path, line, function)``.
        input_fields: batch fields holding NaN/Inf (see :func:`~lightning_nanguard.batching.nonfinite_fields`).
    """

    phase: Literal["forward", "backward"] | None = None
    module: str | None = None
    module_type: str | None = None
    op: str | None = None
    source_line: str | None = None
    source_text: str | None = None
    hint: str | None = None
    input_nonfinite: bool = False
    nonfinite_params: tuple[str, ...] = ()
    bn_channels: dict[str, list[int]] = field(default_factory=dict)
    loss_finite: bool = True
    grads_finite: bool = True
    source_path: str | None = None
    function: str | None = None
    stack: tuple[tuple[str, int, str], ...] = ()
    input_fields: tuple[BatchField, ...] = ()


def _all_true(flags: list[Tensor]) -> bool:
    """Whether every 0-dim boolean flag holds, with one host read per device.

    An op may mix a CUDA tensor with a CPU scalar tensor: their flags cannot be stacked together.
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for flag in flags:
        by_device.setdefault(flag.device, []).append(flag)
    return all(bool(torch.stack(group).all()) for group in by_device.values())


def _finite(tensors: Sequence[Any]) -> bool:
    checks = [
        torch.isfinite(t).all() for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    return _all_true(checks)


class _Rows:
    """Finiteness of the rows of chosen samples (tensors whose first dimension is the batch), or of whole tensors.

    Example:
        >>> x = torch.tensor([[1.0], [float("nan")], [2.0]])
        >>> _Rows([0, 2], 3).finite([x]), _Rows(None, 3).finite([x])
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
            return _finite(tensors)
        checks = []
        for t in tensors:
            if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
                continue
            if t.dim() > 0 and t.shape[0] == self.size and not t.is_sparse:
                t = t.detach().index_select(0, self._index_on(t.device))
            checks.append(torch.isfinite(t).all())
        return _all_true(checks)


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


def _tagged(node: Any) -> bool:
    return _TAG in node.metadata


def _module_files(module: nn.Module, cache: dict[type, frozenset[str]]) -> frozenset[str]:
    cls = type(module)
    if cls not in cache:
        cache[cls] = frozenset(class_files(cls))
    return cache[cls]


class _ForwardTracer(TorchFunctionMode):
    """Tags autograd nodes with module, function and user stack; records the first forward origin."""

    def __init__(self, root: nn.Module, rows: _Rows) -> None:
        super().__init__()
        self.root = root
        self.rows = rows
        self.stack: list[tuple[str, str, frozenset[str]]] = []
        self.origin: tuple[str, _Site] | None = None
        # First op with a non-finite output that autograd tracks, whatever its inputs: where
        # non-finite weights enter the model (used when the weights are bad).
        self.first_nonfinite: tuple[str, _Site] | None = None
        # First BatchNorm whose running statistics a forward turned non-finite, and its call site.
        self.bn_origin: _Site | None = None
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
            if self.bn_origin is None and _bn_bad_channels(module):
                self.bn_origin = _Site(name, type_name, self._frames(sys._getframe(1)), None, True)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _site(self, func: Any, nonfinite: bool) -> _Site:
        name, type_name, _ = self.stack[-1] if self.stack else ("", type(self.root).__name__, frozenset())
        return _Site(name, type_name, self._frames(sys._getframe(2)), function_name(func), nonfinite)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if not outputs:
            return out
        func_name = getattr(func, "__name__", str(func))
        nonfinite = not self.rows.finite(outputs)
        site: _Site | None = None
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
            if self.rows.finite(inputs):
                grad_fn = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
                op = grad_fn.name() if grad_fn is not None else func_name
                self.origin = (op, site or self._site(func, True))
        return out


class _BackwardTracer:
    """Hooks every node of a graph; remembers the first that turns finite grads into NaN/Inf."""

    def __init__(self, loss: Tensor, rows: _Rows) -> None:
        self.origin: tuple[str, _Site | None] | None = None
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


def _bn_bad_channels(bn: nn.Module) -> list[int]:
    """Channels of a BatchNorm whose running mean/var is non-finite (or whose variance is negative)."""
    mean, var = getattr(bn, "running_mean", None), getattr(bn, "running_var", None)
    if not isinstance(mean, Tensor) or not isinstance(var, Tensor):
        return []
    bad = ~torch.isfinite(var) | ~torch.isfinite(mean) | (var < 0)
    return [int(c) for c in bad.nonzero().flatten().tolist()]


def _bn_channels(module: nn.Module) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for name, child in module.named_modules():
        if isinstance(child, _BatchNorm):
            channels = _bn_bad_channels(child)
            if channels:
                found[name] = channels
    return found


def localize(
    module: nn.Module,
    run_forward: Callable[[], Tensor | None],
    batch: Any = None,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
    rows: Sequence[int] | None = None,
    batch_size: int | None = None,
    source_root: str | None = None,
    input_fields: Sequence[BatchField] | None = None,
) -> Localization:
    """Run ``run_forward`` (which returns the loss) and its backward under instrumentation.

    The caller is responsible for isolation (see :func:`lightning_nanguard.isolation.isolated`):
    this function changes BatchNorm statistics like any forward pass does.

    Args:
        module: the model; its submodules are named in the result, and the file defining its class
            is user code for the source line wherever it is installed.
        run_forward: computes and returns the loss of the bad (sub-)batch.
        batch: the (sub-)batch, to tell a non-finite input from an origin inside the model.
        params: named parameters to differentiate (default: every parameter requiring grad).
        rows: follow only these samples (positions in ``batch``; see the module docs).
        batch_size: number of samples of ``batch`` (needed with ``rows``).
        source_root: show source paths relative to this directory when under it (default: the
            working directory).
        input_fields: the batch fields holding NaN/Inf, when the caller already knows them (``()``:
            none, or only deliberate ones); default: read them off ``batch``.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(2))
        ...     def forward(self, x):
        ...         return ((self.w * x) ** 2).sum().sqrt()
        >>> net = Net()
        >>> found = localize(net, lambda: net(torch.zeros(2)))
        >>> found.phase, found.op, found.module, found.function
        ('backward', 'SqrtBackward0', '', 'torch.sqrt')
    """
    named = [(n, p) for n, p in (params if params is not None else module.named_parameters()) if p.requires_grad]
    fields = list(input_fields) if input_fields is not None else _input_fields(batch, batch_size)
    bad_params = tuple(n for n, p in named if not _finite([p.detach()]))
    follow = _Rows(rows, batch_size)
    tracer = _ForwardTracer(module, follow)
    try:
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=False), tracer:
            loss = run_forward()
    finally:
        tracer.remove()
    bn_channels = _bn_channels(module)
    common: dict[str, Any] = {
        "input_nonfinite": bool(fields),
        "input_fields": tuple(fields),
        "nonfinite_params": bad_params,
        "bn_channels": bn_channels,
    }
    if loss is None or not isinstance(loss, Tensor):
        return Localization(**common)
    common["loss_finite"] = _finite([loss.detach()])

    backward = _BackwardTracer(loss, follow) if loss.grad_fn is not None else None
    grads_finite = True
    try:
        if backward is not None and named:
            grads = torch.autograd.grad(loss.sum(), [p for _, p in named], allow_unused=True)
            grads_finite = _finite([g for g in grads if g is not None])
    finally:
        if backward is not None:
            backward.remove()
    common["grads_finite"] = grads_finite
    return _verdict(module, tracer, backward, common, source_root)


def _input_fields(batch: Any, size: int | None) -> list[BatchField]:
    if batch is None:
        return []
    try:
        return list(nonfinite_fields(batch, size))
    except TypeError:  # no readable batch size: test the batch whole
        leaves = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
        return [] if _finite(leaves) else ["<batch>"]


def _verdict(
    module: nn.Module,
    tracer: _ForwardTracer,
    backward: _BackwardTracer | None,
    common: dict[str, Any],
    source_root: str | None,
) -> Localization:
    loss_finite, grads_finite = common["loss_finite"], common["grads_finite"]
    if common["input_nonfinite"]:  # the batch is the origin, before any op
        return Localization(phase="forward", op="<input>", hint=hint_for("<input>", "forward"), **common)
    if common["nonfinite_params"]:
        if tracer.first_nonfinite is None:
            return Localization(phase="forward", op="<parameters>", hint=hint_for("<parameters>", "forward"), **common)
        # the op (and module) where the non-finite weights enter the model; the hint names the cause
        op, site = tracer.first_nonfinite
        located = _result("forward", op, site, common, source_root)
        return replace(located, hint=hint_for("<parameters>", "forward"))
    if not loss_finite and tracer.origin is not None:
        op, site = tracer.origin
        return _result("forward", op, site, common, source_root)
    if not grads_finite and backward is not None and backward.origin is not None:
        op, maybe_site = backward.origin
        return _result("backward", op, maybe_site, common, source_root)
    if tracer.origin is not None and (not loss_finite or not grads_finite):
        op, site = tracer.origin
        return _result("forward", op, site, common, source_root)
    if common["bn_channels"]:
        bn_site = tracer.bn_origin
        name = bn_site.module if bn_site is not None else next(iter(common["bn_channels"]))
        located = _result("forward", "running_var", bn_site, common, source_root)
        return replace(located, module=name, module_type=type(module.get_submodule(name)).__name__)
    return Localization(**common)


def _result(
    phase: Literal["forward", "backward"],
    op: str,
    site: _Site | None,
    common: dict[str, Any],
    source_root: str | None,
) -> Localization:
    frames = site.frames if site is not None else ()
    source_line = source_text = source_path = None
    if frames:
        inner = frames[0]
        source_path = inner.path
        source_line = f"{display_path(inner.path, source_root)}:{inner.line}"
        source_text = linecache.getline(inner.path, inner.line).strip() or None
    masked_forward = phase == "backward" and site is not None and site.forward_nonfinite
    return Localization(
        phase=phase,
        module=site.module if site is not None else None,
        module_type=site.module_type if site is not None else None,
        op=op,
        source_line=source_line,
        source_text=source_text,
        hint=hint_for(op, phase, masked_forward=masked_forward),
        source_path=source_path,
        function=site.function if site is not None else None,
        stack=tuple((display_path(f.path, source_root), f.line, f.function) for f in reversed(frames)),
        **common,
    )
