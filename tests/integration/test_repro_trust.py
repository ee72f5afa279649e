"""Replaying a bundle someone else made runs none of its code unless it is trusted.

By default ``load_bundle`` and ``python -m lightning_nanguard replay`` read the bundle's ``.pt``
files with ``weights_only=True`` and import the model class from the installed environment only;
``trust=True`` / ``--trust`` unpickles in full and imports the module file the bundle names. Each
planted bundle here would create a marker file if any of its code ran.
"""

from __future__ import annotations

import json
import math
import re
import sys
from argparse import Namespace
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from event_factory import make_event
from torch import Tensor, nn

from lightning_nanguard.__main__ import main
from lightning_nanguard.reporting.repro import UntrustedBundleError, import_class, load_bundle, save_bundle

VALUES = [1.0, 2.0, 0.0, 3.0]  # the sample holding 0 gives log(0) = -inf

# The model of the bundles below, as a module file a bundle could name: importing it creates MARKER.
MODULE_SOURCE = """
import pathlib
import torch

pathlib.Path({marker!r}).touch()


class LogModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        return torch.log(self.w * batch).mean()
"""


class LogModel(nn.Module):
    """``log`` of each sample: a sample holding 0 gives ``-inf``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return torch.log(self.w * batch).mean()


class Sample(NamedTuple):
    """A custom batch class: only a full unpickling rebuilds it."""

    x: Tensor


class Configured(pl.LightningModule):
    """``save_hyperparameters()`` of plain values: ``hparams.pt`` loads with ``weights_only=True``."""

    def __init__(self, width: int = 3, config: Any = None, names: tuple[str, ...] = (), note: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc = nn.Linear(width, 1)


class Planted:
    """Unpickles by calling ``eval``, as a malicious ``batch.pt`` could: creates ``marker``, gives ``VALUES``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        code = f"__import__('pathlib').Path({str(self.marker)!r}).touch() or __import__('torch').tensor({VALUES!r})"
        return (eval, (code,))


def bundle(tmp_path: Path, batch: Any = None, module: nn.Module | None = None) -> Path:
    event = make_event(bare=True, global_step=5, batch_idx=5, loss=-math.inf, details={"batch_size": 4})
    batch = torch.tensor(VALUES) if batch is None else batch
    return save_bundle(tmp_path / "nanguard", event, module or LogModel(), batch, 5, None, source_root=str(tmp_path))


def set_class(path: Path, class_path: str, module_file: str | None) -> None:
    meta = json.loads((path / "module.json").read_text(encoding="utf-8"))
    meta.update(class_path=class_path, module_file=module_file)
    (path / "module.json").write_text(json.dumps(meta), encoding="utf-8")


