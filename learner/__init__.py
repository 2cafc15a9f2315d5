"""Training backends, per-trajectory gradient norms, the trainer loop, and the CLI (the composition
root: the only place that reads config files and wires objects)."""
