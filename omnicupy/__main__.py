"""``python -m omnicupy``: the same command as the ``omnicupy`` console script."""
from .cli import main

if __name__ == "__main__":  # also keeps spawned compile workers from running the command again
    raise SystemExit(main())
