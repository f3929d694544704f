"""A job run by workers: submit, shards, cancel, finalize."""
