"""Forensics through a real Trainer: exact offending samples, dataset indices, module, op, line, phase.

Each test trains a tiny model for one short epoch with ``NanGuard`` at its defaults (``bisect``,
``localize`` and ``save_repro`` on) and checks the event of every bad step field by field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import fitting
import forensics_models as fm
import lightning.pytorch as pl
import pytest
import torch
from fitting import StepRecorder
from forensics_models import EXPECTED, FUNCTIONS, one_thread  # noqa: F401 (fixture)
from models import BATCH_SIZE, KINDS, make_case, make_loader, make_module, origin_line
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_nanguard import NanEvent, NanGuard, read_events

pytestmark = pytest.mark.usefixtures("one_thread")

FM_FILE = fm.__file__

MODULE_TYPES = {
    "cosine_norm": "CosineNormLinear",
    "power_pool": "PowerPool",
    "bn_overflow": "BatchNorm1d",
    "masked_div": "MaskedRatio",
    "acos": "AngleBetween",
    "log_zero": "OneHotCrossEntropy",
    "input_data": "Linear",
}


def fit(
    module: Any,
    loader: Any,
    root: Path,
    ns: str = "lightning",
    trainer_kwargs: dict[str, Any] | None = None,
    **guard_kwargs: Any,
) -> tuple[NanGuard, Any, StepRecorder]:
    guard = NanGuard(verbose=False, **guard_kwargs)
    recorder = StepRecorder()
    trainer, _ = fitting.fit(
        module, loader, root=root, guard=guard, callbacks=[recorder], ns=ns, **(trainer_kwargs or {})
    )
    return guard, trainer, recorder


def only_event(guard: NanGuard) -> NanEvent:
    assert len(guard.events) == 1, [e.headline() for e in guard.events]
    return guard.events[0]


def assert_skipped(recorder: StepRecorder, step: int) -> None:
    assert recorder.by_step(step).unchanged(), f"step {step} was not a no-op"


def bundle_meta(event: NanEvent) -> dict[str, Any]:
    assert event.repro_path is not None
    return json.loads((Path(event.repro_path) / "module.json").read_text())


def offending_part(event: NanEvent, items: Any) -> list[Any]:
    """The saved samples (rows of ``items``) without the known-good reference sample saved next to them."""
    reference = set(bundle_meta(event)["reference_positions"])
    return [item for i, item in enumerate(items) if i not in reference]


def source_of(event: NanEvent, path_suffix: str, line: int) -> None:
    assert event.source_line is not None and event.source_line.endswith(f"{path_suffix}:{line}"), event.source_line


# ------------------------------------------------------------------------------------ failure classes


def class_cases() -> list[Any]:
    params = [pytest.param(kind, None, id=kind) for kind in KINDS if kind != "input_data"]
    params += [
        pytest.param("input_data", v, id=f"input_data-{name}")
        for v, name in ((math.nan, "nan"), (math.inf, "+inf"), (-math.inf, "-inf"))
    ]
    return params


@pytest.mark.parametrize(("kind", "value"), class_cases())
def test_failure_class(kind: str, value: float | None, tmp_path: Path) -> None:
    case = make_case(kind, value=value)
    guard, trainer, recorder = fit(make_module("lightning", kind), make_loader(case.dataset), tmp_path)
    event = only_event(guard)
    module, op, phase = EXPECTED[kind]
    assert (event.global_step, event.batch_idx, event.action) == (1, 1, "skipped")
    assert event.offending_samples == (3,)
    assert event.dataset_indices == (11,)
    assert (event.culprit_module, event.culprit_op, event.phase) == (module, op, phase)
    assert event.details["batch_size"] == BATCH_SIZE
    assert event.details["hint"]
    assert event.details.get("function") == FUNCTIONS[kind]
    assert "not_attributable" not in event.details and "diagnosis_error" not in event.details
    if kind == "input_data":  # read off the batch (field 0 of [x, y]); one pass confirms the others
        assert event.cause == "input" and event.details["input_fields"] == [0]
        assert (event.details["bisect_passes"], event.details["state_passes"]) == (1, 0)
        assert event.details["input_nonfinite"] is True
        assert "the batch itself holds NaN/Inf" in event.details["hint"]
        assert event.source_line is None and "module_type" not in event.details
    else:
        assert event.cause == "data" and "input_fields" not in event.details
        # the reference sub-batch the guard kept at step 0 runs healthy (1 pass), then the search (6)
        assert (event.details["bisect_passes"], event.details["state_passes"]) == (7, 1)
        source_of(event, "models.py", origin_line(case.origin))
        assert event.details["source_text"].endswith(f"# ORIGIN: {case.origin}")
        assert event.details["module_type"] == MODULE_TYPES[kind]
        assert event.details["stack"][-1]["line"] == origin_line(case.origin)
    if kind == "bn_overflow":
        assert event.details["bn_channels"] == {"net.input_bn": [2]}
    assert_skipped(recorder, 1)
    assert guard.active and trainer.global_step == 4

    # the same diagnosis in events.jsonl and a bundle next to it
    saved = read_events(Path(guard.log_dir) / "nanguard" / "events.jsonl")
    assert [(e.offending_samples, e.culprit_op, e.source_line) for e in saved] == [
        (event.offending_samples, event.culprit_op, event.source_line)
    ]
    assert event.repro_path == str(Path(guard.log_dir) / "nanguard" / "step-1")


def test_pytorch_lightning_namespace(tmp_path: Path) -> None:
    case = make_case("acos", bad=(20,))
    guard, _, recorder = fit(
        make_module("pytorch_lightning", "acos"), make_loader(case.dataset), tmp_path, "pytorch_lightning"
    )
    event = only_event(guard)
    assert (event.global_step, event.offending_samples, event.dataset_indices) == (2, (4,), (20,))
    assert (event.culprit_module, event.culprit_op) == ("net.angle", "AcosBackward0")
    source_of(event, "models.py", origin_line("acos"))
    assert_skipped(recorder, 2)


# ------------------------------------------------------------------------------------ where the samples sit


@pytest.mark.parametrize(
    ("bad", "offending"),
    [
        pytest.param((8,), (0,), id="first"),
        pytest.param((15,), (7,), id="last"),
        pytest.param((9, 14), (1, 6), id="two"),
        pytest.param((8, 15), (0, 7), id="first-and-last"),
        pytest.param((8, 9, 10), (0, 1, 2), id="three-in-a-row"),
        pytest.param((8, 12, 15), (0, 4, 7), id="three-spread-out"),
    ],
)
def test_offending_positions(bad: tuple[int, ...], offending: tuple[int, ...], tmp_path: Path) -> None:
    case = make_case("cosine_norm", bad=bad)
    guard, _, recorder = fit(make_module("lightning", "cosine_norm"), make_loader(case.dataset), tmp_path)
    event = only_event(guard)
    assert event.offending_samples == offending
    assert event.dataset_indices == bad
    assert (event.culprit_module, event.culprit_op) == ("net.norm", "SqrtBackward0")
    assert event.cause == "data"  # a few bad samples are never taken for the model state
    # the state check (<= 4 passes) comes on top of the search's 2*k*log2(n) + 2
    assert event.details["bisect_passes"] <= 2 * len(bad) * math.log2(BATCH_SIZE) + 2 + 3
    assert_skipped(recorder, 1)
    saved = torch.load(Path(event.repro_path) / "batch.pt", weights_only=True)
    # the bundle holds the offending samples (and at most one healthy reference sample next to them)
    assert saved[0].shape[0] - len(bundle_meta(event)["reference_positions"]) == len(bad)
    assert all(not row.any() for row in offending_part(event, saved[0]))  # the blank samples


def test_every_sample_holding_nan_is_an_input_fault(tmp_path: Path) -> None:
    """Every sample of the batch holds NaN: all of them are named, read off the batch without a pass."""
    case = make_case("input_data", bad=tuple(range(8, 16)))
    guard, _, recorder = fit(make_module("lightning", "input_data"), make_loader(case.dataset), tmp_path)
    event = only_event(guard)
    assert event.cause == "input" and event.details["input_fields"] == [0]
    assert event.offending_samples == tuple(range(8))
    assert event.dataset_indices == tuple(range(8, 16))
    assert (event.culprit_module, event.culprit_op, event.phase) == (None, "<input>", "forward")
    assert event.details["bisect_passes"] == 0
    assert_skipped(recorder, 1)


def test_batch_of_one(tmp_path: Path) -> None:
    case = make_case("masked_div", n=6, bad=(4,))
    guard, trainer, recorder = fit(
        make_module("lightning", "masked_div"), make_loader(case.dataset, batch_size=1), tmp_path
    )
    event = only_event(guard)
    assert (event.global_step, event.offending_samples, event.dataset_indices) == (4, (0,), (4,))
    assert event.details["bisect_passes"] == 1 and event.details["batch_size"] == 1
    assert (event.culprit_module, event.culprit_op) == ("net.ratio", "DivBackward0")
    source_of(event, "models.py", origin_line("masked_div"))
    assert_skipped(recorder, 4)
    assert trainer.global_step == 6


def test_batch_interaction_is_not_attributed(tmp_path: Path) -> None:
    healthy = torch.arange(1.0, 9.0)
    values = torch.cat([healthy, torch.tensor(fm.interaction_values(8))])  # batch 1 sums to exactly 0
    loader = DataLoader(TensorDataset(values), batch_size=8)
    guard, _, recorder = fit(fm.InteractionModule(), loader, tmp_path)
    event = only_event(guard)
    assert event.global_step == 1
    assert event.offending_samples is None and event.dataset_indices is None
    assert event.details["not_attributable"] == (
        "no single sample is non-finite on its own: the samples only fail together (batch interaction)"
    )
    assert (event.culprit_module, event.culprit_op, event.phase) == ("", "SqrtBackward0", "backward")
    source_of(event, "forensics_models.py", origin_line("interaction", FM_FILE))
    assert_skipped(recorder, 1)
    meta = json.loads((Path(event.repro_path) / "module.json").read_text())
    assert meta["positions"] is None and meta["sample_dataset_indices"] == list(range(8, 16))
    assert torch.equal(torch.load(Path(event.repro_path) / "batch.pt", weights_only=True)[0], values[8:])


# ------------------------------------------------------------------------------------ batch structures


@pytest.mark.parametrize("style", ["dict", "userdict", "namedtuple", "dataclass"])
def test_structured_batches(style: str, tmp_path: Path) -> None:
    dataset = fm.StructuredDataset(32, bad=(11,))
    module = fm.DictBatchModule()
    loader = DataLoader(dataset, batch_size=8, collate_fn=fm.collate(style))
    guard, _, recorder = fit(module, loader, tmp_path)
    event = only_event(guard)
    assert (event.offending_samples, event.dataset_indices) == ((3,), (11,))
    assert (event.culprit_module, event.culprit_op) == ("net.norm", "SqrtBackward0")
    source_of(event, "models.py", origin_line("cosine_norm"))
    assert sorted(set(module.seen_sizes)) == [1, 2, 4, 8]  # sub-batches were run (names sliced along)
    assert_skipped(recorder, 1)
    saved = torch.load(Path(event.repro_path) / "batch.pt", weights_only=False)
    names = saved["names"] if style in ("dict", "userdict") else saved.names
    assert offending_part(event, names) == ["item-11"]


def test_index_field_instead_of_the_sampler(tmp_path: Path) -> None:
    class Stream(IterableDataset):
        """No batch sampler to record: the dataset indices travel in the batch (``"index"``)."""

        def __iter__(self) -> Any:
            data = fm.StructuredDataset(24, bad=(13,))
            return (data[i] for i in range(len(data)))

    loader = DataLoader(Stream(), batch_size=8, collate_fn=fm.collate("dict"))
    guard, _, _ = fit(fm.DictBatchModule(), loader, tmp_path, index_key="index")
    event = only_event(guard)
    assert (event.offending_samples, event.dataset_indices) == ((5,), (13,))

    # without index_key an IterableDataset still trains (indices unknown)
    guard, trainer, recorder = fit(fm.DictBatchModule(), loader, tmp_path / "no-key")
    event = only_event(guard)
    assert (event.offending_samples, event.dataset_indices) == ((5,), None)
    assert_skipped(recorder, 1)
    assert trainer.global_step == 3


class SequenceFirstSlicer:
    """``x`` is ``(features, batch)``: slice its second dimension; tell the batch size."""

    def batch_size(self, batch: dict[str, Any]) -> int:
        return len(batch["names"])

    def __call__(self, batch: dict[str, Any], positions: list[int]) -> dict[str, Any]:
        index = torch.tensor(positions)
        return {
            "x": batch["x"][:, index],
            "y": batch["y"][index],
            "names": [batch["names"][p] for p in positions],
        }


def test_user_batch_slicer(tmp_path: Path) -> None:
    dataset = fm.StructuredDataset(16, bad=(6,))
    loader = DataLoader(dataset, batch_size=4, collate_fn=fm.collate("seq_first"))  # x: (8, 4)
    guard, _, recorder = fit(fm.DictBatchModule(), loader, tmp_path, batch_slicer=SequenceFirstSlicer())
    event = only_event(guard)
    assert (event.global_step, event.offending_samples, event.dataset_indices) == (1, (2,), (6,))
    assert event.culprit_op == "SqrtBackward0"
    saved = torch.load(Path(event.repro_path) / "batch.pt", weights_only=False)
    assert saved["x"].shape == (8, len(saved["names"])) and offending_part(event, saved["names"]) == ["item-6"]
    assert_skipped(recorder, 1)


def test_module_slicing_hooks(tmp_path: Path) -> None:
    class WithHooks(fm.DictBatchModule):
        def nanguard_slice_batch(self, batch: dict[str, Any], positions: list[int]) -> dict[str, Any]:
            return SequenceFirstSlicer()(batch, positions)

        def nanguard_batch_size(self, batch: dict[str, Any]) -> int:
            return len(batch["names"])

    loader = DataLoader(fm.StructuredDataset(16, bad=(6,)), batch_size=4, collate_fn=fm.collate("seq_first"))
    guard, _, _ = fit(WithHooks(), loader, tmp_path)
    assert only_event(guard).offending_samples == (2,)


# ------------------------------------------------------------------------------------ module names


def test_module_inside_a_module_inside_a_module_list(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    gate = torch.ones(24)
    gate[[13, 14]] = 0.0
    loader = DataLoader(TensorDataset(x, gate, y), batch_size=8)
    guard, _, recorder = fit(fm.NestedModule(), loader, tmp_path)
    event = only_event(guard)
    assert (event.offending_samples, event.dataset_indices) == ((5, 6), (13, 14))
    assert (event.culprit_module, event.culprit_op, event.phase) == ("blocks.1.inner.norm", "SqrtBackward0", "backward")
    assert event.details["module_type"] == "ZeroSensitiveNorm"
    source_of(event, "forensics_models.py", origin_line("nested_norm", FM_FILE))
    assert_skipped(recorder, 1)


def test_origin_inside_training_step(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.rand(16, generator=g)
    x[10] = 0.0
    guard, _, recorder = fit(fm.StepOriginModule(), DataLoader(TensorDataset(x, y), batch_size=8), tmp_path)
    event = only_event(guard)
    assert (event.offending_samples, event.dataset_indices) == ((2,), (10,))
    assert (event.culprit_module, event.culprit_op, event.phase) == ("", "SqrtBackward0", "backward")
    assert event.details["module_type"] == "StepOriginModule"
    source_of(event, "forensics_models.py", origin_line("step_sqrt", FM_FILE))
    assert_skipped(recorder, 1)


class _CosineNorm(torch.nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.pow(2).sum(1, keepdim=True).sqrt()  # ORIGIN: compiled_div


def test_a_compiled_model_is_diagnosed_eagerly(tmp_path: Path) -> None:
    """``torch.compile``d layers: the diagnosis runs them eagerly, so the op at fault is named.

    Compiled, every sub-batch size would recompile, dynamo would trace the guard's hooks, and the
    op would read ``CompiledFunctionBackward``. ``aot_eager``: compiled graphs without a C compiler.
    """
    import lightning.pytorch as pl

    class Compiled(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = torch.nn.Sequential(torch.nn.Linear(4, 16, bias=False), _CosineNorm(), torch.nn.Linear(16, 1))
            self.net = torch.compile(layers, backend="aot_eager")

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    x[11] = 0.0  # a blank sample: 0 / 0
    guard, trainer, recorder = fit(Compiled(), DataLoader(TensorDataset(x, y), batch_size=8), tmp_path)
    event = only_event(guard)
    assert (event.dataset_indices, event.cause, event.action) == ((11,), "data", "skipped")
    assert (event.culprit_module, event.culprit_op, event.phase) == ("net._orig_mod.1", "DivBackward0", "forward")
    assert event.details.get("function") == "torch.div" and "division by zero" in event.details["hint"]
    source_of(event, "test_diagnosis.py", origin_line("compiled_div", Path(__file__)))
    assert_skipped(recorder, 1)
    assert trainer.global_step == 4
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ dataset indices


class BatchKeeper(StepRecorder):
    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[tuple[int, int], Tensor] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.batches[(trainer.current_epoch, batch_idx)] = batch[0].clone()


def test_shuffled_loader_with_two_workers(tmp_path: Path) -> None:
    bad = (5, 22, 23)
    case = make_case("cosine_norm", bad=bad)
    loader = DataLoader(
        case.dataset, batch_size=8, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7)
    )
    keeper = BatchKeeper()
    guard = NanGuard(verbose=False)
    module = make_module("lightning", "cosine_norm")
    fitting.fit(module, loader, root=tmp_path, guard=guard, callbacks=[keeper], max_epochs=2)

    x_all = case.dataset.tensors[0]
    blank = {i for i in range(len(x_all)) if not x_all[i].any()}
    assert blank == set(bad)
    assert guard.events
    found: list[int] = []
    for event in guard.events:
        batch = keeper.batches[(event.epoch, event.batch_idx)]
        # the positions are exactly the blank rows of the batch the Trainer saw ...
        assert event.offending_samples == tuple(p for p in range(len(batch)) if not batch[p].any())
        # ... and the dataset indices are exactly the rows of the dataset they came from
        assert event.dataset_indices is not None
        for position, index in zip(event.offending_samples, event.dataset_indices, strict=True):
            assert torch.equal(x_all[index], batch[position])
        assert set(event.dataset_indices) <= blank
        found.extend(event.dataset_indices)
    assert sorted(found) == sorted(bad * 2)  # every bad sample, once per epoch
    for event in guard.events:
        assert keeper.by_step(event.global_step).unchanged()


# ------------------------------------------------------------------------------------ limits and bundles


def test_max_bisect_passes_cap(tmp_path: Path) -> None:
    case = make_case("cosine_norm")
    guard, _, recorder = fit(
        make_module("lightning", "cosine_norm"), make_loader(case.dataset), tmp_path, max_bisect_passes=2
    )
    event = only_event(guard)
    assert event.details["bisect_passes"] == 2
    assert event.offending_samples is None
    assert event.details["not_attributable"] == "max_bisect_passes=2 reached before a single sample was isolated"
    assert (event.culprit_module, event.culprit_op) == ("net.norm", "SqrtBackward0")  # localised on [0..3]
    assert_skipped(recorder, 1)
    assert torch.load(Path(event.repro_path) / "batch.pt", weights_only=True)[0].shape[0] == 8


class KeptLog(pl.LightningModule):
    """Rows ``(value, kept)``: the mean of ``log(value)`` over the kept rows.

    A negative value is NaN beside any rows (a record at fault); a row that keeps nothing is 0/0 alone
    but fine beside kept rows (it fails only without healthy company: not at fault).
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (rows,) = batch
        values, kept = rows[:, 0], rows[:, 1]
        return (self.w * values.log() * kept).sum() / kept.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


