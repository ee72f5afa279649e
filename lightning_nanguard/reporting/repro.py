"""Repro bundles: everything needed to re-run a bad step in a fresh process.

A bundle is a directory ``<log_dir>/nanguard/step-<N>/`` holding:

- ``event.json``: the event (``NanEvent.to_dict()``);
- ``batch.pt``: the offending samples (or the whole batch when not attributable), on the CPU; with
  BatchNorm in train mode also one known-good reference sample (``reference_positions``), next to
  which a single sample is re-run, as during training;
- ``module_state.pt``: the module's ``state_dict`` before the step. For a sharded model (FSDP2,
  tensor parallelism) the full tensors gathered from every rank's shards, when the whole model is
  small enough to gather (``module.json`` says ``"module_state": "gathered"``); otherwise the file is
  absent, ``module.json`` says why, and ``replay`` refuses the bundle with that reason (its samples and
  event are still there to read);
- ``module.json``: how to rebuild the module (class path, the file defining it) and the context
  (batch index, positions of the saved samples in the original batch, dataset indices, reference
  samples; with several training loaders the layout of the batch, ``loaders``, and each saved
  sample's loader, ``sample_loaders``), and the source of the origin: the path as displayed, the absolute path, and the
  source root the displayed path is relative to (``replay`` displays paths relative to it too, so
  it prints the same line as training did, from any working directory);
- ``details_full.json``: the event's details with the lists an event keeps short in full (every
  non-finite BatchNorm channel of every layer);
- ``hparams.pt``: the module's saved hyperparameters (``save_hyperparameters()``), if any;
- ``reference.pt``: for a batch at fault as a whole (cause ``"batch"``), the reference samples of a
  recent healthy step its samples were run beside: the evidence of that cause, so ``replay`` reaches
  it again.

``python -m lightning_nanguard replay <bundle>`` loads it with :func:`load_bundle`.

A bundle is made to be shared, so loading one runs none of its code by default: its ``.pt`` files
are read with ``torch.load(..., weights_only=True)`` (tensors and plain data: dicts, lists, tuples,
numbers, strings, ``None``), and the model class is imported by its module name from the installed
environment, never from the ``module_file`` the bundle names nor from inside the bundle. A bundle that
needs more (a custom batch class, pickled hyperparameters, a class defined in a script) is refused with
:class:`UntrustedBundleError` unless loaded with ``trust=True`` (``replay --trust``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pickle
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_nanguard.core.event_builder import Files, with_sections
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.combined import CombinedLayout

__all__ = [
    "BundleMissingError",
    "ReproBundle",
    "UntrustedBundleError",
    "import_class",
    "load_bundle",
    "prune_bundles",
    "save_bundle",
    "update_bundle_event",
]

BUNDLE_PREFIX = "step-"
BUNDLE_FILES = ("event.json", "module.json", "batch.pt", "module_state.pt")
STATE_SAVED, STATE_GATHERED = "saved", "gathered"


class BundleMissingError(FileNotFoundError):
    """The bundle directory does not exist (pruned by ``max_repro_bundles``, or moved), or lacks its files."""


class UntrustedBundleError(RuntimeError):
    """Loading the bundle would run code from it (its pickles, its module file): refused unless trusted."""


TRUST_HINT = (
    "Loading it as it is would run code from the bundle. If you trust whoever made it, replay it with --trust "
    "(trust=True in the Python API): that unpickles its .pt files in full and imports the module file it names, "
    "running their code."
)


def _to_cpu(batch: Any) -> Any:
    return apply_to_collection(batch, torch.Tensor, lambda t: t.detach().to("cpu"), allow_frozen=True)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def save_bundle(
    directory: str | os.PathLike[str],
    event: NanEvent,
    module: nn.Module,
    batch: Any,
    batch_idx: int,
    positions: list[int] | None,
    sample_dataset_indices: list[int] | None = None,
    reference_positions: list[int] | None = None,
    full_details: Mapping[str, Any] | None = None,
    source_root: str | None = None,
    module_state: Mapping[str, Any] | str | None = None,
    layout: CombinedLayout | None = None,
    sample_loaders: list[str | int] | None = None,
    reference_batch: Any = None,
) -> Path:
    """Write a bundle for ``event`` and return its path (``directory/step-<global_step>``).

    Args:
        directory: the ``nanguard`` folder of the run.
        event: the event being saved.
        module: the module, in its state before the step.
        batch: the samples to save (already cut to the offending ones, or the whole batch).
        batch_idx: index of the batch in its epoch (passed to ``training_step`` on replay).
        positions: positions of the saved samples in the original batch (``None``: whole batch).
        sample_dataset_indices: dataset index of each saved sample, when known.
        reference_positions: positions in ``batch`` of known-good reference samples (saved so that
            BatchNorm in train mode never sees a single sample on replay).
        full_details: details the event keeps short, in full (``Diagnosis.full_details``).
        source_root: the directory the event's source path is displayed relative to (the
            diagnosis's ``source_root``); default: the working directory, as the diagnosis's default.
        module_state: the state to save instead of ``module.state_dict()`` (a sharded model's full
            tensors, gathered from the shards), or a string: why no state is saved (the reason goes
            into ``module.json`` and ``replay`` says it).
        layout: with several training loaders, where each loader's part sits in ``batch``
            (``positions`` are then positions in each saved sample's own loader's part).
        sample_loaders: with several training loaders, the loader of each saved sample, aligned with
            ``positions``.
        reference_batch: the reference samples of a healthy step the cause rests on (cause ``"batch"``).
    """
    path = Path(directory) / f"{BUNDLE_PREFIX}{event.global_step}"
    if event.rank:
        path = path.with_name(f"{path.name}-rank{event.rank}")
    if path.is_dir():  # same step of an earlier run in this directory: never mix its files (hparams.pt) in
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_to_cpu(batch), path / "batch.pt")
    if reference_batch is not None:
        torch.save(_to_cpu(reference_batch), path / "reference.pt")
    if isinstance(module_state, str):
        state_note = module_state
    else:
        state = module_state if module_state is not None else module.state_dict()
        torch.save({k: v.detach().to("cpu") for k, v in state.items()}, path / "module_state.pt")
        state_note = STATE_GATHERED if module_state is not None else STATE_SAVED
    hparams = dict(getattr(module, "hparams", {}) or {})
    if hparams:
        torch.save(hparams, path / "hparams.pt")
    cls = type(module)
    try:
        module_file: str | None = inspect.getfile(cls)
    except (TypeError, OSError):
        module_file = None
    meta: dict[str, Any] = {
        "class_path": _class_path(cls),
        "module_file": module_file,
        "has_hparams": bool(hparams),
        "batch_idx": batch_idx,
        "positions": positions,
        "sample_dataset_indices": sample_dataset_indices,
        "reference_positions": list(reference_positions or []),
        "torch_version": torch.__version__,
        "source_root": os.path.abspath(source_root if source_root is not None else os.getcwd()),
        "source": {"line": event.source_line, "path": event.details.get("source_path")},
        "module_state": state_note,
    }
    if layout is not None:  # several training loaders (a bundle of one loader is unchanged)
        meta["loaders"] = layout.to_json()
        meta["sample_loaders"] = sample_loaders
    meta["replay_needs_trust"] = _needs_trust(path, cls)  # the replay command shown then says --trust
    (path / "module.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    saved = with_sections(event, files=Files(str(path))).to_dict()  # the event names its own bundle
    (path / "event.json").write_text(json.dumps(saved, indent=2), encoding="utf-8")
    full = {**saved["details"], **dict(full_details or {})}
    (path / "details_full.json").write_text(json.dumps(full, indent=2, default=str), encoding="utf-8")
    return path


def _needs_trust(path: Path, cls: type) -> bool:
    """Whether replaying this (own) bundle will need ``--trust``.

    It will when its class lives in the script that ran (``__main__``) or outside the installed
    environment, or when a file holds more than plain data.
    """
    top = cls.__module__.split(".")[0]
    if top == "__main__" or importlib.util.find_spec(top) is None:
        return True
    for name in ("batch.pt", "hparams.pt", "reference.pt"):
        if (path / name).exists():
            try:
                torch.load(path / name, weights_only=True)
            except pickle.UnpicklingError:
                return True
    return False


def replay_command(bundle: str | os.PathLike[str]) -> str:
    """The command that replays ``bundle``, with ``--trust`` where its ``module.json`` says it needs it.

    For the run's own bundles: a bundle you did not make should be replayed without ``--trust`` first
    (it then says what it needs).

    Example:
        >>> replay_command("/nonexistent/step-3")
        'python -m lightning_nanguard replay /nonexistent/step-3'
    """
    try:
        meta = json.loads((Path(bundle) / "module.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    trust = " --trust" if meta.get("replay_needs_trust") else ""
    return f"python -m lightning_nanguard replay {shlex.quote(str(bundle))}{trust}"


def update_bundle_event(event: NanEvent) -> bool:
    """Rewrite the ``event.json`` of ``event``'s bundle with ``event`` as recorded; ``False`` if it has none.

    A bundle is saved while the step is diagnosed, before the step's decision: the action taken,
    the remedies applied and the cause shared by the ranks are only known afterwards.

    Example:
        >>> update_bundle_event(NanEvent(3, 0, 3, 0, ("loss",), "skipped"))  # no bundle saved
        False
    """
    if not event.repro_path:
        return False
    path = Path(event.repro_path) / "event.json"
    if not path.is_file():  # pruned or moved since
        return False
    path.write_text(json.dumps(event.to_dict(), indent=2), encoding="utf-8")
    return True


def prune_bundles(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete the oldest bundles beyond ``keep`` (by modification time); return what was deleted."""
    root = Path(directory)
    if not root.is_dir():
        return []
    bundles = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(BUNDLE_PREFIX)), key=lambda p: p.stat().st_mtime
    )
    doomed = bundles[: max(0, len(bundles) - keep)]
    for bundle in doomed:
        shutil.rmtree(bundle, ignore_errors=True)
    return doomed


