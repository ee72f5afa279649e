"""Guarded image runs and a real TensorBoard server, shared by the dashboard tests.

The runs are real ``Trainer.fit`` calls with ``NanGuard`` in both namespaces: a small image
classifier whose first layer divides by the norm of each input patch without an epsilon, so a
blank image gives ``0 / 0 = NaN`` (the demo's failure, on 12x12 images).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch
import pytorch_lightning
import torch
from event_factory import make_event
from fitting import build_trainer
from torch import Tensor, nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.reporting.context import save_incident_context
from lightning_nanguard.reporting.jsonl import JsonlEventLog

N_IMAGES = 64
BATCH = 16
SIDE = 12
BLANK = (20, 50)  # in batches 1 and 3 of each epoch (no shuffling)


class PatchNormConv(nn.Module):
    """Convolution divided by the norm of each input patch: NaN on a blank patch (no eps)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 1, 3, 3) * 0.5)
        self.register_buffer("ones", torch.ones(1, 1, 3, 3))

    def forward(self, x: Tensor) -> Tensor:
        dot = functional.conv2d(x, self.weight, padding=1)
        patch_norm = functional.conv2d(x.pow(2), self.ones, padding=1).sqrt()
        return dot / patch_norm  # DASHBOARD-ORIGIN


class _ImageClassifier:
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(PatchNormConv(), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, labels = batch
        loss = functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)  # type: ignore[attr-defined]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)  # type: ignore[attr-defined]


class LightningImageClassifier(_ImageClassifier, lightning.pytorch.LightningModule):
    pass


class PLImageClassifier(_ImageClassifier, pytorch_lightning.LightningModule):
    pass


MODULES = {"lightning": LightningImageClassifier, "pytorch_lightning": PLImageClassifier}


def image_dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(N_IMAGES, 1, SIDE, SIDE, generator=g)
    images[list(BLANK)] = 0.0
    labels = torch.randint(0, 2, (N_IMAGES,), generator=g)
    return TensorDataset(images, labels)


