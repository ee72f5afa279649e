"""Every code block of the README, the docs pages, examples/README.md and studies/README.md runs or is checked.

- ``python`` blocks are compiled; their imports are executed; a block whose every free name is a
  builtin or one of ``GIVEN`` (a tiny model, optimizer, loader, loss) is executed whole, in a
  temporary working directory.
- ``bash`` blocks are split into commands (``shlex``: quotes, comments, ``\\`` continuations), and
  each command is checked against what exists: scripts and files it names, ``pip install`` targets
  against ``pyproject.toml``, environment variables against the code that reads them, and the flags
  and sub-commands of a command against its ``--help`` (``python -m studies.*`` and ``benchmarks.*``
  against the module's source: the tests do not import those). A command no rule knows fails the
  test: add a rule below.
- ``text``, ``yaml`` and ``console`` blocks are output or included files, not commands.

The README's own links (files, images and ``#anchors``) must resolve too.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.metadata
import importlib.util
import io
import itertools
import re
import runpy
import shlex
import subprocess
import symtable
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / folder / "README.md" for folder in ("examples", "studies")),
        *(ROOT / "docs").rglob("*.md"),
    ],
)
DISTRIBUTION = importlib.metadata.metadata("lightning-nanguard")  # what pyproject.toml declares, as installed
NOT_COMMANDS = {"text", "yaml", "console"}
# Python blocks that are compiled and whose imports run, but that are not executed whole: the reason.
NOT_RUN = {
    "ModelParallelStrategy(": "needs 4 processes (tests/integration/test_sharded.py runs the guard so)",
}
# File names in commands that stand for the reader's own files.
PLACEHOLDER_FILES = {"train.py", "my_config.yaml"}
# Environment variables a command may set, and the module that reads each.
ENV_VARS = {
    "NANGUARD": "lightning_nanguard/entry_points.py",
    "NANGUARD_ARGS": "lightning_nanguard/entry_points.py",
    "NANGUARD_DIR": "lightning_nanguard/fabric/frontend.py",
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)```(\S*)", lines[i])
        if not match:
            i += 1
            continue
        indent, lang, start = match.group(1), match.group(2), i + 1
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        yield Block(page, start, lang, "\n".join(body) + "\n")


BLOCKS = [block for page in PAGES for block in _blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]


def test_every_block_has_a_known_language() -> None:
    unknown = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in {"python", "bash"} | NOT_COMMANDS]
    assert not unknown, f"code blocks this test does not know how to check: {unknown}"
    assert len(PYTHON) >= 3 and len(BASH) >= 5  # the scan finds the blocks at all


# --- Python ---------------------------------------------------------------------------------------


def _free_names(code: str) -> set[str]:
    """Names a snippet reads before (or without) defining them; builtins excluded.

    Top-level statements in order (``model, opt = fabric.setup(model, opt)`` reads ``model`` first);
    a function's globals from its symbol table, needed unless the snippet defines them somewhere.
    """
    tree = ast.parse(code)
    defined: set[str] = set()
    free: set[str] = set()
    scopes = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
    for statement in tree.body:
        loads: set[str] = set()
        stores: set[str] = set()
        todo: list[ast.AST] = [statement]
        while todo:
            node = todo.pop()
            if isinstance(node, scopes) and node is not statement:
                continue
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                stores.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node is statement:
                stores.add(node.name)
                todo.extend(node.decorator_list)
                continue
            todo.extend(ast.iter_child_nodes(node))
        # an assignment reads its value before it binds; a loop or `with` binds before its body reads
        simple = isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Expr)
        free |= loads - defined - (set() if simple else stores)
        defined |= stores
    nested: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            nested.update(s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced())
            walk(child)

    walk(symtable.symtable(code, "<snippet>", "exec"))
    return (free | (nested - defined)) - set(dir(builtins))


def _given() -> dict[str, Any]:
    """The objects a snippet may take as given: a tiny regression model, its optimizer and data."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loader": DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4),
        "loss_fn": loss_fn,
        "loss": torch.tensor(0.25),
    }


