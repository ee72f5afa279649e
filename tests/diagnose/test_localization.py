"""``localize`` / ``diagnose`` without a Trainer, on plain modules.

The origin of every failure class of ``tests/helpers/models.py`` is named exactly (module, autograd op,
phase, ``file:line``); an origin that yields -Inf, which anomaly mode misses or blames on a later
node, is found; and nothing the instrumentation installs survives the call.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forensics_models
import models
import pytest
import torch
from forensics_models import EXPECTED, FUNCTIONS, one_thread  # noqa: F401 (fixture)
from models import BATCH_SIZE, KINDS, make_case, make_module, origin_line
from torch import Tensor, nn

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.localization import Localization, localize, user_frame

pytestmark = pytest.mark.usefixtures("one_thread")

BAD_POSITION = 3  # sample 11 = batch 1, position 3


def bad_batch(kind: str, value: float | None = None, bad: tuple[int, ...] = (11,)) -> list[Tensor]:
    """Batch 1 (samples 8..15) of the failure class, which holds the bad sample(s)."""
    case = make_case(kind, value=value, bad=bad)
    return [t[BATCH_SIZE : 2 * BATCH_SIZE] for t in case.dataset.tensors]


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Nothing localisation installs survives: function modes, anomaly mode."""
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.is_anomaly_enabled()
    check_nan = torch.is_anomaly_check_nan_enabled()
    yield
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.is_anomaly_enabled()
    assert torch.is_anomaly_check_nan_enabled() == check_nan


def assert_no_hooks(module: nn.Module) -> None:
    for name, child in module.named_modules():
        assert not child._forward_hooks, f"forward hook left on {name!r}"
        assert not child._forward_pre_hooks, f"forward pre-hook left on {name!r}"
        assert not child._forward_hooks_always_called, f"always-called hook flag left on {name!r}"
        assert not child._backward_hooks and not child._backward_pre_hooks


def cases() -> list[Any]:
    params = [pytest.param(kind, None, id=kind) for kind in KINDS if kind != "input_data"]
    params += [
        pytest.param("input_data", value, id=f"input_data-{name}")
        for value, name in ((math.nan, "nan"), (math.inf, "+inf"), (-math.inf, "-inf"))
    ]
    return params


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(("kind", "value"), cases())
def test_localize_names_module_op_phase_and_line(kind: str, value: float | None) -> None:
    module = make_module("lightning", kind)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    if kind in ("bn_overflow", "input_data"):  # BatchNorm in train mode: the whole (bad) batch
        batch = bad_batch(kind, value)
    else:  # the offending sample alone
        batch = [t[BAD_POSITION : BAD_POSITION + 1] for t in bad_batch(kind, value)]
    found = localize(module, lambda: module.training_step(batch, 1), batch=batch)

    culprit_module, culprit_op, phase = EXPECTED[kind]
    assert (found.module, found.op, found.phase) == (culprit_module, culprit_op, phase)
    assert found.function == FUNCTIONS[kind]
    assert found.hint is not None
    case = make_case(kind, value=value)
    assert found.loss_finite == case.finite_loss
    assert found.input_nonfinite == (kind == "input_data")
    if kind == "input_data":  # the batch itself, before any op: no module, no line
        assert "the batch itself holds NaN/Inf" in found.hint
        assert found.input_fields == (0,)  # [x, y]: the NaN/Inf is in x
        assert found.source_line is None and found.module_type is None and found.stack == ()
        assert found.bn_channels == {"net.1": list(range(8))}
    else:
        assert found.input_fields == ()
        assert found.source_line is not None
        assert found.source_line.endswith(f"models.py:{origin_line(kind)}")
        assert found.source_path == str(Path(models.__file__).resolve())
        assert found.source_text is not None and found.source_text.endswith(f"# ORIGIN: {kind}")
        assert found.module_type == type(module.get_submodule(culprit_module)).__name__
        # the short user stack, innermost last: the op's line, then the callers in user code
        assert found.stack[-1] == (found.source_line.rsplit(":", 1)[0], origin_line(kind), found.stack[-1][2])
        assert any(frame[2] == "training_step" for frame in found.stack) and len(found.stack) <= 8
    if kind == "bn_overflow":
        assert found.bn_channels == {"net.input_bn": [2]}  # the corrupted feature is column 2
        assert found.grads_finite
    assert_no_hooks(module)
    if kind not in ("bn_overflow", "input_data"):  # localize is not isolated (the caller isolates)
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())  # autograd.grad, never backward


