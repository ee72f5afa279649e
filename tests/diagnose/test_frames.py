"""Which stack frames are the user's code, and how their paths are shown (``lightning_nanguard.diagnose.frames``)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import lightning.pytorch as lp
import pytest
import torch
from torch import nn

import lightning_nanguard
from lightning_nanguard.diagnose import frames
from lightning_nanguard.diagnose.frames import STACK_LIMIT, Frame, UserCode, class_files, display_path, library_dirs

HERE = str(Path(__file__).resolve())
STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__))


class Scaled(nn.Linear):
    pass


class Model(lp.LightningModule):
    pass


class DeeperModel(Model):
    pass


def test_library_dirs_hold_torch_and_lightning_with_a_separator() -> None:
    dirs = library_dirs()
    assert all(d.endswith(os.sep) for d in dirs)
    assert os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "") in dirs
    assert any(os.path.abspath(lp.__file__).startswith(d) for d in dirs)
    assert any(os.path.abspath(frames.__file__).startswith(d) for d in dirs)


PACKAGE_ROOT = Path(lightning_nanguard.__file__).resolve().parent


def test_no_file_of_this_package_is_user_code() -> None:
    code = UserCode()
    user = sorted(str(path.relative_to(PACKAGE_ROOT)) for path in PACKAGE_ROOT.rglob("*.py") if code.is_user(str(path)))
    assert user == []


def test_class_files_skip_torch_lightning_core_and_builtins() -> None:
    assert class_files(nn.Linear) == set()
    assert class_files(object) == set()
    assert class_files(Scaled) == {HERE}  # not torch's linear.py
    assert class_files(DeeperModel) == {HERE}  # not Lightning's LightningModule


def test_class_files_of_a_class_without_a_file() -> None:
    dynamic = type("Dynamic", (nn.Module,), {"__module__": "not_a_real_module"})
    assert class_files(dynamic) == set()


@pytest.mark.parametrize(
    ("path", "root", "shown"),
    [
        ("/work/project/model.py", "/work/project", "model.py"),
        ("/work/project/sub/dir/model.py", "/work/project", os.path.join("sub", "dir", "model.py")),
        ("/work/projectile/model.py", "/work/project", "/work/projectile/model.py"),  # a prefix is not a parent
        ("/usr/lib/other.py", "/work/project", "/usr/lib/other.py"),
    ],
)
def test_display_path(path: str, root: str, shown: str) -> None:
    assert display_path(path, root) == shown


def test_display_path_defaults_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert display_path(str(tmp_path / "a" / "b.py")) == os.path.join("a", "b.py")
    assert display_path("c.py") == "c.py"  # relative paths are read against the working directory


def test_user_code_tells_user_files_from_library_files() -> None:
    code = UserCode()
    assert code.is_user(HERE)
    assert not code.is_user(torch.__file__)
    assert not code.is_user(frames.__file__)
    assert not code.is_user(contextlib.__file__)  # the standard library
    assert not code.is_user("<string>") and not code.is_user("<frozen importlib._bootstrap>")


def test_packages_installed_under_the_standard_library_are_user_code() -> None:
    code = UserCode(skip_dirs=())
    assert code.is_user(os.path.join(STDLIB_DIR, "site-packages", "somepkg", "model.py"))
    assert code.is_user(os.path.join(STDLIB_DIR, "dist-packages", "somepkg", "model.py"))
    assert not code.is_user(os.path.join(STDLIB_DIR, "json", "decoder.py"))


def test_root_and_extra_files_are_user_code_inside_library_dirs() -> None:
    library = (os.path.join(os.path.dirname(HERE), ""),)
    code = UserCode(root_files=[HERE], skip_dirs=library)
    assert code.is_user(HERE)
    elsewhere = os.path.join(os.path.dirname(HERE), "other.py")
    assert not code.is_user(elsewhere)
    assert code.is_user(elsewhere, extra_files=frozenset({elsewhere}))


def test_relative_file_names_match_root_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = UserCode(root_files=[str(tmp_path / "model.py")], skip_dirs=(str(tmp_path) + os.sep,))
    assert code.is_user("model.py")
    assert not code.is_user("other.py")


def _outer(limit: int) -> tuple[list[Frame], int]:
    return _inner(limit), sys._getframe().f_lineno


def _inner(limit: int) -> list[Frame]:
    return UserCode().frames(sys._getframe(), limit=limit)


def test_frames_are_the_innermost_user_frames_first() -> None:
    frames, outer_line = _outer(limit=2)
    assert [frame.function for frame in frames] == ["_inner", "_outer"]
    assert all(frame.path == HERE for frame in frames)
    assert frames[1].line == outer_line
    assert frames[0].line == _inner.__code__.co_firstlineno + 1


def test_frames_skip_library_frames_and_stop_at_the_limit() -> None:
    seen: list[list[Frame]] = []
    net = nn.Sequential(nn.Linear(1, 1))
    net.register_forward_hook(lambda *_: seen.append(UserCode().frames(sys._getframe(), limit=3)))
    net(torch.ones(1, 1))
    (frames,) = seen
    assert len(frames) == 3
    assert (
        frames[0].function == "<lambda>"
        and frames[1].function == "test_frames_skip_library_frames_and_stop_at_the_limit"
    )
    assert all(not frame.path.startswith(library_dirs()) for frame in frames)  # torch's module call is skipped
    assert len(UserCode().frames(sys._getframe())) <= STACK_LIMIT
    assert UserCode().frames(None) == []
