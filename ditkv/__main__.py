"""`python -m ditkv ...` = the `ditkv` command."""

import sys

from .entrypoints.cli import main

sys.exit(main())
