"""RAG indexing: documents in, a vector index out, incrementally and exactly once
(`kvbatch index SPEC.toml`; docs/INDEXING.md). The public entry points are
`kvbatch.index.spec.load_spec`, `kvbatch.index.pipeline.run_index` and
`kvbatch.index.search.search`."""
