"""`kvbatch bench submit-lines --lines 10000,100000,1000000`: the submit half of a large job.

For each size, a chat job of documents x questions (about 1.7 KB a line,
kvbatch.bench.submit_workload) is written once into --workdir, then submitted
(kvbatch.jobs.distributed.submit.prepare_job: validate, tokenize, group, write the shards; no
broker, which only carries a pointer per shard) in a fresh process each, so every row's peak
resident memory is its own. The table gives seconds, milliseconds a line and their ratio to the
first row's, seconds of CPU (the pool's processes included), the peak RSS of the submitting
process and of the largest pool process (kvbatch.jobs.local.line_pool; KVBATCH_TOKENIZE_WORKERS
sets how many); the targets are a flat time a line and a peak RSS that does not grow with the
job beyond a few integers and the trie's hashes a line.

`--bad-line N` replaces line N of every job that long with a malformed line: it must come back
as one error record with its line number, the rest of the job submitted.

`--run` measures `kvbatch run` of the same jobs instead (validate, tokenize, group, answer,
finalize output.jsonl in input order), on a tiny random Llama with SmolLM2's tokenizer and
greedy lines of max_tokens 1: the engine's own speed is measured elsewhere; this row is the
job's machinery, whose peak RSS must not grow with the lines beyond the trie's hashes and a few
integers a line.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvbatch.bench.submit_workload import write_chat_job
from kvbatch.bench.text_table import format_rows

DEFAULT_LINES = "10000,100000"
SUBMIT_MAX_TOKENS = 16
RUN_MAX_TOKENS = 1  # a run row measures the job's machinery: one token, greedy
RUN_TEMPERATURE = 0.0
BAD_LINE = b'{"custom_id": "broken", "method": "POST", "url": '


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench submit-lines", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--lines", default=DEFAULT_LINES, help="job sizes, comma-separated")
    p.add_argument(
        "--model",
        default=None,
        help="a model folder whose tokenizer and chat template submit uses "
        "(default: SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvbatch-submit-bench"))
    p.add_argument("--shard-tokens", type=int, default=200_000)
    p.add_argument("--bad-line", type=int, default=None, help="a malformed line at this line")
    p.add_argument("--run", action="store_true", help="measure `kvbatch run`, not submit")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's size
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or str(_smollm2())
    if args.one is not None:
        one = _run_one if args.run else _submit_one
        print(json.dumps(one(args, model, args.one)))
        return 0
    rows = []
    for n in (int(x) for x in args.lines.split(",")):
        _input(args, n)
        cmd = [sys.executable, "-m", "kvbatch.bench.submit_bench", "--one", str(n), "--model",
               model, "--workdir", str(args.workdir), "--shard-tokens", str(args.shard_tokens)]  # fmt: skip
        if args.bad_line:
            cmd += ["--bad-line", str(args.bad_line)]
        if args.run:
            cmd += ["--run"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, check=True)  # progress on stderr
        rows.append(json.loads(done.stdout.decode().strip().splitlines()[-1]))
        print(_table(rows), file=sys.stderr)
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _smollm2() -> Path:
    from kvbatch.fetch import smollm2_dir

    return smollm2_dir()


def _input(args, n: int) -> Path:
    bad = args.bad_line if args.bad_line and args.bad_line <= n else None
    cap = RUN_MAX_TOKENS if args.run else SUBMIT_MAX_TOKENS
    temperature = RUN_TEMPERATURE if args.run else None
    name = f"chat-{n}{f'-bad{bad}' if bad else ''}{f'-max{cap}-greedy' if args.run else ''}.jsonl"
    path = args.workdir / name
    if not path.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_chat_job(tmp, n, bad_lines={bad: BAD_LINE} if bad else None, max_tokens=cap,
                       temperature=temperature)  # fmt: skip
        tmp.rename(path)
    return path


def _run_one(args, model: str, n: int) -> dict:
    import torch

    from kvbatch.jobs.local.run import RunOptions, run_job

    torch.set_num_threads(1)
    src = _input(args, n)
    out = args.workdir / f"run-{n}.output.jsonl"
    # As `kvbatch run --max-num-seqs 64` runs it: the tokenizer read first (the pool of
    # processes forked from a process without the weights), then the engine, with a KV pool of
    # fixed size (its prefix index is bounded by the pool, not by the job).
    opts = RunOptions(input=str(src), model=str(tiny_chat_model(args.workdir, model)),
                      output=str(out), engine={"max_num_seqs": 64, "num_kv_blocks": 2048})  # fmt: skip
    wall, cpu = time.perf_counter(), _cpu_seconds()
    record = run_job(opts)
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    errors = out.with_name(f"run-{n}.output.errors.jsonl")
    error_lines = [json.loads(x)["error"]["line"] for x in errors.open("rb")][:3]
    in_order = _in_input_order(out)
    for path in (out, errors, out.with_name(f"run-{n}.output.batch.json")):
        path.unlink(missing_ok=True)
    return {
        **_measured(n, src, wall, cpu),
        "answered": record.completed,
        "in_order": in_order,
        "invalid": record.failed,
        "error_lines": error_lines,
    }


def tiny_chat_model(workdir: Path, tokenizer_dir: str) -> Path:
    """A random Llama of hidden size 64 and 2 layers with `tokenizer_dir`'s vocabulary,
    tokenizer and chat template, built once into `workdir`. (Imported here: the submit rows'
    processes never load torch.)"""
    from kvbatch.bench.models import ModelSpec, build_once, build_random_model

    spec = ModelSpec(name="tiny-chat", hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     vocab_size=49152, max_position_embeddings=2048, dtype="float32")  # fmt: skip

    def write(folder: Path) -> None:
        build_random_model(spec, folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, folder / name)

    return build_once(workdir / f"tiny-chat-{spec.key()}", _has_tokenizer, write)


def _has_tokenizer(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("config.json", "tokenizer.json"))


def _in_input_order(output: Path) -> bool:
    """Whether the output's custom_ids (req-<line index>) rise line by line."""
    last = -1
    with output.open("rb") as f:
        for raw in f:
            n = int(json.loads(raw)["custom_id"].rsplit("-", 1)[1])
            if n <= last:
                return False
            last = n
    return True


