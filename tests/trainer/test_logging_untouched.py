"""Importing the guard leaves Lightning's logging as the user's own imports made it (issue 32, item 6).

Each Lightning namespace, when imported, points the logger and the deprecation category it shares
with ``lightning_utilities`` (``lightning_utilities.core.rank_zero.log`` and
``rank_zero_deprecation_category``) at its own; the last namespace imported wins. The compat shim
used to ``import pytorch_lightning`` after ``lightning.pytorch``, so Lightning's info messages went
to the ``pytorch_lightning`` logger and ``logging.getLogger("lightning.pytorch")`` settings (the way
Lightning documents to quiet it) stopped working; and because Fabric imports the package through
its entry point, every ``Fabric()`` did this, ``NANGUARD`` set or not.

Every case runs in a fresh interpreter (import order is the point) with ``NANGUARD`` unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

PRELUDE = """
import json, logging, sys

def shared_state():
    import lightning_utilities.core.rank_zero as rz
    category = rz.rank_zero_deprecation_category
    return {"log": rz.log.name, "category": f"{category.__module__}.{category.__name__}"}

def owned_by(namespace):
    # What importing `namespace` last sets (lightning/pytorch/utilities/rank_zero.py and its fabric's).
    fabric = "lightning.fabric" if namespace == "lightning.pytorch" else "lightning_fabric"
    return {"log": f"{namespace}.utilities.rank_zero",
            "category": f"{fabric}.utilities.rank_zero.LightningDeprecationWarning"}

QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)
"""


def run(code: str) -> tuple[dict[str, Any], str]:
    """Run ``PRELUDE + code`` in a fresh interpreter; its last stdout line is JSON. Returns it and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("NANGUARD", "NANGUARD_ARGS")}
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_lightning_pytorch_logger_settings_keep_working() -> None:
    """The issue's case: Lightning's messages reach a ``lightning.pytorch`` handler, and its level quiets them."""
    out, stderr = run(
        """
        import lightning.pytorch as L
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("lightning.pytorch").addHandler(handler)
        before = shared_state()
        from lightning_nanguard import NanGuard
        after_import = shared_state()
        L.Trainer(callbacks=[NanGuard()], **QUIET)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        print("-- quiet from here --", file=sys.stderr, flush=True)
        L.Trainer(callbacks=[NanGuard()], **QUIET)
        print(json.dumps({"before": before, "after_import": after_import, "after_trainer": shared_state(),
                          "owned": owned_by("lightning.pytorch"), "pl": "pytorch_lightning" in sys.modules,
                          "records": records}))
        """
    )
    assert out["before"] == out["after_import"] == out["after_trainer"] == out["owned"]
    assert not out["pl"]  # the guard imported no namespace the user did not
    assert any("GPU available" in message for message in out["records"]), out  # the user's handler got them
    quiet = stderr.split("-- quiet from here --")[1]
    assert "GPU available" not in quiet, stderr  # Trainer's rank_zero_info, silenced by the user's level


def test_fabric_with_nanguard_unset_imports_neither_the_guard_nor_another_namespace() -> None:
    """Fabric loads the entry point in every ``Fabric()``; with ``NANGUARD`` unset it must change nothing."""
    out, stderr = run(
        """
        import lightning as L
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        before = shared_state()
        handlers = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
                    for name in ("lightning", "lightning.pytorch", "lightning.fabric")}
        L.Fabric(accelerator="cpu", devices=1)
        after = shared_state()
        same_handlers = handlers == {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
                                     for name in handlers}
        L.Trainer(**QUIET)
        print(json.dumps({"before": before, "after": after, "after_trainer": shared_state(),
                          "same_handlers": same_handlers,
                          "modules": [m for m in ("lightning_nanguard.entry_points", "pytorch_lightning",
                                                  "lightning_nanguard.trainer.callback") if m in sys.modules]}))
        """
    )
    assert out["before"] == out["after"] == out["after_trainer"]
    assert out["same_handlers"]
    # The entry point was loaded (else this test proves nothing), and it loaded nothing else.
    assert out["modules"] == ["lightning_nanguard.entry_points"]
    assert "GPU available" not in stderr, stderr


