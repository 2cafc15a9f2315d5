"""Inference engines behind one protocol, the rollout manager that keeps them busy under a lag bound, and the
Trajectory contract between rollout and learner. Also the default-model loader (shared by engines and
learners, so it lives at the lowest layer that both may import).

Modules: `base` (the engine protocol), `types` (sampling settings, a request, its result), `errors` (typed
engine failures), `settings` (one settings model per backend), `request_record` (a request's record while an
engine works on it), `engines/` (HF transformers, vLLM, SGLang, OpenAI-compatible servers, the factory, the
weight push), `trajectory` (the Trajectory and its builder), `manager` (groups in flight under the lag bound
k), `lag_control` (the adaptive bound, `rollout.max_lag: auto`), `sim_clock` (a simulated clock for the
pipeline), `models` (resolving and loading models, the default one included), `openmp` (handing idle OpenMP
workers back), `tiny` (tiny random-weight models for tests and benchmarks), `fakes` (a scripted engine for
tests of control logic).

The package holds no re-exports: import from the module that defines a name.

May import: `vcpo`."""
