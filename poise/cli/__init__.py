"""`poise` command line: one subcommand per module in this package; wiring only.

Each subcommand module exposes ``HELP`` (its line in ``poise --help``), ``DESCRIPTION`` (the
top of its own ``--help``), ``add_arguments(parser)`` and ``run(args)`` (called with the parsed
namespace, returning an exit code); ``build_parser`` is the one place that turns them into
a subparser, so the modules hold options and work, not argparse plumbing.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules, in the order `poise --help` lists them.
SUBCOMMANDS = ("serve", "generate", "bench", "sweep", "tune", "simulate", "lab", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poise",
        description="LLM serving engine for the TTFT / throughput balance of continuous batching.",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"poise.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"poise.cli.{name}":
                raise
            continue  # not built yet
        command = subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(command)
        # After add_arguments: a nested subcommand (`bench plot`) sets its own func first.
        command.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
