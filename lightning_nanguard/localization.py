"""Name the module, autograd op and source line where the first non-finite value is produced.

:func:`localize` runs one forward pass and one backward pass (``torch.autograd.grad``, so
``.grad`` is untouched) of a bad (sub-)batch with instrumentation that exists only for that call:

- forward: a ``TorchFunctionMode`` sees every torch op; forward hooks keep a stack of the modules
  being run. Each op's output gets its autograd node tagged with the innermost module and the
  user's source line (the first stack frame outside torch, Lightning and this package). The first
  op turning finite inputs into a NaN/Inf output is the *forward origin* (constants such as a
  ``masked_fill(-inf)`` attention mask are deliberate and ignored).
- backward: a hook on every node of the graph finds the first node that turns finite incoming
  gradients into NaN **or Inf** (anomaly mode checks NaN only, and only reports the node that
  *returned* it): the *backward origin*, e.g. ``SqrtBackward0`` at an exact 0.

The phase reported is "forward" when the loss itself is non-finite, "backward" when the loss is
finite but gradients are not. Two causes are named by where they enter the model instead: a
batch that already holds NaN/Inf, and weights that already do (the first op with a non-finite
output, e.g. ``AddmmBackward0`` in the first ``Linear``, with a hint naming the real cause).
When only BatchNorm statistics go non-finite, the op is ``"running_var"``, the module is the first
BatchNorm whose statistics went bad and the source line is where that module is called.
All hooks and modes are removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import linecache
import os
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

from lightning_nanguard.hints import hint_for

__all__ = ["Localization", "localize", "user_frame"]

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


def _library_dirs() -> tuple[str, ...]:
    dirs = [
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.abspath(__file__)),
        os.path.dirname(contextlib.__file__),
    ]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics"):
        module = sys.modules.get(name)
        module_file = getattr(module, "__file__", None) if module is not None else None
        if module_file:
            dirs.append(os.path.dirname(module_file))
    return tuple(os.path.join(d, "") for d in dirs)


def user_frame(frame: FrameType | None, skip_dirs: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """The innermost frame outside torch, Lightning, the standard library's ``contextlib`` and this package.

    Example:
        >>> import sys
        >>> user_frame(sys._getframe()) is not None
        True
    """
    skip = skip_dirs if skip_dirs is not None else _library_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and not filename.startswith("<frozen"):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class _Site:
    module: str
    module_type: str
    frame: tuple[str, int] | None
    forward_nonfinite: bool = False


@dataclass(frozen=True)
class Localization:
    """Where the first non-finite value came from.

    Attributes:
        phase: ``"forward"``, ``"backward"``, or ``None`` when nothing non-finite was reproduced.
        module: qualified module name (``""`` = the LightningModule's own code), ``None`` if unknown.
        module_type: class name of that module.
        op: autograd node name (``"SqrtBackward0"``) or, without autograd, the torch function name;
            ``"running_var"`` for BatchNorm statistics, ``"<input>"``/``"<parameters>"`` when a
            non-finite batch or weights could not be traced to an op.
        source_line: ``"file.py:LINE"`` of the op in user code.
        source_text: that line's text, stripped.
        hint: a one-line fix for well-known origins.
        input_nonfinite: the batch itself holds NaN/Inf.
        nonfinite_params: parameters that are already non-finite before the forward.
        bn_channels: BatchNorm module -> channels whose running statistics went non-finite.
        loss_finite: whether the re-run's loss was finite.
        grads_finite: whether the re-run's gradients were finite.
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


def _finite(tensors: Sequence[Any]) -> bool:
    checks = [
        torch.isfinite(t).all() for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    return bool(torch.stack(checks).all()) if checks else True


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


class _ForwardTracer(TorchFunctionMode):
    """Tags autograd nodes with module and source line; records the first forward origin."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root
        self.stack: list[tuple[str, str]] = []
        self.origin: tuple[str, _Site] | None = None
        # First op with a non-finite output that autograd tracks, whatever its inputs: where
        # non-finite data or weights enter the model (used when the batch or the weights are bad).
        self.first_nonfinite: tuple[str, _Site] | None = None
        # First BatchNorm whose running statistics a forward turned non-finite, and its call site.
        self.bn_origin: _Site | None = None
        self.skip_dirs = _library_dirs()
        self._handles: list[Any] = []
        for name, module in root.named_modules():
            if module is root:
                continue
            self._handles.append(module.register_forward_pre_hook(self._push(name, type(module).__name__)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                self._handles.append(module.register_forward_hook(self._check_stats(name, type(module).__name__)))

    def _push(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append((name, type_name))

        return hook

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def _check_stats(self, name: str, type_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.bn_origin is None and _bn_bad_channels(module):
                self.bn_origin = _Site(name, type_name, user_frame(sys._getframe(1), self.skip_dirs), True)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _site(self, nonfinite: bool) -> _Site:
        name, type_name = self.stack[-1] if self.stack else ("", type(self.root).__name__)
        return _Site(name, type_name, user_frame(sys._getframe(2), self.skip_dirs), nonfinite)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if not outputs:
            return out
        func_name = getattr(func, "__name__", str(func))
        nonfinite = not _finite(outputs)
        site: _Site | None = None
        for tensor in outputs:
            node = tensor.grad_fn
            if node is None:
                continue
            site = site or self._site(nonfinite)
            # nodes created by this op are exactly the untagged ones; a tagged node's ancestors are all
            # tagged already (they were walked when it was), so stopping there keeps this linear
            for inner in _nodes(node, stop=_tagged):
                inner.metadata[_TAG] = site
        if nonfinite and self.first_nonfinite is None and func_name not in _CONSTANT_OPS:
            tracked = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
            if tracked is not None:
                self.first_nonfinite = (tracked.name(), site or self._site(True))
        if nonfinite and self.origin is None and func_name not in _CONSTANT_OPS:
            inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)]
            if _finite(inputs):
                grad_fn = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
                op = grad_fn.name() if grad_fn is not None else func_name
                self.origin = (op, site or self._site(True))
        return out


class _BackwardTracer:
    """Hooks every node of a graph; remembers the first that turns finite grads into NaN/Inf."""

    def __init__(self, loss: Tensor) -> None:
        self.origin: tuple[str, _Site | None] | None = None
        self._handles = [node.register_hook(self._make_hook(node)) for node in _nodes(loss.grad_fn)]

    def _make_hook(self, node: Any) -> Callable[..., None]:
        def hook(grad_inputs: Sequence[Tensor | None], grad_outputs: Sequence[Tensor | None]) -> None:
            if self.origin is not None:
                return
            if _finite(list(grad_outputs)) and not _finite(list(grad_inputs)):
                self.origin = (node.name(), node.metadata.get(_TAG))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _site_text(frame: tuple[str, int] | None) -> tuple[str | None, str | None]:
    if frame is None:
        return None, None
    filename, lineno = frame
    text = linecache.getline(filename, lineno).strip() or None
    return f"{_short_path(filename)}:{lineno}", text


def _short_path(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


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
) -> Localization:
    """Run ``run_forward`` (which returns the loss) and its backward under instrumentation.

    The caller is responsible for isolation (see :func:`lightning_nanguard.isolation.isolated`):
    this function changes BatchNorm statistics like any forward pass does.

    Args:
        module: the model; its submodules are named in the result.
        run_forward: computes and returns the loss of the bad (sub-)batch.
        batch: the (sub-)batch, to tell a non-finite input from an origin inside the model.
        params: named parameters to differentiate (default: every parameter requiring grad).

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(2))
        ...     def forward(self, x):
        ...         return ((self.w * x) ** 2).sum().sqrt()
        >>> net = Net()
        >>> found = localize(net, lambda: net(torch.zeros(2)))
        >>> found.phase, found.op, found.module
        ('backward', 'SqrtBackward0', '')
    """
    named = [(n, p) for n, p in (params if params is not None else module.named_parameters()) if p.requires_grad]
    input_nonfinite = batch is not None and not _finite([t for t in tree_leaves(batch) if isinstance(t, Tensor)])
    bad_params = tuple(n for n, p in named if not _finite([p.detach()]))
    tracer = _ForwardTracer(module)
    try:
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=False), tracer:
            loss = run_forward()
    finally:
        tracer.remove()
    bn_channels = _bn_channels(module)
    if loss is None or not isinstance(loss, Tensor):
        return Localization(input_nonfinite=input_nonfinite, nonfinite_params=bad_params, bn_channels=bn_channels)
    loss_finite = _finite([loss.detach()])

    backward = _BackwardTracer(loss) if loss.grad_fn is not None else None
    grads_finite = True
    try:
        if backward is not None and named:
            grads = torch.autograd.grad(loss.sum(), [p for _, p in named], allow_unused=True)
            grads_finite = _finite([g for g in grads if g is not None])
    finally:
        if backward is not None:
            backward.remove()

    common: dict[str, Any] = {
        "input_nonfinite": input_nonfinite,
        "nonfinite_params": bad_params,
        "bn_channels": bn_channels,
        "loss_finite": loss_finite,
        "grads_finite": grads_finite,
    }
    for bad, kind in ((input_nonfinite, "<input>"), (bool(bad_params), "<parameters>")):
        if not bad:
            continue
        if tracer.first_nonfinite is None:
            return Localization(phase="forward", op=kind, hint=hint_for(kind, "forward"), **common)
        # the op (and module) where the non-finite batch or weights enter the model; the hint names the cause
        op, site = tracer.first_nonfinite
        return replace(_result("forward", op, site, common), hint=hint_for(kind, "forward"))

    if not loss_finite and tracer.origin is not None:
        op, site = tracer.origin
        return _result("forward", op, site, common)
    if not grads_finite and backward is not None and backward.origin is not None:
        op, maybe_site = backward.origin
        return _result("backward", op, maybe_site, common)
    if tracer.origin is not None and (not loss_finite or not grads_finite):
        op, site = tracer.origin
        return _result("forward", op, site, common)
    if bn_channels:
        bn_site = tracer.bn_origin
        name = bn_site.module if bn_site is not None else next(iter(bn_channels))
        source_line, source_text = _site_text(bn_site.frame if bn_site is not None else None)
        return Localization(
            phase="forward",
            module=name,
            module_type=type(module.get_submodule(name)).__name__,
            op="running_var",
            source_line=source_line,
            source_text=source_text,
            hint=hint_for("running_var", "forward"),
            **common,
        )
    return Localization(**common)


def _result(phase: Literal["forward", "backward"], op: str, site: _Site | None, common: dict[str, Any]) -> Localization:
    source_line, source_text = _site_text(site.frame if site is not None else None)
    masked_forward = phase == "backward" and site is not None and site.forward_nonfinite
    return Localization(
        phase=phase,
        module=site.module if site is not None else None,
        module_type=site.module_type if site is not None else None,
        op=op,
        source_line=source_line,
        source_text=source_text,
        hint=hint_for(op, phase, masked_forward=masked_forward),
        **common,
    )
