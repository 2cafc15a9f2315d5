"""Tests of the run: its wiring, step loop, checkpoints, launchers and observability."""
