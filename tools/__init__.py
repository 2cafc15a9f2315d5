"""Tool plug-ins behind one async protocol: the local bubblewrap Python sandbox, a
SandboxFusion-compatible HTTP client and server, and E2B.

May import: `vcpo`.

Importing this package starts nothing and imports no optional dependency (fastapi, uvicorn,
e2b are imported when the server or the E2B tool is used).
"""

from tools.base import (
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
from tools.registry import BUILTIN_TOOLS, ENTRY_POINT_GROUP, build_tool, known_tools, validate_tool_settings
from tools.sandbox.local_sandbox import LocalPythonSandbox, LocalSandboxSession
from tools.sandbox_fusion.client import SandboxFusionTool
from tools.sandbox_fusion.server import create_app, serve
from tools.settings import (
    E2BSettings,
    LocalSandboxSettings,
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
    "Language",
    "LocalPythonSandbox",
    "LocalSandboxSession",
    "LocalSandboxSettings",
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
    "build_tool",
    "create_app",
    "known_tools",
    "serve",
    "validate_tool_settings",
]