def import_class(class_path: str, module_file: str | None = None, *, trust: bool = False) -> type:
    """Import ``"package.module:Class"`` from the installed environment; with ``trust``, fall back to ``module_file``.

    A module named ``__main__`` (a script) or not installed is not imported by name; executing its
    ``module_file`` instead (e.g. a training script) runs that file, so it needs ``trust=True``.

    Raises:
        UntrustedBundleError: only ``module_file`` defines the class, and ``trust`` is false.

    Example:
        >>> import_class("torch.nn:Linear").__name__
        'Linear'
    """
    module_name, _, qualname = class_path.partition(":")
    if not qualname:
        module_name, _, qualname = class_path.rpartition(".")
    try:
        if "__main__" in module_name.split("."):  # a script (or a package's program): never run by name
            raise ImportError("defined in a script")
        module: Any = importlib.import_module(module_name)
    except ImportError:
        if not module_file or not os.path.exists(module_file):
            raise
        if not trust:
            raise UntrustedBundleError(
                f"the model class {class_path} is not importable from the installed environment, only from the "
                f"module file the bundle names ({module_file})"
            ) from None
        spec = importlib.util.spec_from_file_location("nanguard_replay_user_module", module_file)
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{class_path} is not a class")
    return obj


def _found_inside(root: Path, class_path: str) -> bool:
    """Whether the top-level package of ``class_path`` would be imported from inside the bundle ``root``.

    ``python -m`` puts the working directory on ``sys.path``: replaying from inside a bundle would
    import a module file planted in it. Finding a top-level module runs none of its code.
    """
    top = class_path.partition(":")[0].partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [*(spec.submodule_search_locations or []), *([spec.origin] if spec.has_location and spec.origin else [])]
    inside = root.resolve()
    return any(Path(place).resolve().is_relative_to(inside) for place in places)


