"""The queue layer: the Celery app's settings, sending a shard's pointer message, SQS queues and
resending lost shards. Both the index (`kvbatch index --broker`) and the workers build on it, so
the index never imports the worker package:

    worker -> index -> broker -> jobs -> engine -> kernels

No task runs here (worker/tasks.py registers and runs the shard task), and jobs/ stays free of
Celery."""