def origin_line() -> int:
    """Line number of the op that makes the NaN (tagged ``DASHBOARD-ORIGIN`` above)."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.endswith("# DASHBOARD-ORIGIN"))


def guarded_image_run(
    ns_name: str, logdir: Path, *, epochs: int = 2, max_repro_bundles: int = 1
) -> tuple[Path, NanGuard]:
    """Fit the image classifier of namespace ``ns_name`` under NanGuard with a TensorBoardLogger.

    Returns the run directory (``logdir/<ns_name>/version_0``) and the guard.
    """
    namespace = lightning.pytorch if ns_name == "lightning" else pytorch_lightning
    torch.manual_seed(0)
    guard = NanGuard(verbose=False, max_repro_bundles=max_repro_bundles)
    logger = namespace.loggers.TensorBoardLogger(str(logdir), name=ns_name, version=0)
    trainer = build_trainer(ns_name, logdir, callbacks=[guard], logger=logger, max_epochs=epochs)
    trainer.fit(MODULES[ns_name](), DataLoader(image_dataset(), batch_size=BATCH, shuffle=False))
    return Path(logger.log_dir), guard


LOADERS_RUN = "two_loaders/version_0"
LOADERS_BLANK = {"a": (13,), "b": (6, 9)}  # a[13] and b[6] in step 1, b[9] in step 2 (no shuffling)


def guarded_loaders_run(logdir: Path) -> tuple[Path, NanGuard]:
    """Fit a two-task model on ``{"a": loader_a, "b": loader_b}`` (batch sizes 8 and 4) under NanGuard.

    Returns the run directory (``logdir/two_loaders/version_0``) and the guard.
    """
    import multitask_models as mm

    torch.manual_seed(0)
    guard = NanGuard(verbose=False)
    logger = lightning.pytorch.loggers.TensorBoardLogger(str(logdir), name="two_loaders", version=0)
    data = {
        "a": mm.blank_dataset(32, LOADERS_BLANK["a"], seed=1),
        "b": mm.blank_dataset(12, LOADERS_BLANK["b"], seed=2),
    }
    loaders = {"a": mm.loader(data["a"], 8, shuffle=False), "b": mm.loader(data["b"], 4, shuffle=False)}
    trainer = build_trainer("lightning", logdir, callbacks=[guard], logger=logger)
    trainer.fit(mm.MultiTaskModule(), loaders)
    return Path(logger.log_dir), guard


# ------------------------------------------------------------------------------------ TensorBoard server


class TensorBoardServer:
    """A real ``tensorboard`` process on 127.0.0.1 (a free port chosen by the OS)."""

    def __init__(self, process: subprocess.Popen[str], url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers, body)`` of ``GET <url><path>``; HTTP errors are returned, not raised."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()


@contextmanager
def tensorboard_server(logdir: Path, workdir: Path, *extra: str, timeout: float = 120.0) -> Iterator[TensorBoardServer]:
    """Start TensorBoard on ``logdir``; stopped (and its process reaped) on exit.

    ``workdir`` is its working directory: outside the repository, so TensorBoard finds the plugin
    through the installed package's entry point, as a user's TensorBoard does.
    """
    log = workdir / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen([*command, *extra], cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            found = re.search(r"at (http://127\.0\.0\.1:\d+/)", log.read_text(encoding="utf-8"))
            if found:
                url = found[1].rstrip("/")
            elif process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"TensorBoard did not start:\n{log.read_text(encoding='utf-8')}")
            else:
                time.sleep(0.2)
        yield TensorBoardServer(process, url, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(condition: Any, timeout: float = 60.0, interval: float = 0.3) -> Any:
    """Poll ``condition()`` until it returns something truthy (TensorBoard loads event files in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# ------------------------------------------------------------------------------------ older and newer event files


LEGACY_EVENT = {  # an events.jsonl line written before `cause`, the stack and compact BatchNorm channels existed
    "global_step": 4,
    "epoch": 0,
    "batch_idx": 4,
    "rank": 0,
    "kinds": ["loss", "grad"],
    "action": "skipped",
    "nonfinite_grads": ["fc.weight"],
    "loss": "nan",
    "grad_norm": "nan",
    "details": {"bn_channels": {"net.1": [0, 2]}},
}
SPIKE_EVENT = {
    "global_step": 9,
    "epoch": 0,
    "batch_idx": 9,
    "rank": 0,
    "kinds": ["loss_spike"],
    "action": "warned",
    "loss": 812.5,
    "cause": None,
    "details": {"threshold": 40.0, "baseline": 2.1},
}


def write_mixed_run(run_dir: Path) -> None:
    path = run_dir / "nanguard" / "events.jsonl"
    path.parent.mkdir(parents=True)
    lines = [json.dumps(SPIKE_EVENT), json.dumps(LEGACY_EVENT), "not json at all", json.dumps([1, 2])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------ what the guard verified

VERIFIED_RUN = "verified/version_0"
UNVERIFIED_INDICES = "the collate reorders rows and the batch has no index field"
UNVERIFIED_BLAME = "max_bisect_passes reached before the check"
BLAME_NOTE = "sample 2 failed only alone and was dropped"
BATCH_HINT = "a mean over zero targets is 0/0: guard the denominator (clamp_min(1) on the target count)"


def verified_events() -> list[NanEvent]:
    """Four events: indices and blame verified, neither verified, rows of several records, cause ``batch``."""
    common = {"kinds": ("loss", "grad"), "cause": "data", "loss": float("nan"), "grad_norm": float("nan")}
    return [
        make_event(
            bare=True,
            global_step=2,
            batch_idx=2,
            **common,
            offending_samples=(3, 5),
            dataset_indices=(27, 29),
            indices_verified=True,
            blame_verified=True,
            details={"batch_size": 8, "verify_passes": 1},
        ),
        make_event(
            bare=True,
            global_step=4,
            batch_idx=4,
            **common,
            offending_samples=(0, 7),
            dataset_indices=(27, 31),
            indices_verified=False,
            blame_verified=False,
            details={"batch_size": 8, "indices_unverified": UNVERIFIED_INDICES, "blame_unverified": UNVERIFIED_BLAME},
        ),
        make_event(
            bare=True,
            global_step=6,
            batch_idx=6,
            **common,
            offending_samples=(1, 6),
            sample_records=((10, 11), (40,)),
            indices_verified=True,
            blame_verified=True,
            details={"batch_size": 8, "verify_passes": 1, "blame_note": BLAME_NOTE},
        ),
        make_event(
            bare=True,
            global_step=8,
            batch_idx=8,
            **{**common, "cause": "batch"},
            culprit_module="",
            culprit_op="NllLossBackward0",
            phase="forward",
            details={"hint": BATCH_HINT},
        ),
    ]


def write_verified_run(logdir: Path) -> Path:
    """The :func:`verified_events` written by the guard's own writers: ``events.jsonl`` and the incident files.

    The rows of several records get thumbnails (an image batch of 8), so their records show with them.
    """
    run_dir = logdir / VERIFIED_RUN
    log = JsonlEventLog(run_dir / "nanguard" / "events.jsonl")
    images = torch.rand(8, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    for event in verified_events():
        log.append(event)
        save_incident_context(run_dir / "nanguard", event, batch=(images, torch.zeros(8)))
    return run_dir
