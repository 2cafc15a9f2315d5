"""Inference engines behind one protocol and the Trajectory contract. Also the default-model loader
(shared by engines and learners, so it lives at the lowest layer that both may import)."""
