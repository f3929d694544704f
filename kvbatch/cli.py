"""The `kvbatch` command. Each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from typing import Annotated

from kvbatch.engine_args import (
    add_engine_args,
    add_reasoning_parser_arg,
    add_revision_arg,
    add_tool_call_parser_arg,
    engine_args_conflict,
    engine_kwargs,
    non_negative_int,
)
from kvbatch.index import cli as index_cli
from kvbatch.metrics_registry import metrics_port
from kvbatch.threads import apply_threads

MODEL_HELP = (
    "a Hugging Face folder, a .gguf file, or a Hub id (owner/name, or owner/name/FILE.gguf) "
    "fetched into the Hugging Face cache (HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT apply)"
)


def build_parser() -> argparse.ArgumentParser:
    """`kvbatch` and its subcommands' flags (bench parses its own)."""
    parser = argparse.ArgumentParser(prog="kvbatch", description="Batch LLM inference.")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser(
        "fetch-model", help="fetch SmolLM2-135M-Instruct (test model) and print its folder"
    )
    fetch.add_argument("--gguf", action="store_true", help="print the .gguf file instead")

    gen = sub.add_parser("generate", help="generate answers for a few prompts")
    gen.add_argument("--model", required=True, help=MODEL_HELP)
    gen.add_argument("--prompt", action="append", default=[], help="a completion prompt")
    gen.add_argument("--chat-file", help='JSONL with one {"messages": [...]} per line')
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens per answer (default 64)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy, the same answer every time)",
    )
    gen.add_argument(
        "--seed", type=int, default=None, help="seed for sampling with a temperature above 0"
    )
    add_engine_args(gen)
    run = sub.add_parser("run", help="run an OpenAI Batch JSONL job on this machine")
    run.add_argument("input", help="JSONL file, s3://bucket/key, or - for stdin")
    run.add_argument("-o", "--output", help="answers (default: INPUT.output.jsonl); - = stdout")
    run.add_argument("--errors", help="error records (default: beside the output)")
    run.add_argument("--model", required=True, help=MODEL_HELP)
    run.add_argument("--model-name", help="the job's model name (default: the first line's)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="answer only the custom_ids an interrupted run did not finish",
    )
    run.add_argument(
        "--window",
        type=non_negative_int,
        default=0,
        help="requests inside the engine at once (default 4 x max-num-seqs)",
    )
    run.add_argument("--work-dir", help="where the resumable partial output is kept")
    run.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=0,
        help="serve Prometheus metrics (the worker's) on this port while the run lasts (0: off)",
    )
    run.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")
    add_tool_call_parser_arg(run)
    add_engine_args(run)
    sub.add_parser("bench", help="benchmarks: kvbatch bench --help")
    index_cli.add_index_parsers(sub)
    _add_distributed(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # the benchmark harness owns its own options
        from kvbatch.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    conflict = engine_args_conflict(args)
    if conflict:
        parser.error(conflict)
    if args.command in ("generate", "run", "worker"):
        try:  # before any model loads: torch sizes its thread pool once
            apply_threads(args.threads)
        except ValueError as e:
            parser.error(str(e))
    if args.command == "submit":
        from kvbatch.hub import ModelNotFoundError, is_hub_id, resolve_model

        # submit reads only the tokenizer and config of a Hub id (the workers fetch the
        # weights). run, generate and worker pass the id and --revision to engine.LLM, which
        # fetches it after the command's own cheaper checks (output lock, broker URL).
        try:
            if is_hub_id(args.model) or args.revision:
                args.model = resolve_model(args.model, args.revision, tokenizer_only=True)
        except ModelNotFoundError as e:
            print(f"kvbatch {args.command}: {e}", file=sys.stderr)
            return 2
    if args.command == "fetch-model":
        from kvbatch.fetch import smollm2_dir, smollm2_gguf

        print(smollm2_gguf() if args.gguf else smollm2_dir())
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "run":
        return _run(args)
    if args.command in ("index", "search"):
        return index_cli.run(args)
    if args.command == "results":
        from kvbatch.results import results

        return results(args)
    if args.command == "beat":
        from kvbatch.worker.scheduled import beat

        return beat(args)
    if args.command == "index-worker":
        from kvbatch.worker.index_run import index_worker

        return index_worker(args)
    if args.command in ("submit", "worker", "finalize", "status", "cancel", "resend"):
        from kvbatch.worker import cli as worker_cli

        if args.command == "resend":
            return worker_cli.resend(args)
        if args.command == "status":
            return worker_cli.status(args)
        if args.command == "cancel":
            return worker_cli.cancel(args)
        if args.command == "submit":
            return worker_cli.submit(args)
        if args.command == "worker":
            return worker_cli.worker(args, engine_kwargs(args))
        return worker_cli.finalize(args)
    return 2


def _add_distributed(sub) -> None:
    """`submit`, `worker`, `finalize`, `status`, `cancel`, `resend`: a job spread over Celery
    workers (worker/cli.py)."""
    from kvbatch.worker import cli as worker_cli

    submit = sub.add_parser("submit", help="shard a job and enqueue it; prints the job id last")
    worker_cli.add_submit_args(submit)
    add_tool_call_parser_arg(submit)
    add_reasoning_parser_arg(submit)
    add_revision_arg(submit)
    w = sub.add_parser("worker", help="run shards from the queue on one device")
    worker_cli.add_worker_args(w)
    add_engine_args(w)
    worker_cli.add_finalize_args(
        sub.add_parser("finalize", help="assemble a finished job's output; print its status")
    )
    worker_cli.add_status_args(
        sub.add_parser("status", help="a job's counts, tokens/s and ETA (--watch to follow)")
    )
    _add_results_args(
        sub.add_parser(
            "results", help="a finished job's merged answers (or --errors), to a file or stdout"
        )
    )
    worker_cli.add_cancel_args(sub.add_parser("cancel", help="stop a job; finished lines are kept"))
    worker_cli.add_resend_args(
        sub.add_parser("resend", help="send again the shards of a job that the broker lost")
    )
    from kvbatch.worker.scheduled import add_beat_args

    add_beat_args(
        sub.add_parser("beat", help="run the recurring jobs of a schedule file (celery beat)")
    )
    from kvbatch.worker.index_trigger import add_index_worker_args

    add_index_worker_args(
        sub.add_parser(
            "index-worker", help="run the scheduled index runs of `kvbatch beat` (no model)"
        )
    )


def _version() -> str:
    try:
        return importlib.metadata.version("kvbatch")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed: pip install -e .)"