def _load(path: Path, trust: bool, refusals: list[str]) -> Any:
    """``torch.load`` of a bundle file: plain data only unless ``trust``; what more it needs goes to ``refusals``."""
    if trust:
        return torch.load(path, weights_only=False)
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch >= 2.5; no code run
        try:
            needed = sorted(finder(path)) if finder is not None else []
        except (ValueError, RuntimeError):  # not a zip checkpoint (the legacy format)
            needed = []
        what = ", ".join(needed) or "objects other than tensors and plain data"
        refusals.append(f"{path.name} holds {what}, which only a full unpickling rebuilds")
        return None


def _init_kwargs(cls: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters that ``cls.__init__`` accepts (LightningCLI adds ``_instantiator``)."""
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_")}
    parameters = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    accepted = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in accepted}


def _state_note(root: Path) -> str | None:
    """Why a bundle has no model state, as ``module.json`` says (``None``: it should have one)."""
    try:
        note = json.loads((root / "module.json").read_text(encoding="utf-8")).get("module_state")
    except (OSError, ValueError):
        return None
    return note if isinstance(note, str) and note not in (STATE_SAVED, STATE_GATHERED) else None


@dataclass
class ReproBundle:
    """A loaded bundle: the rebuilt module (weights loaded), the samples and the saved event.

    ``reference_batch``: the healthy reference samples a ``"batch"`` cause rests on (``None``: none saved).
    """

    path: Path
    module: nn.Module
    batch: Any
    batch_idx: int
    event: NanEvent
    meta: dict[str, Any]
    reference_batch: Any = None


def load_bundle(path: str | os.PathLike[str], module_class: str | None = None, *, trust: bool = False) -> ReproBundle:
    """Rebuild the module of a bundle and load its samples.

    Args:
        path: bundle directory.
        module_class: ``"pkg.mod:Class"`` to use instead of the recorded class.
        trust: load the bundle even if that runs code from it: unpickle its ``.pt`` files in full
            (``weights_only=False``) and import the ``module_file`` it names. Only for bundles from
            someone you trust; by default nothing of the bundle is executed.

    Raises:
        BundleMissingError: the bundle is gone or incomplete.
        UntrustedBundleError: the bundle needs more than tensors, plain data and an installed class,
            and ``trust`` is false (the message says what it needs).
    """
    root = Path(path)
    if not root.is_dir():
        raise BundleMissingError(
            f"the bundle {root} does not exist: NanGuard keeps the newest max_repro_bundles bundles and deletes "
            "older ones (an older event's repro_path may point to a deleted bundle), or it was moved"
        )
    missing = [name for name in BUNDLE_FILES if not (root / name).is_file()]
    note = _state_note(root) if missing == ["module_state.pt"] else None
    if note is not None:
        raise BundleMissingError(
            f"{root} holds the samples (batch.pt) and the event (event.json) but no model state: {note}. "
            "Replay needs the weights of the step: rebuild the model from a checkpoint of that step and run "
            "`lightning_nanguard.diagnose.batch_diagnosis.diagnose` on the saved samples"
        )
    if missing:
        raise BundleMissingError(f"{root} is not a complete repro bundle: {', '.join(missing)} missing")
    meta = json.loads((root / "module.json").read_text(encoding="utf-8"))
    event = NanEvent.from_dict(json.loads((root / "event.json").read_text(encoding="utf-8")))
    refusals: list[str] = []
    hparams = _load(root / "hparams.pt", trust, refusals) if (root / "hparams.pt").exists() else {}
    state = _load(root / "module_state.pt", trust, refusals)
    batch = _load(root / "batch.pt", trust, refusals)
    reference = _load(root / "reference.pt", trust, refusals) if (root / "reference.pt").exists() else None
    class_path = module_class or meta["class_path"]
    cls: type | None = None
    if not trust and module_class is None and _found_inside(root, class_path):
        refusals.append(f"the model class {class_path} would be imported from a file inside the bundle")
    else:
        try:
            cls = import_class(class_path, None if module_class else meta.get("module_file"), trust=trust)
        except UntrustedBundleError as refused:
            refusals.append(str(refused))
    if refusals:
        instead = (
            " Or rebuild the model from a class of your environment: --module pkg.mod:Class (module_class=...)."
            if cls is None
            else ""
        )
        raise UntrustedBundleError(f"{root} needs trust: {'; '.join(refusals)}. {TRUST_HINT}{instead}")
    if cls is None or not issubclass(cls, nn.Module):  # never call an arbitrary class with the bundle's arguments
        raise TypeError(f"{class_path} is not a torch.nn.Module")
    module = cls(**_init_kwargs(cls, hparams))
    module.load_state_dict(state)
    module.train()
    return ReproBundle(root, module, batch, int(meta.get("batch_idx", 0)), event, meta, reference)
