"""The engine's settings as command-line flags: `kvbatch run`, `generate` and `worker` share them,
and `kvbatch bench` shares the GPU tuning ones.

Each flag is one field of `EngineArgs` (kvbatch/engine/core/args.py), the `engine.LLM` keyword
of the same name: its option, help, default and range check come from there. A flag of the KV
cache and GPU tuning group left out is left out of the keywords too, so the engine's own
default applies (several depend on the device: CUDA graphs, async scheduling and timed chunks
are on for CUDA only). Values are checked here, where the error can name the flag, before a
model is loaded or a broker is reached. This module imports no torch: `kvbatch status` builds
the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses

from kvbatch.engine.core.arg_values import (
    byte_size,
    fraction,
    non_negative_int,
    positive_int,
    power_of_two,
    step_ratio,
)
from kvbatch.engine.core.args import (
    QUANTIZATION_CHOICES,
    EngineArgs,
    FlagGroup,
    default_in_words,
    setting_flag,
    setting_help,
)
from kvbatch.jobs.openai_format.tool_parsers import PARSERS

__all__ = [
    "QUANTIZATION_CHOICES",
    "add_engine_args",
    "add_gpu_tuning_args",
    "add_reasoning_parser_arg",
    "add_revision_arg",
    "add_tool_call_parser_arg",
    "byte_size",
    "engine_args_conflict",
    "engine_kwargs",
    "fraction",
    "non_negative_int",
    "positive_int",
    "power_of_two",
    "step_ratio",
]

_SETTINGS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _add_setting(parser, name: str) -> None:
    """The flag of EngineArgs' field `name`, as the field describes it."""
    f = _SETTINGS[name]
    flag = setting_flag(f)
    tuning = flag.group in ("memory", "gpu")
    default = None if tuning else f.default  # None: the engine's, whatever the device
    if flag.negates:  # a switch: the default is the only other value
        parser.add_argument(
            flag.option(name),
            dest=name,
            action="store_false",
            default=default,
            help=flag.help or setting_help(f),
        )
        return
    help = f"{setting_help(f)} (default: {default_in_words(f)})"
    kwargs = dict(dest=name, default=default, help=help)
    if flag.both:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=flag.type, metavar=flag.metavar, choices=flag.choices)
    parser.add_argument(flag.option(name), **kwargs)


def _names(*groups: FlagGroup) -> list[str]:
    """The settings whose flags are in `groups`, in EngineArgs' order."""
    return [
        n
        for n, f in _SETTINGS.items()
        if setting_flag(f) is not None and setting_flag(f).group in groups
    ]


def add_gpu_tuning_args(group) -> None:
    """The throughput/latency knobs of a GPU run (default None: the engine's default)."""
    for name in _names("gpu"):
        _add_setting(group, name)


def add_revision_arg(parser: argparse.ArgumentParser) -> None:
    """`--revision` of a Hub id given as --model (kvbatch.hub)."""
    _add_setting(parser, "revision")


def add_reasoning_parser_arg(parser: argparse.ArgumentParser) -> None:
    """`--reasoning-parser` (vLLM's): how a reasoning model's answers split into
    reasoning_content and content; `submit` takes it too (it renders the prompts)."""
    _add_setting(parser, "reasoning_parser")


def add_tool_call_parser_arg(parser: argparse.ArgumentParser) -> None:
    """`--tool-call-parser` of a job (`run`, `submit`), as vLLM's: how chat answers with
    tool_choice "auto" are read for tool calls. Job-level, because it belongs to the model."""
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="read tool calls out of chat answers with tool_choice 'auto' (the default when a "
        "line gives tools) in this model's format: hermes for Qwen2.5/Qwen3 and Hermes models, "
        "openai for gpt-oss (harmony's commentary channel); "
        "without it such lines are refused (named and 'required' tool_choice need no parser)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by the commands that run a model."""
    add_revision_arg(parser)
    add_reasoning_parser_arg(parser)
    for name in _names("engine"):
        _add_setting(parser, name)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads for torch's operators (default: OMP_NUM_THREADS when set, else the "
        "cores this process may use divided by KVBATCH_LOCAL_WORKERS, the kvbatch workers on "
        "this machine, default 1, and no more than the cores idle at start; more threads than "
        "free cores makes CPU runs many times slower)",
    )
    memory = parser.add_argument_group("KV cache and GPU tuning (defaults: the engine's)")
    for name in _names("memory", "gpu"):
        _add_setting(memory, name)


def engine_args_conflict(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of engine flags, or None (each value alone is checked
    by its type)."""
    if getattr(args, "async_scheduling", None) and getattr(args, "speculative", None):
        return (
            "--async-scheduling cannot go with --speculative: speculation proposes from each "
            "step's tokens before the next step is queued (drop one)"
        )
    return None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `engine.LLM` keywords of parsed engine flags (add_engine_args): every flag's value
    but None, which leaves the engine's default."""
    names = _names("model", "engine", "memory", "gpu")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
