"""The serve command's parser and its ServerArgs, for tests of the CLI surface."""
from __future__ import annotations

import argparse

from kvstrata.config.cli_args import add_cli_args, server_args_from_namespace


def make_parser(prog: str = "kvstrata serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    add_cli_args(parser)
    return parser


__all__ = ["make_parser", "server_args_from_namespace"]
