"""The `vcpo` command (`main`): argument parsing and each subcommand's wiring, with `vcpo config check`'s
catalogue of shipped YAML files (`config_catalog`) and `vcpo eval` (`eval_command`).

May import: everything in `learner` (it is the composition root's top); subcommands import lazily so
`vcpo --help` stays instant.
"""

from learner.cli.main import main

__all__ = ["main"]
