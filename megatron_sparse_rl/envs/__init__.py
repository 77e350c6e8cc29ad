"""Environments of multi-turn episodes: the interface (base.py), the tool registry (tools.py) and the built-in tool
environment (tool_env.py). The engine side that runs episodes is megatron_sparse_rl/rollout/multi_turn.py; the
config section is `env` (config/env.py). Nothing here imports torch or vLLM."""
from megatron_sparse_rl.envs.base import Environment, Observation, StepResult
from megatron_sparse_rl.envs.tools import TOOLS, ToolError, call_tool, register_tool

__all__ = ["Environment", "Observation", "StepResult", "TOOLS", "ToolError", "call_tool", "register_tool"]
