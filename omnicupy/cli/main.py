"""The parser and ``main``: one subcommand per module of this package.

    omnicupy precompile [--head-dims 64,128] [--dtypes fp16,bf16] [--stages 1,2] [--arch auto|sm_80,sm_90,sm_90a]
                        [--jobs N] [--dry-run] [--quiet]
    omnicupy cache path | list | clear [--older-than DAYS]
    omnicupy info
    omnicupy demo
    omnicupy plan [--q-len N] [--heads H] [--head-dim D] [--mask causal] [--arch sm_90] [--backward]
    omnicupy bench [--harness PATH] [-- HARNESS ARGS]

``--cache-dir DIR`` is accepted before or after the command. Exit status: 0 success, 1 failure,
2 usage. An error is one line on stderr, never a traceback (``OMNICUPY_VERBOSE=1`` adds the full
message or traceback and DEBUG logging). Output cut short by a closed pipe (``| head``) is not an error.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .._version import __version__
from ..errors import OmnicupyError
from ..jit import env
from . import bench, cache, demo, info, plan, precompile
from .common import UsageError, first_line, log

COMMANDS = (precompile, cache, info, demo, plan, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnicupy",
        description="Exact block-sparse attention for NumPy/CuPy: precompile kernels, manage their cache, check "
                    "the setup.",
        epilog="Exit status: 0 success, 1 failure, 2 usage error. The cache lives in $OMNICUPY_CACHE_DIR, else "
               "$XDG_CACHE_HOME/omnicupy or ~/.cache/omnicupy.")
    parser.add_argument("--version", action="version", version=f"omnicupy {__version__}")
    parser.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="use this cache folder (sets OMNICUPY_CACHE_DIR for this command)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _silence_stdout() -> None:
    """The reader went away (``| head``): send what is left, and the flush at exit, nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 here
    name = f"omnicupy {args.command}"
    if getattr(args, "cache_dir", None) is not None:
        if not args.cache_dir.strip():
            print(f"{name}: error: --cache-dir is empty (leave it out for the default cache)", file=sys.stderr)
            return 2
        os.environ["OMNICUPY_CACHE_DIR"] = args.cache_dir  # worker processes inherit it
    env.configure_logging()
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except UsageError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (OMNICUPY_VERBOSE=1 logs it)
        log.debug("%s failed", name, exc_info=True)
        kind = "" if isinstance(exc, (OmnicupyError, OSError, ValueError, ImportError)) else f"{type(exc).__name__}: "
        print(f"{name}: error: {kind}{first_line(exc)}", file=sys.stderr)
        return 1
