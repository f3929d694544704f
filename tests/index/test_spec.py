"""load_spec: a full spec, the defaults, and errors that name the field at fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbatch.index.prompts import CONTEXT_PROMPT
from kvbatch.index.spec import SpecError, load_spec

MINIMAL = """
[source]
path = "docs"
[models]
generation = "gen"
embedding = "emb"
[output]
uri = "index"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "index.toml"
    path.write_text(text)
    return path


def test_a_full_spec_loads_with_paths_taken_from_its_folder(tmp_path):
    (tmp_path / "gen").mkdir()
    spec = load_spec(
        write(
            tmp_path,
            """
prompt_version = "v7"
[source]
path = "docs"
include = ["*.md"]
exclude = ["drafts/*"]
max_bytes = 1000
[chunking]
size = 200
overlap = 20
[stages.context]
max_tokens = 60
[stages.questions]
n = 2
[stages.summary]
[stages.embed]
[models]
generation = "gen"
embedding = "org/embedder"
generation_revision = "abc"
[output]
uri = "s3://bucket/index"
runs = "runs"
table = "docs_v2"
[engine]
max_num_seqs = 8
""",
        )
    )
    assert spec.source.uri == str(tmp_path / "docs")
    assert spec.source.include == ("*.md",) and spec.source.exclude == ("drafts/*",)
    assert (spec.chunking.size, spec.chunking.overlap) == (200, 20)
    assert spec.stages.context.max_tokens == 60 and spec.stages.context.prompt == CONTEXT_PROMPT
    assert spec.stages.questions.n == 2 and spec.stages.summary is not None and spec.stages.embed
    assert spec.models.generation == str(tmp_path / "gen")  # a folder beside the spec
    assert spec.models.embedding == "org/embedder"  # a Hub id, as written
    assert spec.output.uri == "s3://bucket/index" and spec.output.runs == str(tmp_path / "runs")
    assert spec.output.table == "docs_v2" and spec.engine == {"max_num_seqs": 8}
    assert spec.effective_prompt_version == "v7"


