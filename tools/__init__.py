"""Tool plug-ins behind one async protocol: the local bubblewrap Python sandbox, a
SandboxFusion-compatible HTTP client and server, and E2B. Imports nothing of the project but vcpo."""