def replay(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    """Exit code and stderr of ``replay``; a replay that reproduced the step printed its event (``--json``)."""
    code = main(["replay", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out.strip().splitlines()[-1])["offending_samples"] == [2]
    return code, err


def assert_refused(err: str, *needs: str) -> None:
    assert "replay refused: " in err and "--trust" in err and "trust=True" in err
    assert "running their code" in err
    for need in needs:
        assert need in err, need


def test_tensors_and_plain_data_load_without_trust(tmp_path: Path) -> None:
    """What the writer saves for plain batches and hyperparameters is ``weights_only``-loadable."""
    x = torch.randn(2, 3)
    batch = {"x": x, "ids": [1, 2], "names": ("a", "b"), "scale": 0.5, "note": None, "extra": OrderedDict(k=True)}
    module = Configured(width=3, config={"depth": [1, 2], "act": "relu"}, names=("a",), note=None)
    path = bundle(tmp_path, batch, module)
    for name in ("batch.pt", "hparams.pt", "module_state.pt"):
        torch.load(path / name, weights_only=True)
    loaded = load_bundle(path)
    assert isinstance(loaded.module, Configured) and loaded.module.hparams["config"] == {"depth": [1, 2], "act": "relu"}
    assert torch.equal(loaded.batch["x"], x)
    assert {k: v for k, v in loaded.batch.items() if k != "x"} == {k: v for k, v in batch.items() if k != "x"}


def test_a_pickle_that_runs_code_is_refused_and_replays_with_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = bundle(tmp_path)
    marker = tmp_path / "batch-pickle-ran"
    torch.save(Planted(marker), path / "batch.pt")

    code, err = replay(path, capsys)
    assert code == 2 and not marker.exists()
    assert_refused(err, "batch.pt holds builtins.eval, which only a full unpickling rebuilds")
    assert "--module" not in err  # the class is not the problem
    with pytest.raises(UntrustedBundleError, match=r"batch\.pt holds builtins\.eval"):
        load_bundle(path)
    assert not marker.exists()

    assert replay(path, capsys, "--trust")[0] == 0 and marker.exists()  # the planted code ran: trusted


def test_a_custom_batch_class_or_pickled_hyperparameters_need_trust(tmp_path: Path) -> None:
    path = bundle(tmp_path / "batch", Sample(torch.tensor(VALUES)))
    with pytest.raises(UntrustedBundleError, match=re.escape(f"batch.pt holds {__name__}.Sample")):
        load_bundle(path)
    assert isinstance(load_bundle(path, trust=True).batch, Sample)

    path = bundle(tmp_path / "hparams", module=Configured(config=Namespace(depth=2)))
    with pytest.raises(UntrustedBundleError, match=r"hparams\.pt holds argparse\.Namespace"):
        load_bundle(path)
    assert load_bundle(path, trust=True).module.hparams["config"] == Namespace(depth=2)


def test_a_module_file_outside_the_environment_is_imported_only_with_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A class defined in a script (or anywhere not installed): only the module file the bundle names defines it."""
    marker = tmp_path / "module-file-ran"
    script = tmp_path / "received" / "train.py"
    script.parent.mkdir()
    script.write_text(MODULE_SOURCE.format(marker=str(marker)), encoding="utf-8")
    path = bundle(tmp_path)
    set_class(path, "__main__:LogModel", str(script))

    code, err = replay(path, capsys)
    assert code == 2 and not marker.exists()
    assert_refused(
        err,
        f"__main__:LogModel is not importable from the installed environment, only from the module "
        f"file the bundle names ({script})",
        "--module pkg.mod:Class",
    )
    with pytest.raises(UntrustedBundleError):
        load_bundle(path)
    assert not marker.exists()
    assert replay(path, capsys, "--module", f"{__name__}:LogModel")[0] == 0  # a class of your own instead
    assert not marker.exists()

    assert replay(path, capsys, "--trust")[0] == 0 and marker.exists()


def test_a_module_planted_inside_the_bundle_is_imported_only_with_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m`` run from inside a bundle puts it on ``sys.path``: a module file planted there is not imported."""
    marker = tmp_path / "planted-module-ran"
    path = bundle(tmp_path)
    (path / "nanguard_planted_model.py").write_text(MODULE_SOURCE.format(marker=str(marker)), encoding="utf-8")
    set_class(path, "nanguard_planted_model:LogModel", None)
    monkeypatch.syspath_prepend(str(path))  # the working directory of `python -m`, here the bundle
    monkeypatch.delitem(sys.modules, "nanguard_planted_model", raising=False)

    code, err = replay(path, capsys)
    assert code == 2 and not marker.exists()
    assert_refused(err, "nanguard_planted_model:LogModel would be imported from a file inside the bundle")

    assert replay(path, capsys, "--trust")[0] == 0 and marker.exists()
    monkeypatch.delitem(sys.modules, "nanguard_planted_model")


def test_only_a_module_class_is_built_from_the_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An installed class that is not a model is never called with the bundle's arguments, trusted or not."""
    marker = tmp_path / "popen-ran"
    path = bundle(tmp_path)
    set_class(path, "subprocess:Popen", None)
    torch.save({"args": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}, path / "hparams.pt")
    for extra in ((), ("--trust",)):
        code, err = replay(path, capsys, *extra)
        assert code == 2 and "subprocess:Popen is not a torch.nn.Module" in err
    assert not marker.exists()


def test_import_class_runs_a_module_file_only_with_trust(tmp_path: Path) -> None:
    marker = tmp_path / "script-ran"
    script = tmp_path / "train.py"
    script.write_text(MODULE_SOURCE.format(marker=str(marker)), encoding="utf-8")
    with pytest.raises(UntrustedBundleError, match="not importable from the installed environment"):
        import_class("__main__:LogModel", str(script))
    with pytest.raises(UntrustedBundleError):
        import_class("__main__.sub:LogModel", str(script))  # no module named __main__ is run by name either
    assert not marker.exists()
    assert import_class("__main__:LogModel", str(script), trust=True).__name__ == "LogModel" and marker.exists()


def test_the_replay_command_shown_for_an_own_bundle_says_trust_only_when_it_is_needed(tmp_path: Path) -> None:
    """The panel and the dashboard show ``--trust`` for the run's own bundle whose class is in its script."""
    from lightning_nanguard.reporting.repro import replay_command

    for needs, folder in ((True, tmp_path / "a"), (False, tmp_path / "b")):
        folder.mkdir()
        (folder / "module.json").write_text(json.dumps({"replay_needs_trust": needs}))
        assert replay_command(folder).endswith(" --trust") is needs
