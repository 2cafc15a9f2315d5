"""`python -m learner.cli` is `vcpo`."""

import sys

from learner.cli.main import main

sys.exit(main())