# batch 0 healthy (the reference samples); batch 1: records 3 and 4 corrupt, record 5 keeps no target, so no
# sample of batch 1 runs finite and each named sample is checked beside the reference, one pass each
KEPT_ROWS = torch.tensor([[2.0, 1.0], [3.0, 1.0], [4.0, 1.0], [-1.0, 1.0], [-2.0, 1.0], [1.0, 0.0], [5.0, 1.0]])


def _kept_log_event(root: Path, **guard_kwargs: Any) -> NanEvent:
    guard, _, recorder = fit(
        KeptLog(), DataLoader(TensorDataset(KEPT_ROWS), batch_size=3), root, remedies=["quarantine"], **guard_kwargs
    )
    event = only_event(guard)
    assert event.global_step == 1
    assert_skipped(recorder, 1)
    return event


@pytest.mark.parametrize("left", [1, 2, 3])
def test_a_blame_check_cut_short_by_max_bisect_passes_quarantines_nothing(tmp_path: Path, left: int) -> None:
    """The pass budget runs out part-way through the named samples: those left unchecked are not verified.

    Record 5 is not at fault (it fails only alone); left unchecked, it must not be called verified nor quarantined.
    """
    full = _kept_log_event(tmp_path / "full")
    assert (full.offending_samples, full.dataset_indices, full.blame_verified) == ((0, 1), (3, 4), True)
    assert full.details["verify_passes"] == 4  # the three together beside the reference, then each on its own
    event = _kept_log_event(tmp_path / "cut", max_bisect_passes=full.details["bisect_passes"] + left)
    assert event.details["verify_passes"] == left
    assert (event.offending_samples, event.dataset_indices) == ((0, 1, 2), (3, 4, 5))
    assert event.blame_verified is False and "max_bisect_passes" in event.details["blame_unverified"]
    assert not any(remedy.startswith("quarantine") for remedy in event.remedies), event.remedies


