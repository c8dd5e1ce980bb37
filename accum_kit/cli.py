"""``accum-kit`` / ``python -m accum_kit``: one sub-command per job, one way to parse and fail.

Every sub-command module exposes three names:

- ``ARGUMENTS``: a dataclass whose fields are the flags. It is parsed with
  transformers' ``HfArgumentParser`` (so ``--help`` shows every default) and
  its ``__post_init__`` checks the values, raising
  :class:`accum_kit.errors.UsageError` for a bad one;
- ``DESCRIPTION``: the ``--help`` text;
- ``run_command(args) -> int``: does the work and returns the exit code.

:func:`run` is the only place that turns errors into exit codes: a flag
argparse cannot parse, or any :class:`~accum_kit.errors.AccumKitError`, prints
``error: ...`` to stderr and returns 2. Nothing here imports torch, so
``accum-kit plan`` starts without it.
"""

from __future__ import annotations

import importlib
import sys

from .errors import AccumKitError

COMMANDS = {
    "train": ("accum_kit.job.train", "train a causal LM with exact, no_sync gradient accumulation"),
    "plan": ("accum_kit.planning", "effective batch size, steps per epoch, learning-rate scaling, K for a target batch"),
    "bench": ("accum_kit.bench", "step time, communication and memory of sync_each_batch vs no_sync vs raw DDP over K, with the ideal; on one process: accum-kit's loop vs a plain PyTorch loop and the peers"),
    "nodes": ("accum_kit.multinode", "print the accelerate launch line of every machine of a multi-node job (or this SLURM node's)"),
    "verify": ("accum_kit.verify", "check the accumulated gradient against one big batch on one process (tokens, mean-of-means, sum)"),
}


class ArgumentError(Exception):
    """A flag argparse could not parse (unknown, missing, wrong type)."""


def build_parser(arguments: type, prog: str, description: str):
    """An ``HfArgumentParser`` for the dataclass ``arguments`` that raises :class:`ArgumentError` instead of exiting."""
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        def error(self, message):
            raise ArgumentError(message)

    return _Parser(arguments, prog=prog, description=description)


def parse(arguments: type, argv: list[str], prog: str = "accum-kit", description: str = ""):
    """Parse ``argv`` into one validated ``arguments`` instance.

    Raises:
        ArgumentError: unknown flag, bad type or missing value.
        UsageError: a value the dataclass's ``__post_init__`` refused.
    """
    parser = build_parser(arguments, prog, description)
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        raise ArgumentError(f"unrecognized arguments: {' '.join(rest)}")
    return args


def run(name: str, argv: list[str] | None = None) -> int:
    """Run sub-command ``name`` with ``argv``; returns its exit code (2 for bad flags or values)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    module = importlib.import_module(COMMANDS[name][0])
    prog = f"accum-kit {name}"
    tail = []
    if "--" in argv:  # everything after -- is a command line to pass on (accum-kit nodes)
        argv, tail = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    try:
        args = parse(module.ARGUMENTS, argv, prog, module.DESCRIPTION)
        if tail:
            if not hasattr(args, "command"):
                raise ArgumentError(f"unrecognized arguments: -- {' '.join(tail)}")
            args.command = tail
        return module.run_command(args)
    except ArgumentError as exc:
        build_parser(module.ARGUMENTS, prog, module.DESCRIPTION).print_usage(sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except AccumKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _usage() -> str:
    lines = ["usage: accum-kit <command> [flags]   (under accelerate launch: accelerate launch [...] -m accum_kit <command>)", "", "commands:"]
    lines += [f"  {name:8s} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n'accum-kit <command> --help' lists a command's flags.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command; returns its exit code (2 for an unknown command)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
