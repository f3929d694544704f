"""One-off studies: measurements that answered one design question each.

They are not part of the installed package (pyproject.toml does not list this folder, the image
does not copy it); their results are in docs/archive/BENCHMARKS-history.md. Run one from a
checkout with `python -m studies NAME [options]`; `python -m studies` lists them. They import
the installed `kvbatch` package; nothing in `kvbatch` imports them.
"""