def test_bundle_contents_and_pruning(tmp_path: Path) -> None:
    case = make_case("log_zero", bad=(3, 11, 19, 28))  # every step is bad
    module = make_module("lightning", "log_zero")
    guard, _, recorder = fit(module, make_loader(case.dataset), tmp_path, max_repro_bundles=2)
    assert [e.global_step for e in guard.events] == [0, 1, 2, 3]
    root = Path(guard.log_dir) / "nanguard"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-2", "step-3"]
    event = guard.events[-1]
    assert event.offending_samples == (4,) and event.dataset_indices == (28,)
    bundle = Path(event.repro_path)
    assert bundle == root / "step-3"
    meta = json.loads((bundle / "module.json").read_text())
    assert meta["class_path"] == "models:LightningFailureModule"
    assert offending_part(event, meta["positions"]) == [4] and meta["batch_idx"] == 3
    assert offending_part(event, meta["sample_dataset_indices"]) == [28]
    assert meta["reference_positions"] in ([], [0])
    saved_event = NanEvent.from_dict(json.loads((bundle / "event.json").read_text()))
    assert (saved_event.offending_samples, saved_event.culprit_op, saved_event.source_line) == (
        event.offending_samples,
        event.culprit_op,
        event.source_line,
    )
    x, y = torch.load(bundle / "batch.pt", weights_only=True)
    assert torch.equal(x, case.dataset.tensors[0][meta["sample_dataset_indices"]])
    assert torch.equal(y, case.dataset.tensors[1][meta["sample_dataset_indices"]])
    state = torch.load(bundle / "module_state.pt", weights_only=True)
    before = recorder.by_step(3).params_before
    assert all(torch.equal(state[name], before[name]) for name in before)