def test_masked_division_hint_in_localize() -> None:
    module = make_module("lightning", "masked_div")
    batch = [t[BAD_POSITION : BAD_POSITION + 1] for t in bad_batch("masked_div")]
    found = localize(module, lambda: module.training_step(batch, 1), batch=batch)
    assert found.hint is not None and "masked after the fact" in found.hint


# ------------------------------------------------------------------------------------ -Inf origins


class PureAcos(nn.Module):
    """``acos(w * x)`` with ``w * x == 1`` exactly: the gradient is -Inf and never NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        return torch.acos(self.w * x).sum()


@pytest.mark.usefixtures("no_leftovers")
def test_minus_inf_origin_that_anomaly_mode_misses() -> None:
    net = PureAcos()
    x = torch.tensor([2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=True):
            net(x).backward()  # anomaly mode: silent, the -Inf goes straight into .grad
    assert net.w.grad is not None and net.w.grad.item() == -math.inf
    net.w.grad = None

    found = localize(net, lambda: net(x))
    assert (found.phase, found.op, found.module) == ("backward", "AcosBackward0", "")
    assert found.loss_finite and not found.grads_finite
    assert found.source_line is not None and found.source_line.endswith(
        f"test_localization.py:{PureAcos.forward.__code__.co_firstlineno + 1}"
    )
    assert found.module_type == "PureAcos"
    assert_no_hooks(net)


def test_anomaly_mode_blames_a_later_node_where_localize_finds_acos() -> None:
    module = make_module("lightning", "acos")
    batch = bad_batch("acos")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="returned nan values") as info, torch.autograd.detect_anomaly():
            module.training_step(batch, 1).backward()
    assert "AcosBackward0" not in str(info.value)  # blamed on a later node (the norm's backward)
    module.zero_grad(set_to_none=True)
    found = localize(module, lambda: module.training_step(batch, 1), batch=batch)
    assert (found.op, found.module, found.phase) == ("AcosBackward0", "net.angle", "backward")


# ------------------------------------------------------------------------------------ forward origins


class MaskedAttention(nn.Module):
    """A deliberate ``masked_fill(-inf)`` (attention mask), then a real ``log(0)`` origin."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor, zero: Tensor) -> Tensor:
        scores = self.proj(x).masked_fill(mask, -math.inf)
        attention = scores.softmax(-1)
        penalty = torch.log(zero * attention.sum())
        return attention.sum() + penalty


@pytest.mark.usefixtures("no_leftovers")
def test_deliberate_infinities_are_not_origins() -> None:
    net = MaskedAttention()
    x = torch.randn(2, 4)
    mask = torch.tensor([[False, True, True, False], [True, False, False, False]])
    healthy = localize(net, lambda: net(x, mask, torch.tensor(1.0)))
    assert healthy == Localization(loss_finite=True, grads_finite=True)

    found = localize(net, lambda: net(x, mask, torch.tensor(0.0)))
    assert (found.phase, found.op, found.module) == ("forward", "LogBackward0", "")
    line = MaskedAttention.forward.__code__.co_firstlineno + 3
    assert found.source_line is not None and found.source_line.endswith(f"test_localization.py:{line}")
    assert found.source_text == "penalty = torch.log(zero * attention.sum())"


@pytest.mark.usefixtures("no_leftovers")
def test_nonfinite_weights_are_named_where_they_enter() -> None:
    module = make_module("lightning", "cosine_norm")
    with torch.no_grad():
        module.net.feature.weight[0, 0] = math.nan
    batch = [t[:2] for t in bad_batch("cosine_norm")]
    found = localize(module, lambda: module.training_step(batch, 0), batch=batch)
    assert found.nonfinite_params == ("net.feature.weight",)
    assert (found.phase, found.module, found.op) == ("forward", "net.feature", "MmBackward0")
    assert found.hint is not None and "weights are already non-finite" in found.hint


