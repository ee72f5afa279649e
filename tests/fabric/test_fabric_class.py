"""``Fabric`` itself is held only when a Fabric loop is in use (``fabric/fabric_class.py``).

Each case runs in a fresh interpreter: the wrappers are process-wide, and another test of this
session may have made a guard and a ``Fabric`` already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PRELUDE = """
import json, torch
import lightning as L
from lightning.fabric import Fabric
def wrapped():
    return [getattr(getattr(Fabric, name), "__nanguard_wrapped__", False)
            for name in ("setup_module", "setup_dataloaders")]
"""


def run(code: str) -> dict:
    script = PRELUDE + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_trainer_only_run_leaves_fabric_alone() -> None:
    out = run(
        """
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning_nanguard import NanGuard
        guard = NanGuard(verbose=False)
        trainer = L.Trainer(callbacks=[guard], max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(BoringModel())
        print(json.dumps({"wrapped": wrapped(), "steps": trainer.global_step}))
        """
    )
    assert out == {"wrapped": [False, False], "steps": 2}


def test_a_fabric_without_a_guard_is_left_alone() -> None:
    out = run(
        """
        import lightning_nanguard  # installed and imported, but no guard made
        fabric = Fabric(accelerator="cpu", devices=1)
        fabric.setup_module(torch.nn.Linear(2, 1))
        print(json.dumps({"wrapped": wrapped()}))
        """
    )
    assert out == {"wrapped": [False, False]}


def test_a_fabric_built_with_a_guard_is_held_and_setup_module_reaches_the_guard() -> None:
    out = run(
        """
        from lightning_nanguard import FabricGuard, NanGuard
        before = wrapped()
        guard = FabricGuard(verbose=False)
        fabric = Fabric(accelerator="cpu", devices=1, callbacks=[guard])
        held_at_construction = wrapped()
        model = fabric.setup_module(torch.nn.Linear(2, 1))
        print(json.dumps({"before": before, "built": held_at_construction, "holds": guard.holds_fabric(fabric),
                          "nanguard_is_a_fabric_guard": issubclass(NanGuard, FabricGuard)}))
        """
    )
    assert out == {"before": [False, False], "built": [True, True], "holds": True, "nanguard_is_a_fabric_guard": True}


def test_the_fabric_guard_alone_drops_a_bad_step_in_a_fabric_loop() -> None:
    out = run(
        """
        from lightning_nanguard import FabricGuard
        guard = FabricGuard(verbose=False)
        fabric = Fabric(accelerator="cpu", devices=1, callbacks=[guard])
        torch.manual_seed(0)
        model, optimizer = fabric.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.tensor([[float("nan"), 1.0]])
        fabric.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        print(json.dumps({"same": same, "skipped": guard.skipped_total,
                          "kinds": [list(e.kinds) for e in guard.events]}))
        """
    )
    assert out["same"] and out["skipped"] == 1
    assert out["kinds"] == [["loss", "grad"]]