def test_no_bundles_when_disabled(tmp_path: Path) -> None:
    case = make_case("acos")
    for kwargs in ({"max_repro_bundles": 0}, {"save_repro": False}):
        guard, _, _ = fit(make_module("lightning", "acos"), make_loader(case.dataset), tmp_path / str(kwargs), **kwargs)
        event = only_event(guard)
        assert event.repro_path is None and event.culprit_op == "AcosBackward0"
        assert not [p for p in (Path(guard.log_dir) / "nanguard").glob("step-*")]


def test_batchnorm_bundle_keeps_a_reference_sample(tmp_path: Path) -> None:
    case = make_case("bn_overflow")
    guard, _, _ = fit(make_module("lightning", "bn_overflow"), make_loader(case.dataset), tmp_path)
    event = only_event(guard)
    meta = json.loads((Path(event.repro_path) / "module.json").read_text())
    assert meta["reference_positions"] == [0]
    assert len(meta["positions"]) == 2 and meta["positions"][1] == 3
    reference = meta["positions"][0]
    assert meta["sample_dataset_indices"] == [8 + reference, 11]
    x, _ = torch.load(Path(event.repro_path) / "batch.pt", weights_only=True)
    assert torch.equal(x, case.dataset.tensors[0][[8 + reference, 11]])


