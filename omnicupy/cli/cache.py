"""``omnicupy cache path | list | clear``: show or clear the compiled-kernel cache. Every line names
the cache's root folder (``OMNICUPY_CACHE_DIR`` or the per-user default), the same one ``path`` prints."""
from __future__ import annotations

import argparse
import time

from .. import jit
from .common import cache_dir_option, days, human_age, human_bytes


def run_path(args: argparse.Namespace) -> int:
    print(jit.default_cache().root)
    return 0


def run_list(args: argparse.Namespace) -> int:
    cache = jit.default_cache()
    entries = sorted(cache.entries(), key=lambda e: (str(e.meta.get("kernel", e.stem)), str(e.meta.get("arch", ""))))
    if not entries:
        print(f"no compiled variants in {cache.root}")
        return 0
    now = time.time()
    rows = [(str(e.meta.get("kernel", e.stem)), str(e.meta.get("arch", "?")), human_bytes(e.size),
             human_age(now - e.created), str(e.meta.get("registers", "?"))) for e in entries]
    header = ("variant", "arch", "size", "age", "regs")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"{len(entries)} variants, {human_bytes(sum(e.size for e in entries))} in {cache.root}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    cache = jit.default_cache()
    if args.older_than is None:
        removed = cache.clear()
        cache.remove_leftovers()
        old = cache.remove_other_formats()
        extra = f" and {old} folder(s) of older cache formats" if old else ""
        print(f"removed {removed} entries{extra} from {cache.root}")
        kept = cache.other_formats()
        if kept:
            print(f"left {len(kept)} folder(s) holding files omnicupy did not write: {', '.join(map(str, kept))}")
    else:
        removed = cache.clear(older_than_seconds=args.older_than * 86400)
        cache.remove_leftovers()
        print(f"removed {removed} entries older than {args.older_than:g} days from {cache.root}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    options = cache_dir_option()
    c = commands.add_parser("cache", parents=[options], help="show or clear the kernel cache",
                            description="Show or clear the compiled-kernel cache.")
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("path", parents=[options], help="print the cache folder",
                       description="Print the cache folder ($OMNICUPY_CACHE_DIR or the per-user cache)."
                       ).set_defaults(func=run_path)
    actions.add_parser("list", parents=[options], help="list compiled variants: variant, arch, size, age",
                       description="List the compiled variants (checksums verified; corrupt entries are dropped)."
                       ).set_defaults(func=run_list)
    clear = actions.add_parser("clear", parents=[options], help="remove compiled variants",
                               description="Remove compiled variants (all, or those older than DAYS). Only files "
                                           "omnicupy wrote are removed: entries in its own tagged folder, and folders "
                                           "of older cache formats that hold nothing else.")
    clear.add_argument("--older-than", type=days, metavar="DAYS", help="only entries compiled more than DAYS ago")
    clear.set_defaults(func=run_clear)
