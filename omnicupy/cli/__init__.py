"""The ``omnicupy`` command (also ``python -m omnicupy``): one module per command (precompile, cache,
info, demo, bench), the progress line and shared helpers beside them, the parser and ``main`` in
main.py. See main.py for the synopsis and exit statuses."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
