"""The Celery app as a module attribute, for Celery's own command line and for Flower:

    KVBATCH_BROKER_URL=redis://host:6379/0 celery -A kvbatch.worker.celery_app inspect ping
    KVBATCH_BROKER_URL=... KVBATCH_TASK_EVENTS=1 kvbatch worker --model ...   # events on
    KVBATCH_BROKER_URL=... celery -A kvbatch.worker.celery_app events
    KVBATCH_BROKER_URL=... celery -A kvbatch.worker.celery_app flower

Configured from the environment exactly as `kvbatch worker` configures its own app
(kvbatch.worker.app.make_app): KVBATCH_BROKER_URL, KVBATCH_VISIBILITY_TIMEOUT,
KVBATCH_TASK_EVENTS, and on SQS AWS_REGION and KVBATCH_SQS_QUEUE_URL. Importing it without a
broker URL fails with the message that says what to set.
"""

from __future__ import annotations

from kvbatch.worker.app import broker_url, make_app

app = make_app(broker_url())
