"""A job run on one machine (`kvbatch run`): partial output, the output lock, the token store, progress."""
