"""``omnicupy bench``: run the benchmark harness (``benchmarks/run.py``) with its defaults.

The harness ships inside the package as ``omnicupy.benchmarks`` (pyproject maps the repository's
``benchmarks/`` folder there), so an installed omnicupy finds it; a source checkout that is not
installed runs its own ``benchmarks/run.py``. Results of an installed harness go to
``./omnicupy-bench/<UTC time>`` unless ``--out`` says otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import OmnicupyError
from .common import cache_dir_option

_PACKAGE = Path(__file__).resolve().parents[1]  # .../omnicupy
INSTALLED_MODULE = "omnicupy.benchmarks.run"

#: Runs ``module:NAME`` as ``python -m NAME`` would, or a harness file as ``python -m <folder>.<name>``
#: would from the folder's parent, without the working folder on the path (it must not shadow the
#: installed package).
_BOOT = """\
import runpy, sys
from pathlib import Path
target, sys.argv = sys.argv[1], sys.argv[1:]
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]
if target.startswith("module:"):
    sys.argv[0] = target[len("module:"):]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    path = Path(target).resolve()
    sys.argv[0] = str(path)
    if path.parent.name.isidentifier() and path.stem.isidentifier():
        sys.path.insert(0, str(path.parent.parent))
        runpy.run_module(f"{path.parent.name}.{path.stem}", run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(str(path), run_name="__main__")
"""


def find_harness() -> tuple[str, Optional[Path]]:
    """(what to run: ``module:omnicupy.benchmarks.run`` or a file path, the file) for the harness that
    ships with this omnicupy; the file is None when there is none."""
    installed = _PACKAGE / "benchmarks" / "run.py"
    if installed.is_file():
        return f"module:{INSTALLED_MODULE}", installed
    source = _PACKAGE.parent / "benchmarks" / "run.py"  # a source checkout imported in place
    if source.is_file():
        return str(source), source
    return "", None


def _with_default_out(extra: list[str]) -> list[str]:
    if any(a.split("=", 1)[0] in ("--out", "--report", "--dry-run", "--help", "-h") for a in extra):
        return extra
    out = Path("omnicupy-bench") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return [*extra, "--out", str(out)]


def run(args: argparse.Namespace) -> int:
    extra = list(args.harness_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.harness:
        path = Path(args.harness).expanduser()
        if not path.is_file():
            raise OmnicupyError(f"cannot find the benchmark harness {path}")
        target = str(path)
    else:
        target, path = find_harness()
        if path is None:
            raise OmnicupyError(f"cannot find the benchmark harness: neither {_PACKAGE / 'benchmarks' / 'run.py'} "
                                f"(installed) nor {_PACKAGE.parent / 'benchmarks' / 'run.py'} (source tree) exists; "
                                f"reinstall omnicupy or pass --harness PATH")
        if target.startswith("module:"):
            extra = _with_default_out(extra)
    print(f"running {path} {' '.join(extra)}".rstrip(), file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-c", _BOOT, target, *extra])


def add_parser(commands: argparse._SubParsersAction) -> None:
    b = commands.add_parser(
        "bench", parents=[cache_dir_option()], help="run the benchmark harness with its defaults",
        description="Run the benchmark harness (omnicupy.benchmarks.run, the repository's benchmarks/run.py) with "
                    "its defaults; arguments after -- go to the harness. Without --out, an installed harness writes "
                    "to ./omnicupy-bench/<UTC time>.",
        epilog="examples: omnicupy bench -- --help; omnicupy bench -- --quick; omnicupy bench -- --dry-run")
    b.add_argument("--harness", metavar="PATH", help="another harness script (default: the one shipped with omnicupy)")
    b.add_argument("harness_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="passed to the harness")
    b.set_defaults(func=run)
