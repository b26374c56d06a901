import sys

from specdecode.entrypoints.cli import main

sys.exit(main())
