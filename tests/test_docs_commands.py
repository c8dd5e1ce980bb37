"""Every command the README and the docs show must still parse, and the cheap ones must run.

What is checked. Every fenced ``bash``/``sh``/``shell``/``console`` block of
``README.md``, ``docs/*.md`` and ``benchmarks/README.md`` is split into simple
commands (lines joined at a trailing ``\\``, ``#`` comments dropped, split at
``&&``, ``||``, ``;`` and ``|``; in ``console`` blocks only ``$ `` lines).
Those that invoke the project are checked without running the job:

- ``accum-kit <cmd> ...`` and ``python -m accum_kit <cmd> ...``: the
  sub-command exists in ``accum_kit.cli.COMMANDS`` and its flags parse with
  that command's own ``HfArgumentParser`` dataclass, ``__post_init__``
  included (``accum_kit.cli.parse``, what the command line itself runs). After
  ``--`` (``accum-kit nodes``) comes a script command line, checked like one
  under ``accelerate launch``.
- ``accelerate launch ... -m accum_kit <cmd> ...`` and
  ``accelerate launch ... examples/<script>.py ...``: the launcher's own flags
  parse with Accelerate's ``launch_command_parser``, the ``--config_file`` it
  names exists, and the rest is checked as above; a script's flags parse with
  its ``parse_args(argv)`` (or, for a script that only calls
  ``accum_kit.cli.run("<cmd>")`` such as ``examples/train.py``, with that
  sub-command's parser).
- ``pip install -e ".[extra]"``: every extra exists in ``pyproject.toml``.

Rules for what the page's reader makes first. Commands are parsed with the
repository root as the working directory, so relative config and script paths
resolve as they do for a reader in a clone. An output path
(``--output_dir``, ``--trace_dir``, ``--json FILE``) need not exist: the
parsers only check that it could be created. An input file the docs tell the
reader to make, or that an earlier command of the docs writes, and that a
parser opens (today ``--train_file corpus.txt`` in docs/whatif.md and
``--train_file runs/clm/sample_text.txt`` in docs/run_clm.md) is listed in
``STAND_INS``: the test writes a small stand-in and passes its path
instead. Any other missing input file fails the check, so a typo in a path
is caught. A shell command substitution ``$(...)`` (e.g. the GPU count
``$(nvidia-smi -L | wc -l)``) stands for a count and is replaced by ``2``.

What runs. ``accum-kit plan`` without ``--from_profile`` (no torch, no files),
``accum-kit nodes`` without ``--exec``/``--from_slurm`` (whose printed lines
must appear in the same block: the docs show its output) and ``--help`` run
in-process through ``accum_kit.cli.main`` and must exit 0 with output.

``test_checker_rejects_broken_commands`` shows that the checker can fail: it
breaks a copy of real commands (a misspelled flag, a bad value, an unknown
sub-command, a missing config or script) and expects a problem for each.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from accum_kit import cli
from accum_kit.errors import AccumKitError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
#: Input files the docs ask the reader to make (or make in an earlier command) and that a parser opens.
_TEXT = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n"
STAND_INS = {"corpus.txt": _TEXT, "runs/clm/sample_text.txt": _TEXT}  # docs/whatif.md, docs/run_clm.md make them
OPERATORS = {"&&", "||", ";", "|"}


@dataclass
class Command:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the command's first line
    argv: list[str]
    block: list[str]  # the block's lines (to find a command's shown output)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


# --------------------------------------------------------------------------- extraction


def shell_blocks(text: str):
    """``(language, first_line_number, lines)`` of every fenced shell block in markdown ``text``."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in SHELL_FENCES:
            yield lang, i + 2, lines[i + 1:j]
        i = j + 1


def logical_lines(lang: str, first: int, lines: list[str]):
    """``(line_number, text)`` of each command in a block: continuations joined, comments and output dropped."""
    i = 0
    while i < len(lines):
        start, text = first + i, lines[i]
        if lang == "console":
            if not text.lstrip().startswith("$ "):
                i += 1
                continue
            text = text.lstrip()[2:]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        if text.strip() and not text.lstrip().startswith("#"):
            yield start, text


