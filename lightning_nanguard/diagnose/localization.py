"""Name the module, autograd op and source line where the first non-finite value is produced.

:func:`localize` runs one forward pass and one backward pass (``torch.autograd.grad``, so
``.grad`` is untouched) of a bad (sub-)batch with instrumentation that exists only for that call:

- forward: a ``TorchFunctionMode`` sees every torch op; forward hooks keep a stack of the modules
  being run. Each op's output gets its autograd node tagged with the innermost module, the torch
  function and the user's source line and short stack (:mod:`~lightning_nanguard.diagnose.frames`). The
  first op that gives birth to a non-finite value is the *forward origin*: NaN/Inf from finite
  inputs, or NaN from inputs that hold infinities but no NaN (the softmax of a row masked entirely,
  ``inf - inf``, ``0 * inf``). Ops that write infinities on purpose (a ``masked_fill(-inf)``
  attention mask) or carry them on are not origins (:mod:`~lightning_nanguard.diagnose.tracing`).
  A custom autograd Function is one op, named at its ``.apply(...)`` call.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_nanguard.diagnose.batching import BatchField, nonfinite_fields
from lightning_nanguard.diagnose.frames import display_path
from lightning_nanguard.diagnose.hints import hint_for
from lightning_nanguard.diagnose.isolation import gradients
from lightning_nanguard.diagnose.tracing import (
    BackwardTracer,
    ForwardTracer,
    Rows,
    Site,
    bn_channels_of,
    finite,
    function_name,
    graph_leaves,
    user_frame,
)

__all__ = ["Localization", "function_name", "localize", "user_frame"]  # the last two from .tracing


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
        input_fields: batch fields holding NaN/Inf (see :func:`~lightning_nanguard.diagnose.batching.nonfinite_fields`).
        from_infinity: the forward origin made NaN of inputs holding infinities but no NaN (a mask
            or padding value met another infinity or a zero).
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
    from_infinity: bool = False


def localize(
    module: nn.Module,
    run_forward: Callable[[], Tensor | None],
    batch: Any = None,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
    rows: Sequence[int] | Rows | None = None,
    batch_size: int | None = None,
    source_root: str | None = None,
    input_fields: Sequence[BatchField] | None = None,
    grads_from_graph: bool = False,
) -> Localization:
    """Run ``run_forward`` (which returns the loss) and its backward under instrumentation.

    The caller is responsible for isolation (see :func:`lightning_nanguard.diagnose.isolation.isolated`):
    this function changes BatchNorm statistics like any forward pass does.

    Args:
        module: the model; its submodules are named in the result, and the file defining its class
            is user code for the source line wherever it is installed.
        run_forward: computes and returns the loss of the bad (sub-)batch.
        batch: the (sub-)batch, to tell a non-finite input from an origin inside the model.
        params: named parameters to differentiate (default: every parameter requiring grad).
        rows: follow only these samples (positions in ``batch``; see the module docs), or a
            :class:`~lightning_nanguard.diagnose.tracing.Rows` (several loaders' parts).
        batch_size: number of samples of ``batch`` (needed with ``rows``).
        source_root: show source paths relative to this directory when under it (default: the
            working directory).
        input_fields: the batch fields holding NaN/Inf, when the caller already knows them (``()``:
            none, or only deliberate ones); default: read them off ``batch``.
        grads_from_graph: differentiate with respect to the leaves of the loss's graph (the
            unsharded parameters a sharded forward used, see :func:`~lightning_nanguard.diagnose.tracing.graph_leaves`).

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
    bad_params = tuple(n for n, p in named if not finite([p.detach()]))
    follow = rows if isinstance(rows, Rows) else Rows(rows, batch_size)
    tracer = ForwardTracer(module, follow)
    try:
        with (
            torch.enable_grad(),
            torch.autograd.set_detect_anomaly(True, check_nan=False),
            tracer,
            tracer.custom_functions(),
        ):
            loss = run_forward()
    finally:
        tracer.remove()
    bn_channels = bn_channels_of(module)
    common: dict[str, Any] = {
        "input_nonfinite": bool(fields),
        "input_fields": tuple(fields),
        "nonfinite_params": bad_params,
        "bn_channels": bn_channels,
    }
    if loss is None or not isinstance(loss, Tensor):
        return Localization(**common)
    common["loss_finite"] = finite([loss.detach()])

    backward = BackwardTracer(loss, follow) if loss.grad_fn is not None else None
    grads_finite = True
    try:
        targets = graph_leaves(loss) if grads_from_graph else [p for _, p in named]
        if backward is not None and targets:
            grads = gradients(loss.sum(), targets)
            grads_finite = finite([g for g in grads if g is not None])
    finally:
        if backward is not None:
            backward.remove()
    common["grads_finite"] = grads_finite
    return _origin(module, tracer, backward, common, source_root)


def _input_fields(batch: Any, size: int | None) -> list[BatchField]:
    if batch is None:
        return []
    try:
        return list(nonfinite_fields(batch, size))
    except TypeError:  # no readable batch size: test the batch whole
        leaves = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
        return [] if finite(leaves) else ["<batch>"]


def _origin(
    module: nn.Module,
    tracer: ForwardTracer,
    backward: BackwardTracer | None,
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
    infinity = tracer.origin_from_infinity
    if not loss_finite and tracer.origin is not None:
        op, site = tracer.origin
        return _result("forward", op, site, common, source_root, from_infinity=infinity)
    if not grads_finite and backward is not None and backward.origin is not None:
        op, maybe_site = backward.origin
        return _result("backward", op, maybe_site, common, source_root)
    if tracer.origin is not None and (not loss_finite or not grads_finite):
        op, site = tracer.origin
        return _result("forward", op, site, common, source_root, from_infinity=infinity)
    if common["bn_channels"]:
        bn_site = tracer.bn_origin
        name = bn_site.module if bn_site is not None else next(iter(common["bn_channels"]))
        located = _result("forward", "running_var", bn_site, common, source_root)
        return replace(located, module=name, module_type=type(module.get_submodule(name)).__name__)
    return Localization(**common)


def _result(
    phase: Literal["forward", "backward"],
    op: str,
    site: Site | None,
    common: dict[str, Any],
    source_root: str | None,
    from_infinity: bool = False,
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
        hint=hint_for(
            op,
            phase,
            masked_forward=masked_forward,
            from_infinity=from_infinity,
            custom_function=site is not None and site.custom_function,
        ),
        source_path=source_path,
        function=site.function if site is not None else None,
        stack=tuple((display_path(f.path, source_root), f.line, f.function) for f in reversed(frames)),
        from_infinity=from_infinity,
        **common,
    )
