"""Agents written as programs: an OpenAI-compatible endpoint that the program calls as it would any chat
API, served by the rollout side, which records every call at token level (`endpoint`) into one segmented
trajectory per episode (`recorder`): what is trained is exactly what was sampled, and a program that edits
its history starts a new segment instead of training tokens the model never saw.

May import: `agent_env` (its top modules: prompts, function calls), `rollout`.
"""