def test_defaults_context_and_embed_and_the_runs_beside_the_index(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    assert spec.stages.context is not None and spec.stages.embed
    assert spec.stages.questions is None and spec.stages.summary is None
    assert spec.output.runs == str(tmp_path / "index") + ".runs"
    assert spec.effective_prompt_version.startswith("p-")


def test_the_prompt_version_follows_the_prompts_and_stage_settings(tmp_path):
    a = load_spec(write(tmp_path, MINIMAL)).effective_prompt_version
    b = load_spec(write(tmp_path, MINIMAL + "[stages.context]\nmax_tokens = 7\n"))
    assert b.effective_prompt_version != a


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.replace("[source]\npath", "[source]\npaht"), "source.paht"),
        (lambda s: s.replace('[source]\npath = "docs"\n', ""), "source"),
        (lambda s: s + "[chunking]\nsize = 'big'\n", "chunking.size"),
        (lambda s: s + "[chunking]\nsize = 100\noverlap = 100\n", "chunking.overlap"),
        (lambda s: s.replace('generation = "gen"\n', ""), "models.generation"),
        (lambda s: s.replace('embedding = "emb"\n', ""), "models.embedding"),
        (lambda s: s + "[stages.questions]\nn = 0\n", "stages.questions.n"),
        (lambda s: s + "[stages.context]\nprompt = 'no placeholders'\n", "stages.context.prompt"),
        (
            lambda s: s + "[stages.context]\nprompt = '{chunk} then {document}'\n",
            "stages.context.prompt",
        ),
        (lambda s: s + "[stages.summary]\nenabled = 'yes'\n", "stages.summary.enabled"),
        (lambda s: s.replace('uri = "index"', 'uri = "s3:/b/i"'), "output.uri"),
        (lambda s: s.replace('uri = "index"', 'uri = "i"\nruns = "s3:/b/runs"'), "output.runs"),
        (lambda s: s.replace('uri = "index"', 'uri = "i"\nruns = "gs://b/runs"'), "output.runs"),
        (lambda s: s.replace('path = "docs"', 'path = "s3:docs"'), "source.path"),
        (lambda s: s.replace('uri = "index"', 'uri = "i"\ntable = "../x"'), "output.table"),
        (lambda s: s + "colour = 'blue'\n", "colour"),
        (lambda s: s.replace('path = "docs"', 'path = "docs"\ninclude = []'), "source.include"),
        (lambda s: s.replace('path = "docs"', 'path = "s3://"'), "source.path"),
        (lambda s: s.replace('uri = "index"', 'uri = "s3:///index"'), "output.uri"),
        (lambda s: s.replace('uri = "index"', 'uri = "docs/index"'), "output.uri"),
        (lambda s: s.replace('uri = "index"', 'uri = "docs"'), "output.uri"),
        (lambda s: s.replace('uri = "index"', 'uri = "."'), "output.uri"),
        (lambda s: s.replace('uri = "index"', 'uri = "i"\nruns = "docs/runs"'), "output.runs"),
        (
            lambda s: s + "[stages.context]\nprompt = '{document} {chunk} {title}'\n",
            "stages.context.prompt",
        ),
        (
            lambda s: s + "[stages.context]\nprompt = '{document} {chunk} as {\"json\": 1}'\n",
            "stages.context.prompt",
        ),
        (
            lambda s: s + "[stages.summary]\nprompt = '{document} in {n} words'\n",
            "stages.summary.prompt",
        ),
        (lambda s: s + "[stages.summary]\nprompt = '{document} }'\n", "stages.summary.prompt"),
    ],
)
def test_a_wrong_field_is_named(tmp_path, edit, field):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, edit(MINIMAL)))
    assert str(e.value).startswith(field + ":") or f"{field}:" in str(e.value), str(e.value)


def test_no_generation_model_is_needed_without_generation_stages(tmp_path):
    text = MINIMAL.replace('generation = "gen"\n', "") + "[stages]\ncontext = false\n"
    spec = load_spec(write(tmp_path, text))
    assert not spec.stages.generates and spec.models.generation is None


def test_a_missing_or_broken_file_says_so(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "absent.toml")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(write(tmp_path, "[source\n"))


def test_a_prompt_with_escaped_braces_and_its_own_fields_loads(tmp_path):
    extra = "[stages.questions]\nprompt = '{document} {chunk}: {n} questions as {{\"q\": []}}'\n"
    spec = load_spec(write(tmp_path, MINIMAL + extra))
    assert spec.stages.questions.prompt.format(document="d", chunk="c", n=2) == (
        'd c: 2 questions as {"q": []}'
    )


@pytest.mark.parametrize("field", ["uri", "runs"])
def test_an_output_path_that_is_a_file_is_named(tmp_path, field):
    (tmp_path / "taken").write_text("x")
    text = MINIMAL.replace('uri = "index"', 'uri = "index"\nruns = "index.runs"')
    text = text.replace(
        f'{field} = "index{".runs" if field == "runs" else ""}"', f'{field} = "taken"'
    )
    with pytest.raises(SpecError, match=f"output.{field}: .*taken is a file"):
        load_spec(write(tmp_path, text))


def test_the_run_folder_may_be_on_s3_and_defaults_beside_an_s3_table(tmp_path):
    """A fleet shares the bucket, not a volume: runs on S3, by default next to the table."""
    beside = load_spec(write(tmp_path, MINIMAL.replace('uri = "index"', 'uri = "s3://b/i"')))
    assert beside.output.runs == "s3://b/i.runs"
    named = MINIMAL.replace('uri = "index"', 'uri = "i"\nruns = "s3://b/runs"')
    assert load_spec(write(tmp_path, named)).output.runs == "s3://b/runs"
    assert not (tmp_path / "s3:").exists()