@pytest.mark.usefixtures("no_leftovers")
def test_step_origin_in_the_lightning_module_itself() -> None:
    module = forensics_models.StepOriginModule()
    batch = (torch.zeros(2, 3), torch.ones(2))
    found = localize(module, lambda: module.training_step(batch, 0), batch=batch)
    assert (found.module, found.op, found.phase) == ("", "SqrtBackward0", "backward")
    assert found.module_type == "StepOriginModule"
    assert found.source_line is not None
    assert found.source_line.endswith(f"forensics_models.py:{origin_line('step_sqrt', forensics_models.__file__)}")


def test_healthy_and_lossless_runs() -> None:
    module = make_module("lightning", "cosine_norm")
    batch = [t[:4] for t in make_case("cosine_norm").dataset.tensors]
    assert localize(module, lambda: module.training_step(batch, 0)).phase is None
    assert localize(module, lambda: None) == Localization()
    assert_no_hooks(module)


class Boom(RuntimeError):
    pass


@pytest.mark.usefixtures("no_leftovers")
def test_everything_removed_when_the_forward_raises() -> None:
    module = make_module("lightning", "bn_overflow")
    user_hook = module.net.hidden.register_forward_hook(lambda *args: None)

    def run() -> Tensor:
        module.net(torch.randn(4, 6))
        raise Boom

    with pytest.raises(Boom):
        localize(module, run)
    assert list(module.net.hidden._forward_hooks) == [user_hook.id]  # the user's own hook is kept
    user_hook.remove()
    assert_no_hooks(module)


def test_user_anomaly_mode_is_left_as_it_was() -> None:
    net = PureAcos()
    with torch.autograd.set_detect_anomaly(True, check_nan=True):
        localize(net, lambda: net(torch.tensor([2.0])))
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    assert not torch.is_anomaly_enabled()


def test_user_frame_skips_library_frames() -> None:
    import sys

    frame = user_frame(sys._getframe())
    assert frame is not None and frame[0] == __file__


# ------------------------------------------------------------------------------------ diagnose


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("kind", KINDS)
def test_diagnose_without_a_trainer(kind: str) -> None:
    module = make_module("lightning", kind)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)  # must be untouched
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    found = diagnose(module, bad_batch(kind), batch_idx=1)

    assert found.offending == [BAD_POSITION] and found.error is None and found.batch_size == BATCH_SIZE
    assert found.smallest_bad == [BAD_POSITION]
    loc = found.localization
    assert loc is not None
    assert (loc.module, loc.op, loc.phase) == EXPECTED[kind]
    if kind == "input_data":  # read off the batch; one pass confirms the other 7 samples are healthy
        assert (found.cause, found.input_fields, found.passes, found.state_passes) == ("input", (0,), 1, 0)
        assert loc.source_line is None
    else:  # the whole batch, one probe (position 1, healthy: not the model state), then the search
        assert (found.cause, found.passes, found.state_passes) == ("data", 7, 2)
        assert loc.source_line is not None and loc.source_line.endswith(f"models.py:{origin_line(kind)}")
    # isolated: weights, BatchNorm buffers, grads and the RNG are exactly as before
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in module.parameters() if p.grad is not None)
    assert torch.equal(torch.get_rng_state(), rng)
    assert module.training
    assert_no_hooks(module)


def test_diagnose_two_offending_samples() -> None:
    module = make_module("lightning", "power_pool")
    found = diagnose(module, bad_batch("power_pool", bad=(8, 15)))
    assert found.offending == [0, 7]
    assert found.localization is not None and found.localization.op == "PowBackward1"


def test_diagnose_an_unsliceable_batch_reports_an_error() -> None:
    module = make_module("lightning", "cosine_norm")
    found = diagnose(module, {"names": ["a", "b"]})
    assert found.offending is None and found.error is not None and "batch_slicer" in found.error


def test_diagnose_a_failing_training_step_reports_an_error() -> None:
    class Picky(nn.Module):
        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            if batch.shape[0] != 4:
                raise ValueError("expects exactly 4 samples")
            return batch.log().sum()

    found = diagnose(Picky(), torch.tensor([1.0, 0.0, 2.0, 3.0]))
    assert found.offending is None and found.error is not None and "expects exactly 4 samples" in found.error
    assert found.passes == 2 and "re-running training_step failed" in found.reason