def test_pytorch_lightning_users_keep_their_logger_too() -> None:
    out, stderr = run(
        """
        import pytorch_lightning as pl
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        before = shared_state()
        from lightning_nanguard import NanGuard
        after = shared_state()
        pl.Trainer(callbacks=NanGuard(), **QUIET)  # a bare callback: isinstance(guard, pl.Callback)
        print(json.dumps({"before": before, "after": after, "owned": owned_by("pytorch_lightning"),
                          "lightning": "lightning.pytorch" in sys.modules}))
        """
    )
    assert out["before"] == out["after"] == out["owned"]
    assert not out["lightning"]
    assert "GPU available" not in stderr, stderr


def test_the_guard_imported_first_imports_no_namespace_and_adopts_each_when_imported() -> None:
    """``from lightning_nanguard import NanGuard`` before ``import pytorch_lightning`` (isort's order).

    The guard imports no namespace; ``pytorch_lightning``, imported next, takes the shared logger as
    it would without the guard, and ``NanGuard`` (and a subclass made before) derive from its
    ``Callback`` from then on, so its Trainer accepts a bare guard; ``lightning.pytorch`` imported
    last then joins too and owns the logger, as it would without the guard.
    """
    out, stderr = run(
        """
        from lightning_nanguard import NanGuard
        from lightning_nanguard.trainer import _compat

        class MyGuard(NanGuard):
            pass

        early = NanGuard(verbose=False)
        imported_first = [m for m in ("lightning.pytorch", "pytorch_lightning") if m in sys.modules]
        import pytorch_lightning as pl
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        pl.Trainer(callbacks=NanGuard(), **QUIET)
        pl.Trainer(callbacks=MyGuard(), **QUIET)
        with_pl = {"state": shared_state(), "lightning": "lightning.pytorch" in sys.modules,
                   "instances": [isinstance(g, pl.Callback) for g in (early, MyGuard())]}
        import lightning.pytorch as L
        print(json.dumps({
            "imported_first": imported_first, "with_pl": with_pl, "state": shared_state(),
            "owned_pl": owned_by("pytorch_lightning"), "owned_l": owned_by("lightning.pytorch"),
            "bases": NanGuard.__bases__[1:] == _compat.CALLBACK_BASES == (L.Callback, pl.Callback),
            "instances": [isinstance(g, L.Callback) and isinstance(g, pl.Callback) for g in (early, MyGuard())],
            "loggers": _compat.tensorboard_logger_types() == (L.loggers.TensorBoardLogger,
                                                              pl.loggers.TensorBoardLogger),
            "hook_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AdoptOnImport"],
            "loaders": [type(m.__loader__).__name__ == type(m.__spec__.loader).__name__ == "SourceFileLoader"
                        for m in (pl, L)],
        }))
        """
    )
    assert out["imported_first"] == []
    assert out["with_pl"] == {"state": out["owned_pl"], "lightning": False, "instances": [True, True]}
    assert "GPU available" not in stderr, stderr
    assert out["state"] == out["owned_l"]  # lightning.pytorch imported last owns it, as without the guard
    assert out["bases"] and out["loggers"] and out["instances"] == [True, True]
    assert out["hook_left"] == [] and out["loaders"] == [True, True]


def test_lightning_pytorch_imported_after_pytorch_lightning_and_the_guard() -> None:
    """Both namespaces in use, ``lightning.pytorch`` imported last: it owns the shared logger."""
    out, _ = run(
        """
        import pytorch_lightning as pl
        from lightning_nanguard import NanGuard
        import lightning.pytorch as L
        print(json.dumps({"state": shared_state(), "owned": owned_by("lightning.pytorch"),
                          "bases": NanGuard.__bases__[1:] == (L.Callback, pl.Callback)}))
        """
    )
    assert out["state"] == out["owned"]
    assert out["bases"]