def _submit_one(args, model: str, n: int) -> dict:
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.jobs.local.scan_progress import ScanProgress
    from kvbatch.jobs.model_info import load_tokenizer

    load_tokenizer(model)  # imports transformers: not the job's cost
    src = _input(args, n)
    out = args.workdir / f"out-{n}"
    shutil.rmtree(out, ignore_errors=True)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    job = prepare_job(
        str(src), str(out), model, shard_tokens=args.shard_tokens, job_id="bench",
        progress=ScanProgress(None),
    )  # fmt: skip
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    errors = [json.loads(x) for x in (out / "bench" / "validation_errors.jsonl").open("rb")]
    shutil.rmtree(out, ignore_errors=True)
    return {
        **_measured(n, src, wall, cpu),
        "shards": len(job.messages),
        "requests": job.num_requests,
        "invalid": job.num_invalid,
        "error_lines": [e["error"]["line"] for e in errors[:3]],
    }


def _measured(n: int, src: Path, wall: float, cpu: float) -> dict:
    """A row's size, times and peak resident memory (this process's, and the largest of the
    pool's processes: kvbatch.jobs.local.line_pool; 0 MB: no pool)."""
    from kvbatch.jobs.local.line_pool import default_workers

    return {
        "lines": n,
        "bytes": src.stat().st_size,
        "seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "us_per_line": round(1e6 * wall / n),
        "cpu_us_per_line": round(1e6 * cpu / n),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "worker_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "workers": default_workers(),
    }


def _cpu_seconds() -> float:
    """CPU of this process and of its reaped children (the pool's processes)."""
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _table(rows: list[dict]) -> str:
    run = "answered" in rows[0]
    head = ["lines", "input", "s", "ms/line", "vs first", "CPU s", "CPU ms/line", "peak RSS",
            "workers (peak RSS)", "answered (in order)" if run else "shards",
            "invalid (lines)"]  # fmt: skip
    base = rows[0]["us_per_line"] or 1
    body = [
        [
            str(c)
            for c in [
                f"{r['lines']:,}",
                f"{r['bytes'] / 1e6:.0f} MB",
                r["seconds"],
                f"{r['us_per_line'] / 1000:.2f}",
                f"{r['us_per_line'] / base:.2f}x",
                r["cpu_seconds"],
                f"{r['cpu_us_per_line'] / 1000:.2f}",
                f"{r['peak_rss_mb']} MB",
                f"{r['workers']} ({r['worker_peak_rss_mb']} MB)",
                f"{r['answered']:,} ({'yes' if r['in_order'] else 'NO'})" if run else r["shards"],
                f"{r['invalid']} {r['error_lines']}",
            ]
        ]  # fmt: skip
        for r in rows
    ]
    return "\n".join(format_rows([head, *body]))


if __name__ == "__main__":
    sys.exit(main())
