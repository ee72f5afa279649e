"""Command line: ``python -m lightning_nanguard replay <bundle>``.

Rebuilds the module saved in a repro bundle, re-runs the saved samples and prints the same
diagnosis the guard printed during training (offending samples, module, op, source line).

A bundle may come from someone else: by default replay runs none of its code (its ``.pt`` files are
read as tensors and plain data, the model class is imported from the installed environment only)
and refuses a bundle that needs more; ``--trust`` loads it in full (see ``docs/security.md``).

Example:
    python -m lightning_nanguard replay lightning_logs/version_0/nanguard/step-812
    python -m lightning_nanguard replay BUNDLE --module my_project.models:Classifier
    python -m lightning_nanguard replay BUNDLE --trust  # runs code from the bundle: only one you trust
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.core.event_builder import Decided, EventSections, Files, Forensics, Rows, noted, with_sections
from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.combined import CombinedLayout
from lightning_nanguard.diagnose.event_fields import diagnosis_sections
from lightning_nanguard.reporting import TerminalReporter
from lightning_nanguard.reporting.repro import BundleMissingError, UntrustedBundleError, load_bundle

__all__ = ["main"]


# Forensic details of the saved event that only the replay's own diagnosis may fill in again.
_DIAGNOSIS_DETAILS = (
    "batch_size",
    "bisect_passes",
    "not_attributable",
    "bisect_note",
    "diagnosis_error",
    "module_type",
    "source_text",
    "hint",
    "input_nonfinite",
    "bn_channels",
    "bn_channels_summary",
    "state_passes",
    "input_fields",
    "function",
    "source_path",
    "stack",
    "dataset_indices_unknown",
    "verify_passes",
    "blame_note",
    "blame_unverified",
)


def _without_diagnosis(details: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in details.items() if key not in _DIAGNOSIS_DETAILS}


def _replay(args: argparse.Namespace) -> int:
    try:
        bundle = load_bundle(args.bundle, module_class=args.module, trust=args.trust)
    except BundleMissingError as error:
        print(f"replay failed: {error}", file=sys.stderr)
        return 2
    except UntrustedBundleError as error:
        print(f"replay refused: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # unimportable class, changed signature
        print(
            f"replay failed: could not rebuild the module of {args.bundle}: {error!r}; "
            "pass --module pkg.mod:Class if the class moved or was defined in a script",
            file=sys.stderr,
        )
        return 2
    positions = bundle.meta.get("positions")
    saved = bundle.event
    loaders = bundle.meta.get("loaders")
    diagnosis = diagnose(
        bundle.module,
        bundle.batch,
        batch_idx=bundle.batch_idx,
        max_passes=args.max_passes,
        known_good=bundle.meta.get("reference_positions") or (),
        reference_batch=bundle.reference_batch,  # a "batch" cause's healthy samples, when saved
        loss_threshold=saved.details.get("loss_threshold"),
        source_root=bundle.meta.get("source_root"),
        # a bundle of some samples of the batch: training already found them at fault, not the model state
        state_check=positions is None,
        layout=CombinedLayout.from_json(loaders) if loaders else None,  # several training loaders
    )
    if diagnosis.error and diagnosis.offending is None:  # with samples found, only the origin is missing
        print(f"replay failed: {diagnosis.error}", file=sys.stderr)
        return 2
    # start from the saved event without its diagnosis: everything printed below is reproduced here
    saved_sections = EventSections.of(saved)
    kept = Forensics(details=_without_diagnosis(saved_sections.forensics.details))
    rows = Rows(
        sample_records=saved.sample_records,
        indices_verified=saved.indices_verified,
        details=_without_diagnosis(saved_sections.rows.details),
    )
    forensics, rows = diagnosis_sections(
        diagnosis,
        positions=positions,
        dataset_indices=bundle.meta.get("sample_dataset_indices"),
        batch_size=saved.details.get("batch_size", diagnosis.batch_size),
        forensics=kept,
        rows=rows,
    )
    if "loader_batch_sizes" in saved.details:  # the original batch's loaders, not the saved samples'
        rows = noted(rows, loader_batch_sizes=saved.details["loader_batch_sizes"])
    event = with_sections(
        saved,
        forensics=forensics,
        rows=rows,
        decided=Decided(saved.action),  # no remedy: nothing is applied here
        files=Files(str(bundle.path)),
    )
    reproduced = diagnosis.offending is not None or (
        diagnosis.localization is not None and diagnosis.localization.phase
    )
    TerminalReporter(rank=saved.rank).report(event)
    if args.json:
        print(json.dumps(event.to_dict(), allow_nan=False))
    if not reproduced:
        print("the saved samples did not reproduce a non-finite step", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lightning_nanguard`` (and the ``nanguard`` script)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_nanguard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    replay = commands.add_parser("replay", help="re-run a saved repro bundle and print the diagnosis")
    replay.add_argument("bundle", help="bundle directory, e.g. <log_dir>/nanguard/step-812")
    replay.add_argument("--module", default=None, help="module class to rebuild, as pkg.mod:Class")
    replay.add_argument(
        "--max-passes", type=int, default=default_of(diagnose, "max_passes"), help="cap on forward/backward passes"
    )
    replay.add_argument("--json", action="store_true", help="also print the event as one JSON line")
    replay.add_argument(
        "--trust",
        action="store_true",
        help="load a bundle that needs more than tensors and an installed class: unpickle its .pt files in full "
        "and import the module file it names, running their code (only for bundles from someone you trust)",
    )
    args = parser.parse_args(argv)
    if args.command == "replay":
        return _replay(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
