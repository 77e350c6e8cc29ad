"""Prompt data: the built-in arithmetic task, JSONL/parquet datasets, templates, the resumable stream,
`build_task`, which the trainer consumes, and `check_data`, which checks every record before a run starts.
The character tokenizer of the tiny models lives in `models/char_tokenizer.py`. See docs/data.md.
"""
from megatron_sparse_rl.data.arithmetic import generate as generate_arithmetic
from megatron_sparse_rl.data.datasets import (DatasetError, DatasetMissing, PromptStream, encode_prompts,
                                              iter_jsonl, iter_parquet, iter_prompts, load_prompts, load_tokenizer,
                                              read_jsonl, read_parquet)
from megatron_sparse_rl.data.task import Task, build_task
from megatron_sparse_rl.data.checks import SplitSummary, check_data
from megatron_sparse_rl.data.templates import SIMPLE_CHAT_FORMAT, apply_template, encode_prompt, encode_sft, sft_examples
from megatron_sparse_rl.data.types import Example, Prompt, SFTExample

__all__ = [
    "DatasetError", "DatasetMissing", "Example", "Prompt", "PromptStream", "SFTExample", "SIMPLE_CHAT_FORMAT",
    "SplitSummary", "Task", "apply_template", "build_task", "check_data", "encode_prompt", "encode_prompts",
    "encode_sft", "generate_arithmetic", "iter_jsonl", "iter_parquet", "iter_prompts", "load_prompts",
    "load_tokenizer", "read_jsonl", "read_parquet", "sft_examples",
]
