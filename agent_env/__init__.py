"""Tasks from YAML, datasets, rewards, the multi-turn agent loop (SimpleTIR's code fence, or function
calling with several tools), running a task's episodes and groups for the rollout manager (`runtime`)
and evaluation (`evaluation`).

Modules: `datasets` and `samples` (a task's rows as samples), `prompts` (rendering them with the chat
template), `loop` (the built-in multi-turn episode), `context` (managed contexts: thinking stripped, history
compacted), `turns` and `function_calls` (reading the model's code blocks and tool calls), `tool_messages`
(tool results as the template's tool messages), `rewards` (scoring an answer), `runtime` (a task's episodes
and groups for the rollout manager), `programs/` (agents written as programs, behind an OpenAI-compatible
endpoint), `evaluation/` (held-out sets and `vcpo eval`), `countdown` and `keychain` (the generated tasks),
`demonstrations` (a solver's episodes through the real loop, for warm starts).

The package holds no re-exports: import from the module that defines a name.

May import: `vcpo`, `rollout`, `tools`, `configs` (the task schema: a task component takes its own
validated section).
"""