def test_diagnose_with_bisection_off_localizes_the_whole_batch() -> None:
    module = make_module("lightning", "log_zero")
    found = diagnose(module, bad_batch("log_zero"), bisect=False)
    assert found.offending is None and found.passes == 0
    assert found.localization is not None and found.localization.op == "LogBackward0"
    assert diagnose(module, bad_batch("log_zero"), bisect=False, localize_origin=False).localization is None


class Deep(nn.Module):
    """Many small layers, then ``sqrt`` of an exact 0 (``h - h.detach()``)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x - x.detach()).pow(2).sum().sqrt()


def test_graph_tagging_visits_each_node_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_nanguard.diagnose import tracing as localization

    original = localization._nodes
    visits = 0

    def counting(root: Any, stop: Any = None) -> Iterator[Any]:
        nonlocal visits
        for node in original(root, stop):
            visits += stop is not None  # the forward tagging walks only
            yield node

    net = Deep(120)
    x = torch.randn(2, 3)
    graph = len(list(original(net(x).grad_fn)))
    monkeypatch.setattr(localization, "_nodes", counting)
    found = localize(net, lambda: net(x))
    assert (found.op, found.module, found.phase) == ("SqrtBackward0", "", "backward")
    assert graph > 360 and visits <= graph + 5  # linear: each node tagged once (quadratic: ~graph**2 / 2)


def test_a_failing_localisation_keeps_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_nanguard.diagnose import origin as forensics

    def broken(*args: Any) -> Any:
        raise RuntimeError("instrumentation broke")

    monkeypatch.setattr(forensics, "_localize_batch", broken)
    found = diagnose(make_module("lightning", "acos"), bad_batch("acos"))
    assert found.offending == [BAD_POSITION] and found.localization is None
    assert found.error == "localisation failed: RuntimeError('instrumentation broke')"


# ------------------------------------------------------------------------------------ the first of two origins


class TwoForwardOrigins(nn.Module):
    """Two independent forward origins: ``log(0)`` first, then ``0 / 0`` (finite inputs, non-finite outputs)."""

    def forward(self, x: Tensor) -> Tensor:
        first = torch.log(x * 0)  # -inf from a finite input
        second = (x * 0) / (x * 0)  # NaN from finite inputs, later in the forward
        return first.sum() + second.sum()


class TwoBackwardOrigins(nn.Module):
    """Two independent backward origins on parallel branches: ``sqrt(0)`` and ``acos(1)``.

    The autograd engine runs the later-created node first: ``AcosBackward0`` is the first node to
    turn finite incoming gradients into -Inf, then ``SqrtBackward0`` turns its own into Inf.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: Tensor) -> Tensor:
        root = (self.w * x * 0).sqrt()
        angle = torch.acos(self.w * x / x)
        return root.sum() + angle.sum()


@pytest.mark.usefixtures("no_leftovers")
def test_the_first_of_two_forward_origins_is_reported() -> None:
    net = TwoForwardOrigins()
    found = localize(net, lambda: net(torch.ones(3, requires_grad=True)))
    assert (found.phase, found.op, found.function) == ("forward", "LogBackward0", "torch.log")
    line = TwoForwardOrigins.forward.__code__.co_firstlineno + 1
    assert found.source_line is not None and found.source_line.endswith(f"test_localization.py:{line}")


@pytest.mark.usefixtures("no_leftovers")
def test_the_first_of_two_backward_origins_is_reported() -> None:
    net = TwoBackwardOrigins()
    with torch.no_grad():
        assert torch.isfinite(net(torch.ones(2)))  # forward finite: a backward-only fault
    order: list[str] = []
    loss = net(torch.ones(2))
    hooks = [node.register_hook(lambda gi, go, n=node: order.append(n.name())) for node in localization_nodes(loss)]
    torch.autograd.grad(loss, [net.w])
    for hook in hooks:
        hook.remove()
    assert order.index("AcosBackward0") < order.index("SqrtBackward0")  # the engine's order, checked
    found = localize(net, lambda: net(torch.ones(2)))
    assert (found.phase, found.op, found.function) == ("backward", "AcosBackward0", "torch.acos")


