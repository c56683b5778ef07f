"""A Celery app for test_celery.py; the broker URL comes from the environment."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("tandem_test", broker=os.environ["TANDEM_TEST_AMQP_URL"], backend="rpc://")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_acks_late = True


@app.task
def add(x: int, y: int) -> int:
    return x + y
