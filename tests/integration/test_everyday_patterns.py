"""Right blame on everyday patterns (issue 18, items 2-4), on a real Trainer.

Each test fits a tiny model on a shuffled loader whose sampler logs its order
(``multitask_models.OrderLog``), and checks the event against a ground truth computed without the
guard: the dataset items that fail on their own with plain PyTorch (``pattern_models.bad_items``),
where each sat in the batches the sampler gave, the module where a fresh model's forward hooks see
the value born (``first_module_birth``) or the node its autograd hooks see turn finite gradients
non-finite (``first_backward_birth``), and the ``# ORIGIN:`` line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fitting
import lightning.pytorch as pl
import multitask_models as mm
import pattern_models as pm
import pipeline_models as pp
import pytest
import third_party_models as tp
import torch
from fitting import build_trainer
from forensics_models import one_thread  # noqa: F401 (fixture)
from models import origin_line
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.diagnose.localization import localize

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 8


def fit(module: pl.LightningModule, dataset: TensorDataset, root: Path, **guard_kwargs: Any) -> tuple[NanGuard, Any]:
    """One epoch over a shuffled loader of ``dataset``; returns the guard and the loader (its sampler's log)."""
    guard = NanGuard(verbose=False, **guard_kwargs)
    loader = mm.loader(dataset, BATCH, seed=7)
    fitting.fit(module, loader, root=root, guard=guard, require_active=True)
    return guard, loader


def where(loader: DataLoader, items: list[int]) -> set[tuple[int, int, int]]:
    """``(step, position, dataset index)`` of ``items`` in the order the loader's sampler logged."""
    (order,) = loader.sampler.passes  # type: ignore[attr-defined]
    return {(i // BATCH, i % BATCH, index) for i, index in enumerate(order) if index in items}


def named(events: list[NanEvent]) -> set[tuple[int, int, int]]:
    out = set()
    for event in events:
        assert event.offending_samples is not None and event.dataset_indices is not None, event.headline()
        out.update((event.batch_idx, p, i) for p, i in zip(event.offending_samples, event.dataset_indices, strict=True))
    return out


def line(name: str, path: str = pm.__file__) -> str:
    return f"{Path(path).name}:{origin_line(name, path)}"


def assert_right(
    events: list[NanEvent], loader: DataLoader, bad: list[int], phase: str, op: str, module: str, origin: str
) -> None:
    assert named(events) == where(loader, bad)
    for event in events:
        assert (event.cause, event.phase, event.culprit_op, event.culprit_module) == ("data", phase, op, module)
        assert event.source_line is not None and event.source_line.endswith(line(origin))


# ------------------------------------------------------------------------------------ masked softmax


@pytest.mark.parametrize("kind", pm.NAN_KINDS)
def test_softmax_over_an_empty_sequence_is_blamed_in_the_forward(kind: str, tmp_path: Path) -> None:
    """Issue 18, item 2: before, the loss (``LogSoftmaxBackward0`` in ``cross_entropy``, backward, "log(0)")."""
    torch.manual_seed(0)
    data = pm.padded_tokens(32, empty=(11, 26))
    bad = pm.bad_items(lambda: pm.AttentionClassifier(kind), data)
    assert bad == [11, 26]
    fresh = pm.AttentionClassifier(kind)
    module = pm.first_module_birth(fresh, lambda: fresh.training_step(data.tensors, 0)) or ""
    assert module == ("attn" if kind == "mha" else "")
    guard, loader = fit(pm.AttentionClassifier(kind), data, tmp_path)
    assert_right(guard.events, loader, bad, "forward", "SoftmaxBackward0", module, kind)
    for event in guard.events:
        assert "masked entirely" in event.details["hint"]
        assert event.details["function"] == (
            "torch.nn.functional.multi_head_attention_forward" if kind == "mha" else "torch.softmax"
        )


@pytest.mark.parametrize("kind", ["mha_no_weights", "sdpa", "encoder_layer"])
def test_attention_that_gives_zeros_for_an_empty_sequence_is_never_blamed(kind: str, tmp_path: Path) -> None:
    """Torch gives no NaN here: only item 6 (``scale == 0``: ``sqrt(0)``) is at fault, never the empty item 11."""
    torch.manual_seed(0)
    data = pm.padded_tokens(32, empty=(11,), poisoned=(6,))
    assert pm.bad_items(lambda: pm.AttentionClassifier(kind), data) == [6]
    guard, loader = fit(pm.AttentionClassifier(kind), data, tmp_path)
    assert_right(guard.events, loader, [6], "backward", "SqrtBackward0", "", "scaled_root")


class BertModule(pl.LightningModule):
    """Hugging Face BERT (tiny config, no download) on documents, one of them without any token."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tp.BertClassifier()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask, labels = batch
        return self.net.training_step({"input_ids": ids, "attention_mask": mask, "labels": labels}, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_hugging_face_bert_with_an_empty_document_is_silent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    docs = tp.documents(16, 8, empty=(5,))
    data = TensorDataset(docs.tensors["input_ids"], docs.tensors["attention_mask"], torch.randint(0, 2, (16,)))
    assert pm.bad_items(BertModule, data) == []  # finfo.min masks: zeros, no NaN
    guard, _ = fit(BertModule(), data, tmp_path)
    assert guard.events == []
    module = BertModule()
    batch = data.tensors
    assert localize(module, lambda: module.training_step(batch, 0), batch=batch).phase is None


# ------------------------------------------------------------------------------------ NaN made of infinities


@pytest.mark.parametrize(
    ("make", "data", "op", "origin"),
    [
        (pm.LogSumExpPool, pm.padded_tokens(32, empty=(9,)), "SubBackward0", "inf_minus_inf"),
        (pm.PaddedDistance, pm.padded_tokens(32, padded=(20,)), "MulBackward0", "zero_times_inf"),
    ],
    ids=["inf-inf", "0*inf"],
)
def test_nan_made_of_deliberate_infinities_is_born_where_they_meet(
    make: Callable[[], pl.LightningModule], data: TensorDataset, op: str, origin: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    bad = pm.bad_items(make, data)
    assert len(bad) == 1
    guard, loader = fit(make(), data, tmp_path)
    assert_right(guard.events, loader, bad, "forward", op, "", origin)
    assert guard.events[0].details["hint"].startswith("NaN made of infinities")


# ------------------------------------------------------------------------------------ custom autograd Functions


@pytest.mark.parametrize(
    ("kind", "phase", "node", "origin"),
    [
        ("backward", "backward", "SafeSqrtBackward", "custom_backward"),
        ("forward", "forward", "ClippedLogBackward", "custom_forward"),
        ("thirdparty", "backward", "RootMeanSquareBackward", "thirdparty_function"),
    ],
)
def test_custom_function_is_named_at_its_apply_line(
    kind: str, phase: str, node: str, origin: str, tmp_path: Path
) -> None:
    """Issue 18, item 3: before, the source line and function of the op after it (``torch.cat``)."""
    torch.manual_seed(0)
    data = pm.blank_rows(32, blank=(4, 29))
    bad = pm.bad_items(lambda: pm.CustomFunctionModule(kind), data)
    assert bad == [4, 29]
    fresh = pm.CustomFunctionModule(kind)
    loss = fresh.training_step(data.tensors, 0)
    if phase == "backward":
        assert pm.first_backward_birth(loss) == node
    else:  # the Function's finite input, its non-finite output: born inside the Function
        energy = fresh.proj(data.tensors[0]).pow(2).sum(-1)
        assert torch.isfinite(energy).all() and not torch.isfinite(pm.ClippedLog.apply(energy)).all()
        assert not math.isfinite(loss.item())
    guard, loader = fit(pm.CustomFunctionModule(kind), data, tmp_path)
    assert_right(guard.events, loader, bad, phase, node, "", origin)
    for event in guard.events:
        assert event.details["function"].endswith(f"{node.removesuffix('Backward')}.apply")
        assert "custom autograd Function" in event.details["hint"]


# ------------------------------------------------------------------------------------ the sweep


def test_reentrant_activation_checkpointing_is_diagnosed(tmp_path: Path) -> None:
    """Before: no diagnosis at all (``torch.autograd.grad`` is refused by reentrant checkpointing)."""
    torch.manual_seed(0)
    data = pm.blank_rows(32, blank=(17,))
    assert pm.bad_items(lambda: pm.CheckpointedBlocks(reentrant=True), data) == [17]
    guard, loader = fit(pm.CheckpointedBlocks(reentrant=True), data, tmp_path)
    assert_right(guard.events, loader, [17], "backward", "CheckpointFunctionBackward", "", "checkpoint_call")
    assert "diagnosis_error" not in guard.events[0].details
    assert "use_reentrant=False" in guard.events[0].details["hint"]


def test_non_reentrant_activation_checkpointing_names_the_op_inside(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = pm.blank_rows(32, blank=(17,))
    fresh = pm.CheckpointedBlocks(reentrant=False)
    assert pm.first_backward_birth(fresh.training_step(data.tensors, 0)) == "SqrtBackward0"
    guard, loader = fit(pm.CheckpointedBlocks(reentrant=False), data, tmp_path)
    assert_right(guard.events, loader, [17], "backward", "SqrtBackward0", "block", "checkpointed_sqrt")


def test_ctc_with_a_target_that_cannot_be_aligned(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = pm.ctc_data(32, unalignable=(12,))
    assert pm.bad_items(pm.CTCModule, data) == [12]
    guard, loader = fit(pm.CTCModule(), data, tmp_path)
    assert_right(guard.events, loader, [12], "forward", "CtcLossBackward0", "", "ctc")
    assert "zero_infinity=True" in guard.events[0].details["hint"]


def test_distillation_with_masked_classes_is_a_nan_of_infinities(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = pm.distill_data(32, constrained=(3,))
    assert pm.bad_items(pm.DistillModule, data) == [3]
    guard, loader = fit(pm.DistillModule(), data, tmp_path)
    assert_right(guard.events, loader, [3], "forward", "DivBackward0", "", "kl_div")
    assert guard.events[0].details["function"] == "torch.nn.functional.kl_div"
    assert guard.events[0].details["hint"].startswith("NaN made of infinities")  # not "division by zero"


def test_sqrt_masked_after_the_fact_gets_the_domain_hint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = pm.blank_rows(32, blank=()).tensors
    x = x.abs()
    x[22] = -x[22]
    data = TensorDataset(x, y)
    assert pm.bad_items(pm.WhereSqrtModule, data) == [22]
    guard, loader = fit(pm.WhereSqrtModule(), data, tmp_path)
    assert_right(guard.events, loader, [22], "backward", "SqrtBackward0", "", "where_sqrt")
    assert guard.events[0].details["hint"].startswith("op applied outside its domain")  # not "sqrt at exactly 0"


def test_a_last_batch_of_one_sample_is_not_blamed_on_the_sample(tmp_path: Path) -> None:
    """With n=1 no sub-batch tells the sample from the batch size: beside the healthy reference samples it is fine."""
    data = pm.blank_rows(33, blank=())  # 4 batches of 8, then one of 1
    guard = NanGuard(verbose=False)
    build_trainer("lightning", tmp_path, callbacks=[guard]).fit(pp.BatchStd(), DataLoader(data, batch_size=BATCH))
    (event,) = guard.events
    assert event.cause != "data" and event.offending_samples is None
    assert event.cause == "batch" and event.dataset_indices is None and event.blame_verified is None
    assert event.details["verify_passes"] == 1  # the sample beside the 2 reference samples of a healthy step
    assert event.details["hint"].startswith("the batch as a whole is degenerate")
