"""``python -m specdecode``: the same as the ``specdecode`` command."""
import sys

from specdecode.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