def test_gradient_accumulation_names_the_micro_batch(tmp_path: Path) -> None:
    case = make_case("cosine_norm", bad=(17,))  # batch 2 = first micro-batch of step 1
    guard, _, _recorder = fit(
        make_module("lightning", "cosine_norm"),
        make_loader(case.dataset),
        tmp_path,
        trainer_kwargs={"accumulate_grad_batches": 2},
    )
    event = only_event(guard)
    assert (event.global_step, event.batch_idx, event.details["micro_batch"]) == (1, 2, 0)
    assert (event.offending_samples, event.dataset_indices) == ((1,), (17,))


# ------------------------------------------------------------------------------------ failures of the diagnosis


class PickyModule(fm.DictBatchModule):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if len(batch["names"]) != 8:
            raise ValueError("this training_step only accepts full batches")
        return super().training_step(batch, batch_idx)


def failing_slicer(batch: Any, positions: list[int]) -> Any:
    raise RuntimeError("slicer exploded")


@pytest.mark.parametrize(
    ("module", "collate", "kwargs", "error"),
    [
        pytest.param(PickyModule, "dict", {}, "only accepts full batches", id="training-step-raises"),
        pytest.param(
            fm.DictBatchModule, "dict", {"batch_slicer": failing_slicer}, "slicer exploded", id="slicer-raises"
        ),
        pytest.param(fm.DictBatchModule, "seq_first", {}, "batch_slicer", id="unsliceable"),
    ],
)
def test_a_failing_diagnosis_still_skips_the_step(
    module: type, collate: str, kwargs: dict[str, Any], error: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    batch_size = 4 if collate == "seq_first" else 8
    loader = DataLoader(fm.StructuredDataset(24, bad=(11,)), batch_size=batch_size, collate_fn=fm.collate(collate))
    guard, trainer, recorder = fit(module(), loader, tmp_path, **kwargs)
    event = only_event(guard)
    assert event.offending_samples is None
    assert error in event.details["diagnosis_error"]
    assert event.action == "skipped"
    assert_skipped(recorder, event.global_step)
    assert guard.active and trainer.global_step == 24 // batch_size
    assert any("diagnosis failed" in r.message for r in caplog.records)


def test_nonfinite_weights_are_not_blamed_on_samples(tmp_path: Path) -> None:
    """Step 1 is not checked, so its NaN update reaches the weights; step 2 fails for every sample."""
    case = make_case("cosine_norm")
    loader = make_loader(case.dataset)
    guard, _, recorder = fit(make_module("lightning", "cosine_norm"), loader, tmp_path, check_every_n_steps=2)
    event = only_event(guard)
    assert event.global_step == 2 and event.offending_samples is None and event.dataset_indices is None
    assert event.details["not_attributable"] == (
        "the weights are already non-finite (net.feature.weight): every sample fails, whatever the data"
    )
    assert event.details["bisect_passes"] == 0
    assert (event.culprit_module, event.culprit_op, event.phase) == ("net.feature", "MmBackward0", "forward")
    assert event.details["source_text"] == "return 10.0 * self.norm(self.feature(x))"
    assert "weights are already non-finite" in event.details["hint"]
    assert_skipped(recorder, 2)


def test_empty_batch_is_not_attributed(tmp_path: Path) -> None:
    """A collate that filters samples can produce an empty batch: its mean loss is NaN, nobody to blame."""
    case = make_case("cosine_norm", n=24, bad=())

    def drop_batch_one(items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        x, y = torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])
        if torch.equal(x, case.dataset.tensors[0][8:16]):
            return x[:0], y[:0]
        return x, y

    loader = DataLoader(case.dataset, batch_size=8, collate_fn=drop_batch_one)
    guard, trainer, recorder = fit(make_module("lightning", "cosine_norm"), loader, tmp_path)
    event = only_event(guard)
    assert event.global_step == 1 and "loss" in event.kinds
    assert event.offending_samples is None and event.details["not_attributable"] == "the batch is empty"
    assert event.details["bisect_passes"] == 0 and event.details["batch_size"] == 0
    assert event.culprit_op is None
    assert_skipped(recorder, 1)
    assert guard.active and trainer.global_step == 3