GIVEN = {"model", "optimizer", "loader", "loss_fn", "loss"}


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = compile(block.code, block.id, "exec")
    tree = ast.parse(block.code)
    imports = ast.Module(body=[n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[])
    exec(compile(imports, block.id, "exec"), {})  # every import of the snippet resolves
    free = _free_names(block.code)
    skip = [reason for marker, reason in NOT_RUN.items() if marker in block.code]
    if skip or not free <= GIVEN:
        return  # compiled and imported; the names it takes from the reader's code are {free - GIVEN}
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__snippet__", **{k: v for k, v in _given().items() if k in free}}
    exec(code, namespace)


def test_snippets_are_run_where_they_can_be() -> None:
    """The snippets this test runs whole (not only compiles): at least the three self-contained ones."""
    run = [b.id for b in PYTHON if _free_names(b.code) <= GIVEN and not any(m in b.code for m in NOT_RUN)]
    assert len(run) >= 3, run


# --- shell commands -------------------------------------------------------------------------------


def _commands(code: str) -> Iterator[list[str]]:
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def _help_of(run: Callable[[], object]) -> str:
    """What ``run`` prints for ``--help`` (argparse exits 0 after printing)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code in (0, None), out.getvalue()
    return out.getvalue()


def _script_help(script: Path) -> str:
    argv = sys.argv
    sys.argv = [str(script), "--help"]
    try:
        return _help_of(lambda: runpy.run_path(str(script), run_name="__main__"))
    finally:
        sys.argv = argv


def _check_arguments(arguments: list[str], help_text: str, what: str) -> None:
    """Each ``--flag`` and each bare word that is not a path/placeholder appears in ``help_text``."""
    for word in arguments:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert re.search(re.escape(flag) + r"(?![\w-])", help_text), f"{what}: {flag} is not in its --help"


def _check_pip(arguments: list[str]) -> None:
    assert arguments[0] == "install", arguments
    for target in arguments[1:]:
        if target.startswith("-"):
            continue
        match = re.fullmatch(r"\.(?:\[(?P<extra>[\w,-]+)\])?", target)
        if match:
            extras = match.group("extra")
            for extra in extras.split(",") if extras else []:
                assert extra in DISTRIBUTION.get_all("Provides-Extra"), f"pip install {target}: no extra {extra!r}"
            continue
        match = re.fullmatch(r"(?P<name>[\w.-]+) @ git\+https://github\.com/<owner>/(?P<repo>[\w.-]+)", target)
        assert match, f"pip install {target!r}: neither '.' nor the git URL form"
        name = DISTRIBUTION["Name"]
        assert match.group("name") == name, f"the package is {name!r}, not {match.group('name')!r}"
        assert match.group("repo") == ROOT.name or match.group("repo") == "lightning_nanguard"


def _check_module_command(module: str, arguments: list[str]) -> None:
    """``python -m studies.<name>`` or ``benchmarks.<name>``: the module exists and names each option and choice.

    Read, not run: the tests import neither the studies nor the benchmarks. Numbers and paths are values.
    """
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    assert path.is_file(), f"python -m {module}: no such module"
    source = path.read_text(encoding="utf-8")
    for word in arguments:
        if word.startswith("--"):
            word = word.split("=", 1)[0]
        elif "/" in word or re.fullmatch(r"[-+]?[\d.]+(?:e[-+]?\d+)?", word):
            continue
        assert re.search(r"[\"']" + re.escape(word) + r"[\"']", source), f"python -m {module}: {word!r} is not in it"


def _check_python(arguments: list[str]) -> None:
    if arguments[:2] == ["-m", "lightning_nanguard"]:
        from lightning_nanguard.__main__ import main

        command = arguments[2]
        help_text = _help_of(lambda: main([command, "--help"]))
        _check_arguments(arguments[3:], help_text, f"python -m lightning_nanguard {command}")
        return
    if arguments[0] == "-m" and arguments[1].split(".")[0] in ("studies", "benchmarks"):
        _check_module_command(arguments[1], arguments[2:])
        return
    script, rest = arguments[0], arguments[1:]
    if script in PLACEHOLDER_FILES:  # the reader's LightningCLI script: the files it is given must exist
        for previous, word in itertools.pairwise(rest):
            if previous == "--config" and word not in PLACEHOLDER_FILES:
                assert (ROOT / word).is_file(), f"--config {word}: no such file"
        for word in rest:
            if "lightning_nanguard." in word:  # a class path given on the command line
                module, _, name = word.split("=", 1)[-1].rpartition(".")
                assert hasattr(importlib.import_module(module), name), word
        return
    path = ROOT / script
    assert path.is_file(), f"python {script}: no such script"
    source = path.read_text(encoding="utf-8")
    if "LightningCLI" in source:  # the demo: tests/integration/test_demo.py runs it; its configs must exist
        for previous, word in itertools.pairwise(rest):
            if previous == "--config":
                assert (ROOT / word).is_file(), f"--config {word}: no such file"
        return
    help_text = _script_help(path)
    _check_arguments(rest, help_text, script)
    for word in rest:
        if not word.startswith("-"):
            assert word in help_text, f"{script}: {word!r} is not one of its choices"


def _check_executable(name: str, arguments: list[str]) -> None:
    executable = Path(sys.executable).parent / name
    assert executable.exists(), f"{name} is not installed next to {sys.executable}"
    subcommand = [arguments[0]] if arguments and not arguments[0].startswith("-") else []
    result = subprocess.run(
        [str(executable), *subcommand, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    _check_arguments(arguments[len(subcommand) :], result.stdout + result.stderr, name)


def _check_litgpt(arguments: list[str]) -> None:
    assert importlib.metadata.entry_points(group="lightning.fabric.callbacks_factory").select(name="nanguard"), (
        "the nanguard entry point behind NANGUARD=1 is not installed"
    )
    if importlib.util.find_spec("litgpt") is None:
        pytest.skip("litgpt is not installed here (scripts/test.sh installs it): its recipe names are not checked")
    recipe = arguments[0]  # finetune_lora -> litgpt.finetune.lora, pretrain -> litgpt.pretrain
    assert importlib.util.find_spec("litgpt." + recipe.replace("_", ".", 1)) is not None, f"litgpt has no {recipe}"


def _check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before the command
        name = words.pop(0).split("=", 1)[0]
        assert name in ENV_VARS, f"{name} is not an environment variable the package reads"
        assert name in (ROOT / ENV_VARS[name]).read_text(encoding="utf-8")
    command, arguments = words[0], words[1:]
    if command == "bash":
        assert (ROOT / arguments[0]).is_file(), f"bash {arguments[0]}: no such script"
    elif command == "pip":
        _check_pip(arguments)
    elif command in ("python", ".venv/bin/python"):
        _check_python(arguments)
    elif command.startswith(".venv/bin/"):
        _check_executable(command.removeprefix(".venv/bin/"), arguments)
    elif command == "litgpt":
        _check_litgpt(arguments)
    else:
        pytest.fail(f"no rule checks the command {command!r}: add one to tests/test_readme.py")


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_shell_block(block: Block) -> None:
    commands = list(_commands(block.code))
    assert commands, f"{block.id}: an empty bash block"
    for words in commands:
        _check_command(words)


# --- the README's links ---------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text_outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text_outside_code, flags=re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text_outside_code)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README links to {path}, which does not exist"
        else:
            assert anchor in anchors, f"README links to #{anchor}, which is no heading of it"


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for page in sorted((ROOT / "docs").rglob("*.md")):  # it links to every page of the site
        if page.name in ("index.md", "changelog.md"):  # the site's home; CHANGELOG.md, linked as such
            continue
        assert f"({page.relative_to(ROOT).as_posix()}" in text, f"README does not link to {page.relative_to(ROOT)}"
    assert "(CHANGELOG.md)" in text
    assert ".venv/bin/mkdocs serve" in text
