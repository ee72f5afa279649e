"""``configs/nanguard.yaml`` and NanGuard under a real LightningCLI of both Lightning namespaces."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_nanguard import NanGuard

ROOT = Path(__file__).resolve().parents[2]
NANGUARD_YAML = ROOT / "configs" / "nanguard.yaml"
NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]


def _defaults() -> dict[str, Any]:
    """Every ``NanGuard.__init__`` argument and its default."""
    parameters = list(inspect.signature(NanGuard.__init__).parameters.values())[1:]  # drop self
    assert all(p.default is not inspect.Parameter.empty for p in parameters), "every argument needs a default"
    return {p.name: p.default for p in parameters}


def _nanguard_entry(config: dict[str, Any]) -> dict[str, Any]:
    entries = [c for c in config["trainer"]["callbacks"] if c["class_path"] == "lightning_nanguard.NanGuard"]
    assert len(entries) == 1
    entry: dict[str, Any] = entries[0]
    return entry


def _guards(trainer: Any) -> list[NanGuard]:
    return [callback for callback in trainer.callbacks if isinstance(callback, NanGuard)]


def _cli(namespace: str, args: list[str]) -> Any:
    """A LightningCLI of ``namespace`` built from ``args`` without running a subcommand."""
    cli_module = importlib.import_module(f"{namespace}.cli")
    boring = importlib.import_module(f"{namespace}.demos.boring_classes")
    core = importlib.import_module(namespace)
    return cli_module.LightningCLI(
        core.LightningModule,
        boring.BoringDataModule,
        subclass_mode_model=True,
        save_config_callback=None,
        seed_everything_default=False,
        run=False,
        args=args,
    )


def _user_config(tmp_path: Path, namespace: str) -> Path:
    """A user's own tiny config: a BoringModel, a two-step trainer and a callback of their own."""
    path = tmp_path / "user.yaml"
    config = {
        "model": {"class_path": f"{namespace}.demos.boring_classes.BoringModel"},
        "trainer": {
            "max_steps": 2,
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": f"{namespace}.callbacks.LearningRateMonitor"}],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when ``args=`` is given while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr("sys.argv", ["train.py"])


# ---------------------------------------------------------------------- the YAML file itself


def test_yaml_lists_every_init_argument_with_its_default() -> None:
    entry = _nanguard_entry(yaml.safe_load(NANGUARD_YAML.read_text()))
    init_args = entry["init_args"]
    defaults = _defaults()
    missing = sorted(set(defaults) - set(init_args))
    unknown = sorted(set(init_args) - set(defaults))
    assert not missing, f"configs/nanguard.yaml lacks NanGuard arguments {missing}"
    assert not unknown, f"configs/nanguard.yaml has arguments NanGuard does not take: {unknown}"
    for name, default in defaults.items():
        assert init_args[name] == default and type(init_args[name]) is type(default), (
            f"configs/nanguard.yaml: `{name}: {init_args[name]!r}` but the default is {default!r}"
        )
    assert list(init_args) == list(defaults), "keep the arguments in signature order"


def test_yaml_explains_every_argument_in_a_comment() -> None:
    lines = NANGUARD_YAML.read_text().splitlines()
    for name in _defaults():
        (number,) = [i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:")]
        assert lines[number - 1].strip().startswith("#"), f"no comment right above `{name}:`"


# ---------------------------------------------------------------------- parsing with LightningCLI


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_cli_adds_nanguard_from_the_yaml(namespace: str, tmp_path: Path) -> None:
    user_config = _user_config(tmp_path, namespace)
    cli = _cli(
        namespace,
        [
            "--config", str(user_config),
            "--config", str(NANGUARD_YAML),
            "--trainer.callbacks.init_args.max_consecutive_bad_steps=3",
            "--trainer.callbacks.init_args.action=warn",
            "--trainer.callbacks.init_args.remedies=[quarantine, clip_grad]",
        ],
    )  # fmt: skip
    (guard,) = _guards(cli.trainer)
    changed = {"max_consecutive_bad_steps": 3, "action": "warn", "remedies": ["quarantine", "clip_grad"]}
    expected = {**_defaults(), **changed}
    reference = NanGuard(**expected)  # compare as stored: __init__ may normalise (e.g. None -> [])
    missing = object()
    assert {name: getattr(guard, name, missing) for name in expected} == {
        name: getattr(reference, name, missing) for name in expected
    }
    assert {name: getattr(guard, name) for name in changed} == changed
    # The CLI-built guard really runs in that namespace's Trainer.
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2
    assert guard.log_dir is not None
    assert guard.events == []


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_later_callbacks_list_replaces_the_yaml_one(namespace: str, tmp_path: Path) -> None:
    """What the YAML's header warns about: put configs/nanguard.yaml last."""
    other = tmp_path / "other.yaml"
    callbacks = [{"class_path": f"{namespace}.callbacks.LearningRateMonitor"}]
    other.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    model = ["--model", f"{namespace}.demos.boring_classes.BoringModel", "--trainer.logger=false"]
    assert _guards(_cli(namespace, [*model, "--config", str(other), "--config", str(NANGUARD_YAML)]).trainer)
    assert not _guards(_cli(namespace, [*model, "--config", str(NANGUARD_YAML), "--config", str(other)]).trainer)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_cli_append_on_the_command_line(namespace: str, tmp_path: Path) -> None:
    user_config = _user_config(tmp_path, namespace)
    cli = _cli(
        namespace,
        [
            "--config", str(user_config),
            "--trainer.callbacks+=lightning_nanguard.NanGuard",
            "--trainer.callbacks.action=raise",
        ],
    )  # fmt: skip
    (guard,) = _guards(cli.trainer)
    assert guard.action == "raise"
    names = [type(callback).__name__ for callback in cli.trainer.callbacks]
    assert "LearningRateMonitor" in names  # the user's own callback is kept


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("action", "skp", ["'skip'", "'raise'", "'warn'"]),
        ("check_bn_stats", "maybe", ["bool"]),
        ("max_bisect_passes", "many", ["int"]),
        ("remedies", ["clip_grad", "quarantin"], ["'quarantine'", "'lr_backoff'"]),
    ],
)
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_cli_typo_names_the_argument_and_the_allowed_values(
    namespace: str,
    option: str,
    value: str | list[str],
    allowed: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = yaml.safe_load(NANGUARD_YAML.read_text())
    _nanguard_entry(config)["init_args"][option] = value
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        _cli(namespace, ["--model", f"{namespace}.demos.boring_classes.BoringModel", "--config", str(bad)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    typo = value if isinstance(value, str) else value[-1]
    assert f'"{option}"' in err and f"Got value: {typo}" in err
    for word in allowed:
        assert word in err
