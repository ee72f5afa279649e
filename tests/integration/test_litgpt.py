"""LitGPT's own recipes, run by its own CLI with ``NANGUARD=1`` and no code change (issue 24).

Each recipe runs in a subprocess, exactly as a user types it (``litgpt finetune_full ...``), on a
tiny local model, tokenizer and data (``examples/litgpt_nanguard.py``: no downloads). The model's
vocabulary has a new word whose embedding row is zero and its RMSNorm has ``norm_eps=0`` (fine-tuning:
the record holding the word has a NaN loss) or ``1e-30`` (pre-training: a finite loss and a NaN
gradient). Record / chunk 5 holds it. Without the guard the fine-tuned checkpoint is entirely NaN and
pre-training dies in ``clip_gradients``; with it the step is skipped and the record named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litgpt")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import litgpt_nanguard  # noqa: E402  # examples/litgpt_nanguard.py: the tiny model, data and CLI arguments

BAD = litgpt_nanguard.BAD  # the record (fine-tuning) and the chunk (pre-training) holding the new word
TIMEOUT = 300

pytestmark = pytest.mark.slow


@dataclass
class Run:
    """A finished recipe run: its exit code, output, folder, and the guard's events."""

    returncode: int
    output: str
    out_dir: Path
    events: list[dict[str, Any]]


def _litgpt(recipe: str, folder: Path, guard: bool, env: dict[str, str] | None = None) -> Run:
    """Run ``litgpt <recipe>`` as a user types it (``examples/litgpt_nanguard.py``'s arguments)."""
    arguments = litgpt_nanguard.recipe_arguments(recipe, folder)
    environment = litgpt_nanguard.recipe_environment(guard, env)
    done = subprocess.run(
        [sys.executable, "-m", "litgpt", *arguments],
        env=environment,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    out_dir = folder / "out"
    found = sorted(Path(environment.get("NANGUARD_DIR", out_dir)).rglob("events.jsonl"))
    events = [json.loads(line) for path in found for line in path.read_text().splitlines()]
    return Run(done.returncode, done.stdout + done.stderr, out_dir, events)


def _all_finite(path: Path) -> bool:
    return litgpt_nanguard.all_finite(path)


def _named_the_record(event: dict[str, Any], kinds: list[str]) -> None:
    assert event["kinds"] == kinds
    assert event["action"] == "skipped"
    assert event["dataset_indices"] == [BAD]
    assert event["culprit_module"] == "transformer.h.0.norm_1"
    assert "rsqrt" in event["culprit_op"].lower()
    assert "litgpt/model.py" in event["source_line"].replace(os.sep, "/")


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _litgpt("finetune_full", tmp_path_factory.mktemp("full"), guard=True)


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("lora")
    return _litgpt("finetune_lora", folder, guard=True, env={"NANGUARD_DIR": str(folder / "elsewhere")})


@pytest.fixture(scope="module")
def pretrain(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _litgpt("pretrain", tmp_path_factory.mktemp("pretrain"), guard=True)


def test_full_finetuning_without_the_guard_ends_with_a_nan_checkpoint(tmp_path: Path) -> None:
    run = _litgpt("finetune_full", tmp_path, guard=False)
    assert run.returncode == 0, run.output[-3000:]
    assert run.events == []
    assert not _all_finite(run.out_dir / "final" / "lit_model.pth")  # the fault is real


def test_full_finetuning_skips_the_step_and_names_the_record(full: Run) -> None:
    assert full.returncode == 0, full.output[-3000:]
    assert "Adding 1 callbacks from entry point 'nanguard'" in full.output
    assert len(full.events) == 1, full.events
    _named_the_record(full.events[0], ["loss", "grad"])
    assert full.events[0]["global_step"] == 2  # records 4 and 5 are the second micro-batch of step 2
    assert _all_finite(full.out_dir / "final" / "lit_model.pth")
    # events sit with the run's CSV logs, and the bundle replays the record
    (jsonl,) = full.out_dir.rglob("events.jsonl")
    assert jsonl.parent.parent == full.out_dir / "logs" / "csv" / "version_0"
    assert (jsonl.parent / "step-2" / "batch.pt").is_file()


def test_lora_finetuning_guarded_through_setup_module(lora: Run) -> None:
    """``finetune_lora`` sets the model up with ``fabric.setup_module``: no Fabric hook, still guarded."""
    assert lora.returncode == 0, lora.output[-3000:]
    assert len(lora.events) == 1, lora.events
    _named_the_record(lora.events[0], ["loss", "grad"])
    assert set(lora.events[0]["nonfinite_grads"]) == {
        f"transformer.h.{layer}.attn.qkv.lora_{ab}" for layer in (0, 1) for ab in "AB"
    }
    assert _all_finite(lora.out_dir / "final" / "lit_model.pth.lora")


def test_nanguard_dir_takes_the_events(lora: Run) -> None:
    assert (lora.out_dir.parent / "elsewhere" / "nanguard" / "events.jsonl").is_file()
    assert not list(lora.out_dir.rglob("events.jsonl"))


def test_pretraining_without_the_guard_dies_in_clip_gradients(tmp_path: Path) -> None:
    run = _litgpt("pretrain", tmp_path, guard=False)
    assert run.returncode != 0
    assert "is non-finite, so it cannot be clipped" in run.output
    assert not (run.out_dir / "final" / "lit_model.pth").exists()


def test_pretraining_under_compile_and_bf16_skips_the_nan_gradient(pretrain: Run) -> None:
    """``pretrain``: ``torch.compile``, bf16-mixed, accumulation, ``clip_gradients(max_norm=1.0)``."""
    assert pretrain.returncode == 0, pretrain.output[-3000:]
    assert len(pretrain.events) == 1, pretrain.events
    event = pretrain.events[0]
    _named_the_record(event, ["grad"])  # the loss is finite: only the gradient is NaN
    assert event["nonfinite_grads"] == ["transformer.wte.weight"]
    assert float(event["loss"]) == pytest.approx(float(event["loss"]))  # finite
    assert event["global_step"] == 1  # chunks 4 and 5: the second micro-batch of step 1
    # the recipe saves its train loader in the checkpoint: it pickles as a plain DataLoader, no guard class
    final = pretrain.out_dir / "final" / "lit_model.pth"
    with zipfile.ZipFile(final) as archive:
        pickled = b"".join(archive.read(name) for name in archive.namelist() if name.endswith(".pkl"))
    assert b"torch.utils.data.dataloader" in pickled and b"lightning_nanguard" not in pickled
    assert _all_finite(final)


def test_pretraining_writes_the_nanguard_scalars_to_its_tensorboard(pretrain: Run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = (pretrain.out_dir / "logs" / "tensorboard").glob("version_*")
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert "nanguard/skipped_total" in tags, tags
    assert [s.value for s in accumulator.Scalars("nanguard/skipped_total")][-1] == 1.0
