"""SandboxFusion: the HTTP client tool (`client`, tool type `sandbox_fusion`, with a `_circuit_breaker`),
the wire schema (`schema`), and a compatible server backed by the local sandbox (`server`,
`vcpo sandbox serve`).

May import: `tools` (its top modules), `tools.sandbox` (the server runs the local sandbox).
"""
