"""`python -m learner.cli` is `vcpo`."""

import sys

from learner.cli import console

sys.exit(console())
