"""The run's tests share the learner tests' fixtures: one intra-op thread per test (a tiny model gains
nothing from more, and on a shared 2-core machine a busy neighbour slows OpenMP's spinning threads)."""

from tests.learner.conftest import _single_thread  # noqa: F401  (an autouse fixture, registered by import)
