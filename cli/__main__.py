"""`python -m unikv.cli ...`: the `unikv` command."""

import sys

from unikv.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