def test_report_and_tensorboard_text_show_the_diagnosis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tb_reader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.setenv("COLUMNS", "400")  # one panel row per line

    case = make_case("cosine_norm", bad=(13,))
    guard = NanGuard()  # verbose
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    fitting.fit(
        make_module("lightning", "cosine_norm"), make_loader(case.dataset), root=tmp_path, guard=guard, logger=logger
    )
    err = " ".join(capsys.readouterr().err.split())
    line = origin_line("cosine_norm")
    for expected in (
        "offending samples [5] of 8 (dataset indices [13])",
        "cause data: the offending samples reproduce it on their own",
        "backward: SqrtBackward0 (gradient of torch.sqrt) in module net.norm (CosineNormLinear)",
        f"models.py:{line} xnorm = (x * x).sum(-1, keepdim=True).sqrt()",
        "add eps inside the root",
        "python -m lightning_nanguard replay",
    ):
        assert expected in err, expected
    texts = tb_reader(tmp_path / "tb" / "version_0").texts("nanguard/events/text_summary")
    assert len(texts) == 1 and texts[0][0] == 1
    text = texts[0][1]
    assert "[5] of 8 (dataset indices [13])" in text and "`SqrtBackward0`" in text and "`net.norm`" in text
    assert "gradient of `torch.sqrt`" in text and "| cause | data:" in text
    assert f"models.py:{line}" in text and "add eps inside the root" in text