def _add_results_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id `kvbatch submit` printed last")
    p.add_argument("--output", required=True, help="the prefix the job was submitted to")
    p.add_argument(
        "-o",
        "--to",
        default="-",
        metavar="FILE",
        help="where to write the answers: a path, an s3:// URI or - for stdout (default -)",
    )
    p.add_argument(
        "--errors",
        action="store_true",
        help="the job's error records (errors.jsonl) instead of its answers",
    )


def _run(args: argparse.Namespace) -> int:
    import logging

    from kvbatch.jobs.local.run import JobError, JobInterrupted, RunOptions, resolve_paths, run_job

    # INFO for our own loggers only: at the root, boto3 and others would log their chatter
    # ("Found credentials in environment variables.") around the one line a failure prints.
    logging.basicConfig(level=logging.WARNING, format="kvbatch: %(message)s", stream=sys.stderr)
    logging.getLogger("kvbatch").setLevel(logging.INFO)
    opts = RunOptions(
        input=args.input,
        model=args.model,
        output=args.output,
        errors=args.errors,
        model_name=args.model_name,
        resume=args.resume,
        window=args.window,
        work_dir=args.work_dir,
        engine=engine_kwargs(args),
        tool_call_parser=args.tool_call_parser,
    )
    if args.metrics_port:
        from kvbatch.worker.metrics import RunMetrics, start_metrics_server

        try:
            start_metrics_server(args.metrics_port, args.metrics_host)
        except OSError as e:
            print(
                f"kvbatch run: cannot serve metrics on {args.metrics_host}:{args.metrics_port}"
                f" ({e.strerror}): pick another --metrics-port",
                file=sys.stderr,
            )
            return 1
        opts.monitor = RunMetrics(args.model_name or args.model.rstrip("/").rsplit("/", 1)[-1])
    try:
        paths = resolve_paths(opts)
        record = run_job(opts)
    except JobInterrupted as e:
        print(f"kvbatch run: {e}", file=sys.stderr)
        return 130
    except JobError as e:
        print(f"kvbatch run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the run began: nothing was kept
        print("kvbatch run: interrupted before the run began", file=sys.stderr)
        return 130
    print(f"kvbatch run: {_run_summary(record)}", file=sys.stderr)
    if paths.output != "-":
        print(f"answers: {paths.output}\nerrors:  {paths.errors}\nbatch:   {paths.batch}")
    if record.total and not record.completed:  # a script must not carry on as if answered
        why = "was refused" if record.status == "failed" else "failed"
        print(f"kvbatch run: the batch failed: every line {why}; see {paths.errors}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _run_summary(record) -> str:
    """The closing line of `kvbatch run`, in the words of the job's endpoint."""
    if record.endpoint == "/v1/embeddings":
        return (
            f"{record.completed} answered with {record.vectors} vectors "
            f"({record.prompt_tokens} input tokens), {record.failed} failed"
        )
    share = record.cached_tokens / record.prompt_tokens if record.prompt_tokens else 0.0
    return (
        f"{record.completed} answered, {record.failed} failed; "
        f"cached_tokens {record.cached_tokens} of {record.prompt_tokens} prompt tokens "
        f"({share:.0%})"
    )


def _generate(args: argparse.Namespace) -> int:
    from kvbatch.engine import LLM, SamplingParams
    from kvbatch.engine.core.chat import render_chat

    try:
        chats = _read_chats(args.chat_file) if args.chat_file else []
        if not args.prompt and not chats:  # before the model loads, not after
            raise ValueError(
                f"{args.chat_file} holds no conversation"
                if args.chat_file
                else "nothing to answer: give --prompt TEXT or --chat-file FILE"
            )
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        llm = LLM(model=args.model, **engine_kwargs(args))
    except (OSError, ValueError) as e:
        print(f"kvbatch generate: {e}", file=sys.stderr)
        return 2
    prompts = list(args.prompt)
    shown = list(args.prompt)
    for n, messages in enumerate(chats, 1):
        try:
            prompts.append(render_chat(llm.tokenizer, messages))
        except Exception as e:  # the template's own (jinja2's TemplateError, ValueError, ...)
            print(
                f"kvbatch generate: the model's chat template rejects conversation {n} of "
                f"{args.chat_file}: {e}",
                file=sys.stderr,
            )
            return 2
        shown.append(messages[-1]["content"])
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    seconds = time.perf_counter() - start
    for question, out in zip(shown, outputs):
        print(f"\n>>> {question}")
        print(out.error if out.error else out.outputs[0].text.strip())
    stats = llm.stats()
    print(
        f"\n{len(outputs)} requests, {stats.generation_tokens} tokens in {seconds:.1f} s "
        f"({stats.generation_tokens / seconds:.1f} tokens/s), prefix cache hit rate "
        f"{stats.prefix_hit_rate:.0%}"
    )
    if stats.spec_draft_tokens:
        print(
            f"speculative decoding: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} "
            f"draft tokens accepted ({stats.spec_acceptance_rate:.0%})"
        )
    return 0


def _read_chats(path: str) -> list[list[dict]]:
    """The conversations of a --chat-file, checked as `kvbatch run` checks a chat line's
    messages: a malformed one is refused here, naming its line, not by the chat template
    after the model has loaded."""
    from pydantic import Field, TypeAdapter, ValidationError

    from kvbatch.jobs.openai_format.schemas import ChatMessage

    conversation = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])
    chats = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-file {path} is not UTF-8 ({e.reason}): save it as UTF-8") from e
    except OSError as e:
        raise ValueError(f"cannot read --chat-file {path}: {e.strerror}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            chats.append([m.as_dict() for m in conversation.validate_python(messages)])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f'{path} line {n}: expected {{"messages": [...]}} ({type(e).__name__}: {e})'
            ) from e
        except ValidationError as e:
            first = e.errors()[0]
            where = "messages" + "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]
            )
            raise ValueError(
                f"{path} line {n}: '{where}' {first['msg']}: each message is "
                '{"role": "system"|"user"|"assistant", "content": "text"}'
            ) from e
    return chats


if __name__ == "__main__":
    sys.exit(main())
