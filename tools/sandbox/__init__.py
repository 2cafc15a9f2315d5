"""The local Python sandbox (`local_sandbox.LocalPythonSandbox`, tool type `python`): bubblewrap
isolation (`_bwrap`, `_seccomp`), the process that runs inside it (`_sandbox_runner`), launching and
talking to it (`_launcher`, `_sandbox_process`, `_outcome`), and a warm pool (`_warm_pool`).
Underscored modules are internals.

May import: `tools` (its top modules: base, settings, _output).
"""
