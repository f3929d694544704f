"""The source and the LanceDB table both on S3 (moto's server over HTTP): listed, read,
indexed and merged there, and searched."""

from __future__ import annotations

import pytest

from kvbatch.index.pipeline import run_index
from kvbatch.index.search import search
from kvbatch.index.spec import load_spec
from tests.index.conftest import LIGHTHOUSES_HTML, TIDES, VOLCANOES_MD
from tests.index.indexing import WatchedModels

pytestmark = pytest.mark.slow


def test_an_s3_source_into_an_s3_table_with_an_edit_and_a_delete(tmp_path, s3_server, minilm):
    bucket = s3_server.make_bucket()
    s3 = s3_server.client()
    for key, body in [
        ("docs/tides.txt", TIDES),
        ("docs/sub/volcanoes.md", VOLCANOES_MD),
        ("docs/lighthouses.html", LIGHTHOUSES_HTML),
        ("docs/ignored.csv", "a,b"),
        ("other/not-under-the-prefix.txt", "x"),
    ]:
        s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    (tmp_path / "index.toml").write_text(f"""
[source]
path = "s3://{bucket}/docs"
[chunking]
size = 64
[stages]
context = false
[models]
embedding = "{minilm}"
[output]
uri = "s3://{bucket}/index"
""")  # the run folder beside the table: s3://<bucket>/index.runs
    spec = load_spec(tmp_path / "index.toml")
    assert spec.output.runs == f"s3://{bucket}/index.runs"
    first = run_index(spec, llm_factory=WatchedModels())
    runs = s3.list_objects_v2(Bucket=bucket, Prefix="index.runs/").get("Contents", [])
    assert {k["Key"].rsplit("/", 1)[1] for k in runs} == {"chunks.parquet", "manifest.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.toml"]  # nothing local
    assert (first.documents_seen, first.errors) == (3, [])
    hit = search(spec.output.uri, "Fresnel lens", k=1)[0]
    assert hit.document_id == "lighthouses.html"
    assert hit.source_uri == f"s3://{bucket}/docs/lighthouses.html"

    s3.put_object(Bucket=bucket, Key="docs/tides.txt", Body=(TIDES + " Neap tides too.").encode())
    s3.delete_object(Bucket=bucket, Key="docs/sub/volcanoes.md")
    second = run_index(spec, llm_factory=WatchedModels())
    assert (second.documents_parsed, second.documents_deleted) == (1, 1)
    assert second.table_version > first.table_version
    found = {h.document_id for h in search(spec.output.uri, "volcano magma", k=10)}
    assert found == {"tides.txt", "lighthouses.html"}
    assert not run_index(spec, llm_factory=WatchedModels()).wrote
