"""`hyperpod-pretrain`: compile the pipeline, run it locally, or run any one step's core by itself."""

# The command line by command group, as kfp's own (kfp/cli/): each group module adds its subcommands, each one's flags
# beside the function that runs it; args.py holds what several commands' parsers share, run_settings.py the run's
# settings (the trainer's flags, and the launch and pipeline arguments made of them).

from __future__ import annotations

import argparse
import sys

from common.errors import InputError, StepFailed
from common.version import tool_version
from components.kfp_support import setup_logging
from pipelines.cli import job, kfp_runs, local, render, results
from pipelines.cli.args import Parser

GROUPS = (local, job, render, kfp_runs, results)  # their commands in this order in --help
EXAMPLES = {name: example for group in GROUPS for name, example in group.EXAMPLES.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hyperpod-pretrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hyperpod-pretrain {tool_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        return args.func(args)
    except InputError as exc:
        print(f"hyperpod-pretrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StepFailed as exc:
        print(f"hyperpod-pretrain {args.command}: failed: {exc}", file=sys.stderr)
        return 1
