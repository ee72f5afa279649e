"""NanGuard's diagnoses of third-party code: Hugging Face models from tiny configs, Lightning's own demos.

Each test reproduces a wrong answer of issue 9 on code NanGuard does not own:

- GPT-2 with a user's masked mean (item 2): the origin is the user's division in the real batch,
  not Hugging Face's LM loss that only goes NaN on a sub-batch of empty documents;
- the demo Transformer diverging with SGD lr=50 (item 1): the model state, no sample blamed, at
  most 4 passes; its source line inside ``lightning/pytorch/demos`` (item 3);
- a NaN image in Hugging Face ResNet / ViT (item 4): the input, before any op, field ``pixel_values``;
- a poisoned BERT embedding row: an op inside Hugging Face's own module named at its line (item 5).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import fitting
import pytest
import third_party_models as tp
import torch
from forensics_models import one_thread  # noqa: F401 (fixture)
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from models import origin_line
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.diagnose.batch_diagnosis import diagnose

pytestmark = pytest.mark.usefixtures("one_thread")

TP_FILE = tp.__file__


def fit(module: Any, loader: Any, root: Path, **guard_kwargs: Any) -> NanGuard:
    guard = NanGuard(verbose=False, **guard_kwargs)
    fitting.fit(module, loader, root=root, guard=guard)
    return guard


def only_event(guard: NanGuard) -> NanEvent:
    assert len(guard.events) == 1, [e.headline() for e in guard.events]
    return guard.events[0]


# ------------------------------------------------------------------------------------ Hugging Face


def test_gpt2_origin_is_the_users_division_in_the_real_batch(tmp_path: Path) -> None:
    """Documents 10 and 13 are empty: 0/0 in the user's masked mean (batch 1, positions 2 and 5)."""
    torch.manual_seed(0)
    loader = DataLoader(tp.documents(24, 12, empty=(10, 13)), batch_size=8)
    event = only_event(fit(tp.GPT2WithMaskedMean(), loader, tmp_path))
    assert (event.global_step, event.cause) == (1, "data")
    assert (event.offending_samples, event.dataset_indices) == ((2, 5), (10, 13))
    # not NllLossBackward0 in transformers/loss/loss_utils.py: that is NaN on a sub-batch of empty documents only
    assert (event.culprit_op, event.culprit_module, event.phase) == ("DivBackward0", "", "forward")
    assert event.details["function"] == "torch.div"
    assert event.source_line is not None
    assert event.source_line.endswith(f"third_party_models.py:{origin_line('masked_mean', TP_FILE)}")
    assert event.details["source_path"] == str(Path(TP_FILE).resolve())
    assert "division by zero" in event.details["hint"]


def test_bert_origin_inside_hugging_face_code_is_named_at_its_line() -> None:
    """A token whose embedding row is huge (finite) overflows BertEmbeddings' LayerNorm for its samples only."""
    torch.manual_seed(0)
    module = tp.BertClassifier()
    with torch.no_grad():
        module.bert.embeddings.word_embeddings.weight[7] = 3e38
    ids = torch.randint(8, tp.VOCAB, (8, 10))
    ids[3, 4] = 7
    batch = {"input_ids": ids, "attention_mask": torch.ones(8, 10, dtype=torch.long), "labels": torch.zeros(8).long()}
    found = diagnose(module, batch)
    assert (found.cause, found.offending) == ("data", [3])
    loc = found.localization
    assert loc is not None
    assert (loc.phase, loc.module, loc.module_type) == ("forward", "bert.embeddings.LayerNorm", "LayerNorm")
    # torch.nn.LayerNorm is torch's own class: the line is the call in BertEmbeddings, wherever it is installed
    assert loc.source_path is not None and loc.source_path.endswith("transformers/models/bert/modeling_bert.py")
    assert loc.source_text == "embeddings = self.LayerNorm(embeddings)"
    assert loc.function == "torch.nn.functional.layer_norm"
    assert [frame[2] for frame in loc.stack][-1] == "forward" and any(f[2] == "training_step" for f in loc.stack)


@pytest.mark.parametrize("kind", ["resnet", "vit"])
def test_nan_image_is_the_input_not_a_conv_bug(kind: str, tmp_path: Path) -> None:
    """Issue 9, item 4: image 11 (batch 1, position 3) holds a NaN pixel."""
    torch.manual_seed(0)
    pixels = torch.rand(24, 3, 16, 16)
    pixels[11, 0, 5, 5] = math.nan
    loader = DataLoader(tp.DictDataset(pixel_values=pixels, labels=torch.randint(0, 3, (24,))), batch_size=8)
    event = only_event(fit(tp.ImageClassifier(kind), loader, tmp_path))
    assert (event.global_step, event.cause) == (1, "input")
    assert (event.culprit_op, event.culprit_module, event.phase) == ("<input>", None, "forward")
    assert event.details["input_fields"] == ["pixel_values"]
    assert (event.offending_samples, event.dataset_indices) == ((3,), (11,))
    assert event.details["bisect_passes"] == 1  # the 7 other images confirmed healthy in one pass
    assert "the batch itself holds NaN/Inf" in event.details["hint"]


# ------------------------------------------------------------------------------------ lightning.pytorch.demos


def test_demo_transformer_diverging_is_the_model_state(tmp_path: Path) -> None:
    """Issue 9, items 1 and 3: SGD lr=50 on random tokens; no sample blamed; the line inside the demos."""
    torch.manual_seed(0)
    vocab, length = 64, 12
    data = TensorDataset(torch.randint(0, vocab, (64, length)), torch.randint(0, vocab, (64, length)))
    module = LightningTransformer(vocab_size=vocab)
    module.prepare_data = lambda: None  # type: ignore[method-assign]  # never download WikiText2
    module.configure_optimizers = lambda: torch.optim.SGD(module.model.parameters(), lr=50)  # type: ignore[method-assign]
    guard = fit(
        module, DataLoader(data, batch_size=8), tmp_path, remedies=["quarantine"], max_consecutive_bad_steps=100
    )
    assert guard.events, "the demo Transformer did not diverge"
    for event in guard.events:
        assert event.cause == "state" and event.offending_samples is None and event.dataset_indices is None
        assert event.details["state_passes"] <= 4 and event.details["bisect_passes"] <= 4
        assert not any(r.startswith("quarantine") for r in event.remedies)
    first = guard.events[0]
    # the LightningModule lives in lightning/pytorch/demos: its file is user code there
    assert first.source_line is not None and "lightning/pytorch/demos/transformer.py:" in first.source_line
    assert first.details["source_path"].endswith("lightning/pytorch/demos/transformer.py")
    assert "test_third_party.py" not in first.source_line  # not the caller of trainer.fit
    assert "the model state diverged" in first.details["hint"]


def test_boring_model_with_a_nan_row_is_the_input(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dataset = RandomDataset(32, 24)
    dataset.data[13, 4] = math.nan
    event = only_event(fit(BoringModel(), DataLoader(dataset, batch_size=8), tmp_path))
    assert (event.cause, event.culprit_op, event.offending_samples, event.dataset_indices) == (
        "input",
        "<input>",
        (5,),
        (13,),
    )
    assert event.details["input_fields"] == ["<batch>"]  # the batch is a bare tensor
