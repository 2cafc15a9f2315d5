"""`python -m cli` is `vcpo`."""

import sys

from cli import console

sys.exit(console())
