"""Tool plug-ins behind one async protocol: the local bubblewrap Python sandbox, a
SandboxFusion-compatible HTTP client and server, E2B, and MCP servers (their tools as functions); the
toolbox that offers several tools' functions to a function-calling model.

Modules: `base` (the protocol a plug-in implements: Tool, ToolCall, ToolResult, the errors), `settings`
(each built-in tool's settings), `registry` (building a tool from a task's spec, entry-point plug-ins
included), `sandbox/` (the local bubblewrap sandbox), `sandbox_fusion/` (the SandboxFusion client and
server), `e2b`, `mcp_tool` (an MCP server's tools), `functions` (function calling over a task's tools: one
namespace, argument checks, an episode's calls), `_output` (bounded capture of a child's output), `fakes`
(an echo tool and a scripted tool for tests).

The package holds no re-exports: import from the module that defines a name. Importing it starts nothing
and imports no optional dependency (fastapi, uvicorn, e2b, the mcp SDK are imported when the server, the
E2B tool or an MCP tool is used).

May import: `vcpo`.
"""