def localization_nodes(loss: Tensor) -> list[Any]:
    from lightning_nanguard.diagnose import tracing as localization

    return list(localization._nodes(loss.grad_fn))


# ------------------------------------------------------------------------------------ rows of the real batch


class MaskedLogMean(nn.Module):
    """Per-sample ``log`` of a count, masked with ``where`` for samples without tokens (a deliberate -inf),
    then a real origin: a division by the number of kept samples' scores, which is 0 for sample ``bad``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor, count: Tensor) -> Tensor:
        logs = torch.log(count)  # -inf for padding-only samples: masked below, healthy
        safe = torch.where(count > 0, logs, torch.zeros_like(logs))
        scores = (self.w * x).sum(-1)
        return (scores / scores + safe).sum()  # 0/0 for an all-zero sample: the origin


@pytest.mark.usefixtures("no_leftovers")
def test_following_the_offending_rows_skips_what_healthy_samples_mask_on_purpose() -> None:
    net = MaskedLogMean()
    x = torch.ones(4, 3)
    x[2] = 0.0  # sample 2: 0/0
    count = torch.tensor([3.0, 0.0, 2.0, 1.0])  # sample 1: log(0), masked (healthy)
    whole = localize(net, lambda: net(x, count))
    assert whole.function == "torch.log"  # blind to rows: the healthy, masked -inf comes first
    followed = localize(net, lambda: net(x, count), rows=[2], batch_size=4)
    assert (followed.phase, followed.op, followed.function) == ("forward", "DivBackward0", "torch.div")


def test_diagnose_localises_on_the_full_batch_following_the_offending_rows() -> None:
    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MaskedLogMean()

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self.net(*batch)

    x = torch.ones(4, 3)
    x[2] = 0.0
    found = diagnose(Step(), (x, torch.tensor([3.0, 0.0, 2.0, 1.0])))
    assert (found.cause, found.offending) == ("data", [2])
    assert found.localization is not None and found.localization.op == "DivBackward0"


# ------------------------------------------------------------------------------------ user source lines


def test_source_paths_are_relative_to_the_source_root_when_under_it(tmp_path: Path) -> None:
    net = PureAcos()
    here = Path(__file__).resolve()
    relative = localize(net, lambda: net(torch.tensor([2.0])), source_root=str(here.parents[2]))
    assert relative.source_line == f"tests/diagnose/test_localization.py:{PureAcos.forward.__code__.co_firstlineno + 1}"
    assert relative.source_path == str(here)
    outside = localize(net, lambda: net(torch.tensor([2.0])), source_root=str(tmp_path))
    assert outside.source_line is not None and outside.source_line.startswith(str(here))
    assert outside.stack[-1][0] == str(here)


def test_a_module_class_file_is_user_code_wherever_it_is_installed() -> None:
    """A module whose class lives in a library directory: its file is user code for ops that run in it."""
    from lightning_nanguard.diagnose.frames import UserCode, class_files

    net = PureAcos()
    here = str(Path(__file__).resolve())
    as_library = UserCode(skip_dirs=(str(Path(__file__).resolve().parent) + "/",))
    assert not as_library.is_user(here)
    assert as_library.is_user(here, class_files(type(net)))
    assert class_files(nn.Linear) == set()  # torch's own torch.nn classes never are


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("no_leftovers")
def test_cuda_ops_with_a_cpu_scalar_operand() -> None:
    """A CUDA op may take a CPU scalar tensor: finiteness flags of both devices are read apart."""
    net = PureAcos().cuda()
    x = torch.tensor([2.0], device="cuda")
    scale = torch.tensor(1.0)  # CPU, 0-dim
    found = localize(net, lambda: net(x) * scale)
    assert (found.phase, found.op, found.module) == ("backward", "AcosBackward0", "")
    module = LogOfRows().cuda()
    rows_x = torch.ones(8, 3, device="cuda")
    rows_x[5] = 0.0
    diagnosis = diagnose(module, rows_x, reference_batch=torch.ones(2, 3, device="cuda"))
    assert (diagnosis.cause, diagnosis.offending, diagnosis.state_passes) == ("data", [5], 1)


class LogOfRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0))

    def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
        return (self.w * x.sum(-1)).log().mean() * torch.tensor(1.0)  # a CPU scalar in a CUDA graph
