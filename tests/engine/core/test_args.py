"""EngineArgs is the one place each engine setting is written: LLM's keywords, the engine's
config defaults, the command-line flags and docs/ENGINE.md's table all follow it, and none of
them writes a default of its own."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from kvbatch.engine import LLM
from kvbatch.engine.core import config as config_module
from kvbatch.engine.core.args import (
    DEFAULTS,
    KV_CACHE_DTYPE_NAMES,
    EngineArgs,
    EngineKwargs,
    default_in_words,
    setting_flag,
    settings_table,
)
from kvbatch.engine.core.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    default_batched_tokens,
)
from kvbatch.engine_args import add_engine_args, add_gpu_tuning_args, engine_kwargs

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
TYPES = {"SpecConfig": SpecConfig}  # for the annotations' names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbatch run", exit_on_error=False)
    add_engine_args(p)
    return p


def test_llm_takes_exactly_the_engine_args():
    """LLM(model, **settings): editors read the keywords off EngineKwargs, whose names and
    types are EngineArgs' own."""
    params = list(inspect.signature(LLM.__init__).parameters.values())
    assert [(p.name, p.kind) for p in params] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("settings", inspect.Parameter.VAR_KEYWORD),
    ]
    assert params[2].annotation == "Unpack[EngineKwargs]"
    kwargs_types = typing.get_type_hints(EngineKwargs, localns=TYPES)
    args_types = typing.get_type_hints(EngineArgs, localns=TYPES)
    assert kwargs_types == args_types
    assert EngineKwargs.__optional_keys__ == frozenset(FIELDS)


def test_a_keyword_that_is_not_a_setting_names_the_closest(tmp_path: Path):
    """Before the model is looked for: the typo is what to fix."""
    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        LLM(str(tmp_path / "no-model"), max_num_seq=8)
    with pytest.raises(TypeError, match=r"keyword arguments: 'colour'$"):
        EngineArgs.from_keywords({"colour": "red", "block_size": 32})
    assert EngineArgs.from_keywords({"block_size": 32}).block_size == 32


def test_the_engine_config_defaults_are_engine_args_defaults():
    """A config built from no settings is the config the engine gets from LLM(model)."""
    assert EngineConfig.from_args("m", DEFAULTS) == EngineConfig("m")
    assert EngineConfig.from_args("m", DEFAULTS).cache == CacheConfig()
    assert EngineConfig.from_args("m", DEFAULTS).scheduler == SchedulerConfig()
    changed = EngineArgs(block_size=32, max_num_seqs=3, cuda_graphs=False, seed=7)
    config = EngineConfig.from_args("m", changed)
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 3)
    assert (config.cuda_graphs, config.seed) == (False, 7)


# config fields that hold a setting in another form (the equality test above checks them)
OWN_FORM = {
    "SchedulerConfig.max_model_len": "0",  # the engine fills it in from the model
    "SchedulerConfig.longest_request": "0",  # None (unknown) is 0 in the config, as max_model_len
    "EngineConfig.speculative": "None",  # the parsed SpecConfig of `speculative`
}


def test_the_config_writes_no_default_of_its_own():
    """Every config field that is also a setting takes its default from DEFAULTS.<same name>:
    a literal there (even an equal one) would be a second copy to drift."""
    tree = ast.parse(inspect.getsource(config_module))
    copies = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = stmt.target.id
            if name not in FIELDS or stmt.value is None:
                continue
            want = OWN_FORM.get(f"{cls.name}.{name}", f"DEFAULTS.{name}")
            if ast.unparse(stmt.value) != want:
                copies.append(f"{cls.name}.{name} = {ast.unparse(stmt.value)}")
    assert copies == []


def test_the_device_defaults_come_from_the_same_numbers():
    assert set(KV_CACHE_DTYPES) == set(KV_CACHE_DTYPE_NAMES)
    cpu = default_batched_tokens(torch.device("cpu"))
    cuda = default_batched_tokens(torch.device("cuda"))
    assert default_in_words(FIELDS["max_num_batched_tokens"]) == (
        f"{cuda} on CUDA, {cpu} on the CPU"
    )
    assert default_in_words(FIELDS["num_speculative_tokens"]) == str(
        SpecConfig().num_speculative_tokens
    )


def test_no_flags_given_is_the_engine_args_defaults():
    """What the commands pass for a flag left out is the default LLM itself would use."""
    assert EngineArgs(**engine_kwargs(parser().parse_args([]))) == DEFAULTS


def test_each_flag_default_and_help_is_the_settings():
    p = parser()
    actions = {a.dest: a for a in p._actions}
    for name, f in FIELDS.items():
        flag = setting_flag(f)
        if flag is None:
            assert name not in actions, name
            continue
        action = actions[name]
        assert flag.option(name) in action.option_strings
        if flag.group in ("memory", "gpu"):  # the tuning group: None, the engine's default
            assert p.get_default(name) is None, name
        else:
            assert p.get_default(name) == f.default, name
        if not flag.negates:
            assert f"(default: {default_in_words(f)})" in action.help, name


def test_the_bench_takes_the_gpu_flags_as_run_does():
    bench = argparse.ArgumentParser()
    add_gpu_tuning_args(bench)
    gpu = {n for n, f in FIELDS.items() if setting_flag(f) and setting_flag(f).group == "gpu"}
    assert {a.dest for a in bench._actions} - {"help"} == gpu
    run = {a.dest: a.option_strings for a in parser()._actions}
    assert all(a.option_strings == run[a.dest] for a in bench._actions if a.dest in gpu)


def test_engine_md_holds_the_generated_table():
    text = (ROOT / "docs" / "ENGINE.md").read_text()
    start = text.index("settings_table()")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of the generated table -->")
    assert text[start:end] == settings_table(), (
        "docs/ENGINE.md's settings table is stale: paste the output of "
        "python -c 'from kvbatch.engine.core.args import settings_table; print(settings_table())'"
    )
    for name, f in FIELDS.items():  # each row says its default
        (row,) = [r for r in settings_table().splitlines() if r.startswith(f"| `{name}` |")]
        assert default_in_words(f) in row or repr(f.default).replace("'", '"') in row


def test_the_settings_and_flags_import_no_torch():
    """`kvbatch status` builds the engine's flags without loading the engine."""
    code = (
        "import sys, argparse; import kvbatch.engine_args as a; "
        "a.add_engine_args(argparse.ArgumentParser()); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
