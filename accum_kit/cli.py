"""``accum-kit`` / ``python -m accum_kit``: one sub-command per job.

Each sub-command lives in its own module with a ``main(argv) -> int``; this
file only dispatches, so ``accum-kit train --help`` shows the job's own flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "train": ("accum_kit.train", "train a causal LM with exact, no_sync gradient accumulation"),
    "plan": ("accum_kit.planning", "effective batch size, steps per epoch, learning-rate scaling, K for a target batch"),
    "bench": ("accum_kit.bench", "step time, communication and memory of sync_each_batch vs no_sync vs raw DDP over K, with the ideal"),
    "verify": ("accum_kit.verify", "check the accumulated gradient against one big batch on one process (tokens, mean-of-means, sum)"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` instead of exiting, so ``main`` returns 2."""

    def error(self, message):
        raise ArgumentError(message)


class ArgumentError(Exception):
    """A flag argparse could not parse (unknown, missing, wrong type)."""


def parse_args(parser: ArgumentParser, argv: list[str] | None):
    """Parse ``argv``; on a bad flag print usage and ``error: ...`` to stderr and return None."""
    try:
        return parser.parse_args(argv)
    except ArgumentError as exc:
        parser.print_usage(sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return None


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
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