def simple_commands(text: str) -> list[list[str]]:
    """Split one shell line into simple commands (argv lists); ``$(...)`` becomes ``2``."""
    text = re.sub(r"\$\([^()]*\)", "2", text)
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok in OPERATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [c for c in out if c]


def commands_in(page: Path, text: str | None = None) -> list[Command]:
    """Every simple command in the shell blocks of ``page`` (or of ``text``, shown as ``page``)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    rel = str(page.relative_to(ROOT)) if page.is_absolute() else str(page)
    found = []
    for lang, first, lines in shell_blocks(text):
        for line_no, line in logical_lines(lang, first, lines):
            for argv in simple_commands(line):
                while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value prefixes
                    argv = argv[1:]
                if argv:
                    found.append(Command(rel, line_no, argv, lines))
    return found


def kind(argv: list[str]) -> str | None:
    """Which project entry point ``argv`` invokes: 'cli', 'launch', 'pip' or None (not the project)."""
    if argv[0] == "accum-kit":
        return "cli"
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "accum_kit"]:
        return "cli"
    if argv[:2] == ["accelerate", "launch"]:
        return "launch"
    if argv[0] in ("pip", "pip3") and "install" in argv:
        return "pip"
    return None


def cli_argv(argv: list[str]) -> list[str]:
    """The arguments after ``accum-kit`` / ``python -m accum_kit``."""
    return argv[1:] if argv[0] == "accum-kit" else argv[3:]


# --------------------------------------------------------------------------- checking


def _stand_in(path: str, tmp: Path) -> str:
    if path in STAND_INS and not (ROOT / path).exists():
        target = tmp / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(STAND_INS[path], encoding="utf-8")
        return str(target)
    return path


def check_subcommand(args: list[str], tmp: Path) -> list[str]:
    """Problems of ``accum-kit <args>``: unknown sub-command, flags or values its parser refuses."""
    if not args:
        return ["no sub-command"]
    name, rest = args[0], [_stand_in(a, tmp) for a in args[1:]]
    if name not in cli.COMMANDS:
        return [f"unknown sub-command {name!r} (known: {sorted(cli.COMMANDS)})"]
    tail = []
    if "--" in rest:
        rest, tail = rest[: rest.index("--")], rest[rest.index("--") + 1:]
    module = importlib.import_module(cli.COMMANDS[name][0])
    problems = []
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args_ = cli.parse(module.ARGUMENTS, rest, f"accum-kit {name}")
    except SystemExit as exc:  # --help
        if exc.code not in (0, None):
            problems.append(f"accum-kit {name}: parser exited {exc.code}")
        return problems
    except (cli.ArgumentError, AccumKitError) as exc:
        return [f"accum-kit {name}: {exc}"]
    if tail:
        if not hasattr(args_, "command"):
            return [f"accum-kit {name} takes nothing after --"]
        problems += check_script(tail, tmp)
    return problems


_SCRIPT_PARSERS: dict[Path, object] = {}


def script_parser(path: Path):
    """``argv -> None`` parser of an example script (raises on bad flags), or a problem string."""
    if path in _SCRIPT_PARSERS:
        return _SCRIPT_PARSERS[path]
    source = path.read_text(encoding="utf-8")
    m = re.search(r"\brun\(\s*[\"'](\w+)[\"']\s*\)", source)
    if m and "def parse_args" not in source:  # a thin wrapper around accum_kit.cli.run("<cmd>")
        parser = ("cli", m.group(1))
    else:
        spec = importlib.util.spec_from_file_location(f"_docs_example_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # the scripts guard their work with `if __name__ == "__main__"`
        candidates = [module] + [sys.modules[getattr(v, "__module__", "")] for v in vars(module).values()
                                 if callable(v) and getattr(v, "__module__", "").startswith("accum_kit")]
        found = next((c.parse_args for c in candidates if callable(getattr(c, "parse_args", None))), None)
        parser = ("argparse", found) if found else f"{path.relative_to(ROOT)} has no parse_args(argv)"
    _SCRIPT_PARSERS[path] = parser
    return parser


def check_script(argv: list[str], tmp: Path) -> list[str]:
    """Problems of ``<script>.py [flags]`` as a launcher would start it."""
    script, rest = argv[0], [_stand_in(a, tmp) for a in argv[1:]]
    path = ROOT / script
    if not script.endswith(".py"):
        return [f"{script}: not a Python script"]
    if not path.is_file():
        return [f"{script}: no such script in the repository"]
    parser = script_parser(path)
    if isinstance(parser, str):
        return [parser]
    if parser[0] == "cli":
        return check_subcommand([parser[1], *rest], tmp)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            parser[1](rest)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return [f"{script}: {err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else exc}"]
    return []


_LAUNCH_PARSER = None


def check_launch(argv: list[str], tmp: Path) -> list[str]:
    """Problems of ``accelerate launch [launcher flags] (-m accum_kit <cmd> | <script>.py) [flags]``."""
    global _LAUNCH_PARSER
    if _LAUNCH_PARSER is None:
        from accelerate.commands.launch import launch_command_parser

        _LAUNCH_PARSER = launch_command_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = _LAUNCH_PARSER.parse_args(argv[2:])
    except SystemExit:
        return [f"accelerate launch: {err.getvalue().strip().splitlines()[-1]}"]
    problems = []
    if args.config_file is not None and not (ROOT / args.config_file).is_file():
        problems.append(f"--config_file {args.config_file}: no such file in the repository")
    with launched_as(args):
        if args.module:
            if args.training_script != "accum_kit":
                return problems + [f"-m {args.training_script}: not the accum_kit package"]
            return problems + check_subcommand(list(args.training_script_args), tmp)
        return problems + check_script([args.training_script, *args.training_script_args], tmp)


@contextlib.contextmanager
def launched_as(args):
    """The variables ``accelerate launch`` sets that the commands' flags depend on, set while checking: for an
    FSDP or DeepSpeed config its engine's (the bench's ``--accumulation_policies`` needs FSDP2, ``--zero_stages``
    DeepSpeed), and ``WORLD_SIZE``, the processes it starts (``--num_processes``, else the config's, else 1: the
    bench compares DDP's modes on 2 or more, its one-process arms on 1)."""
    import yaml

    config = ROOT / args.config_file if args.config_file else None
    settings = yaml.safe_load(config.read_text()) if config and config.is_file() else {}
    var = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}.get(settings.get("distributed_type"))
    if args.use_fsdp:
        var = "ACCELERATE_USE_FSDP"
    if args.use_deepspeed:
        var = "ACCELERATE_USE_DEEPSPEED"
    world = args.num_processes or settings.get("num_processes") or 1
    changes = {"WORLD_SIZE": str(world), **({var: "true"} if var else {})}
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_pip(argv: list[str]) -> list[str]:
    """Extras named in ``pip install -e ".[a,b]"`` exist in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib  # Python 3.11+
        extras = tomllib.loads(text)["project"]["optional-dependencies"]
    except ModuleNotFoundError:  # 3.10: the extras are the keys of that one table
        table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        extras = re.findall(r"^([\w-]+)\s*=", table, flags=re.M)
    problems = []
    for arg in argv:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if m:
            problems += [f"pip extra [{e}] is not in pyproject.toml" for e in m.group(1).split(",") if e not in extras]
    return problems


def check(cmd: Command, tmp: Path) -> list[str]:
    """Every problem of one command (empty: it parses)."""
    k = kind(cmd.argv)
    if k == "cli":
        return check_subcommand(cli_argv(cmd.argv), tmp)
    if k == "launch":
        return check_launch(cmd.argv, tmp)
    if k == "pip":
        return check_pip(cmd.argv)
    return []


# --------------------------------------------------------------------------- tests

ALL = [c for page in PAGES if page.exists() for c in commands_in(page)]
PROJECT = [c for c in ALL if kind(c.argv) is not None]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)


def test_extraction_finds_every_form():
    """The extractor sees all four ways the docs invoke the project (so a format change cannot empty it)."""
    forms = {"accum-kit": 0, "python -m accum_kit": 0, "launch -m accum_kit": 0, "launch script": 0}
    for c in PROJECT:
        if c.argv[0] == "accum-kit":
            forms["accum-kit"] += 1
        elif kind(c.argv) == "cli":
            forms["python -m accum_kit"] += 1
        elif kind(c.argv) == "launch":
            forms["launch -m accum_kit" if "-m" in c.argv else "launch script"] += 1
    assert all(forms.values()), forms
    assert sum(kind(c.argv) != "pip" for c in PROJECT) >= 40, len(PROJECT)
    # The quickstart's first line (README's first bash block) is among them.
    assert any(c.page == "README.md" and c.argv[:2] == ["accelerate", "launch"] and "examples/train.py" in c.argv
               for c in PROJECT)


@pytest.mark.parametrize("cmd", PROJECT, ids=[f"{c.where}:{c.argv[0]}" for c in PROJECT])
def test_command_parses(cmd, tmp_path):
    problems = check(cmd, tmp_path)
    assert not problems, f"{cmd.where}: {shlex.join(cmd.argv)}\n  " + "\n  ".join(problems)


def _runnable(c: Command) -> bool:
    if kind(c.argv) != "cli":
        return False
    args = cli_argv(c.argv)
    if "--help" in args or "-h" in args:
        return True
    if args[:1] == ["plan"]:
        return "--from_profile" not in args
    if args[:1] == ["nodes"]:
        return "--exec" not in args and "--from_slurm" not in args
    return False


RUNNABLE = [c for c in PROJECT if _runnable(c)]


def test_some_commands_run():
    assert len(RUNNABLE) >= 5, [c.where for c in RUNNABLE]


@pytest.mark.parametrize("cmd", RUNNABLE, ids=[c.where for c in RUNNABLE])
def test_cheap_command_runs(cmd, capsys):
    args = cli_argv(cmd.argv)
    try:
        rc = cli.main(args)
    except SystemExit as exc:  # --help exits from argparse
        rc = exc.code or 0
    out = capsys.readouterr()
    assert rc == 0, f"{cmd.where}: exit {rc}: {out.err}"
    assert out.out.strip(), f"{cmd.where}: printed nothing"
    if "--help" in args:
        assert "--" in out.out
    if "--json" in args:
        json.loads(out.out)
    if args[0] == "nodes":  # the docs show what it prints right below it
        shown = {line.strip() for line in cmd.block}
        missing = [line for line in out.out.splitlines() if line.strip() and line.strip() not in shown]
        assert not missing, f"{cmd.where}: the block does not show this output of the command: {missing}"


BROKEN = [  # (how to break a real command, text that must appear in the problem)
    (lambda a: [x.replace("--per_device_train_batch_size", "--per_device_batch_size") for x in a], "per_device"),
    (lambda a: [x.replace("cpu_ddp.yaml", "cpu_dpp.yaml") for x in a], "cpu_dpp.yaml"),
    (lambda a: [x.replace("--config_file", "--config_fle") for x in a], "config_fle"),
]


def test_checker_rejects_broken_commands(tmp_path):
    """Broken copies of real commands fail: the checks above can fail."""
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    launch = next(c for c in commands_in(readme) if kind(c.argv) == "launch" and "-m" in c.argv
                  and "--per_device_train_batch_size" in c.argv)
    for breaker, needle in BROKEN:
        problems = check(Command("copy", 0, breaker(launch.argv), []), tmp_path)
        assert any(needle in p for p in problems), (needle, problems)
    # A misspelled flag in a copy of the README is found by extraction and parsing alike.
    broken = text.replace("--gradient_accumulation_steps 8", "--gradient_accumulations_steps 8", 1)
    assert broken != text
    bad = [c for c in commands_in(Path("README.md"), broken) if check(c, tmp_path)]
    assert len(bad) == 1 and "gradient_accumulations_steps" in " ".join(check(bad[0], tmp_path))
    # A value the dataclass's __post_init__ refuses; an unknown sub-command; a missing script; a bad script flag.
    assert any("--gradient_accumulation_steps" in p
               for p in check_subcommand(["train", "--gradient_accumulation_steps", "0"], tmp_path))
    assert any("unknown sub-command" in p for p in check_subcommand(["trian"], tmp_path))
    assert check_script(["examples/no_such.py"], tmp_path)
    assert any("max_steps" in p for p in check_script(["examples/custom_loop.py", "--max_steps", "3"], tmp_path))
    assert check_subcommand(["train", "--train_file", "missing_corpus.txt"], tmp_path)
    assert check_pip(["pip", "install", "-e", ".[trackin]"])
