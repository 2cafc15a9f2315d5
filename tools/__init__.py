"""Tool plug-ins behind one async protocol: the local bubblewrap Python sandbox, a
SandboxFusion-compatible HTTP client and server, E2B, and MCP servers (their tools as functions); the
toolbox that offers several tools' functions to a function-calling model.

May import: `vcpo`.

Importing this package starts nothing and imports no optional dependency (fastapi, uvicorn,
e2b, the mcp SDK are imported when the server, the E2B tool or an MCP tool is used).
"""

from tools.base import (
    FunctionSpec,
    FunctionTool,
    Language,
    Tool,
    ToolCall,
    ToolConfigError,
    ToolError,
    ToolResult,
    ToolSession,
    ToolStatus,
    ToolUnavailableError,
)
from tools.e2b import E2BTool
from tools.fakes import EchoTool, EchoToolSettings, ScriptedTool
from tools.functions import Toolbox
from tools.mcp_tool import MCPTool
from tools.registry import BUILTIN_TOOLS, ENTRY_POINT_GROUP, build_tool, known_tools, validate_tool_settings
from tools.sandbox.local_sandbox import LocalPythonSandbox, LocalSandboxSession
from tools.sandbox_fusion.client import SandboxFusionTool
from tools.sandbox_fusion.server import create_app, serve
from tools.settings import (
    E2BSettings,
    LocalSandboxSettings,
    MCPSettings,
    SandboxFusionClientSettings,
    SandboxServerSettings,
)

__all__ = [
    "BUILTIN_TOOLS",
    "ENTRY_POINT_GROUP",
    "E2BSettings",
    "E2BTool",
    "EchoTool",
    "EchoToolSettings",
    "FunctionSpec",
    "FunctionTool",
    "Language",
    "LocalPythonSandbox",
    "LocalSandboxSession",
    "LocalSandboxSettings",
    "MCPSettings",
    "MCPTool",
    "SandboxFusionClientSettings",
    "SandboxFusionTool",
    "SandboxServerSettings",
    "ScriptedTool",
    "Tool",
    "ToolCall",
    "ToolConfigError",
    "ToolError",
    "ToolResult",
    "ToolSession",
    "ToolStatus",
    "ToolUnavailableError",
    "Toolbox",
    "build_tool",
    "create_app",
    "known_tools",
    "serve",
    "validate_tool_settings",
]
