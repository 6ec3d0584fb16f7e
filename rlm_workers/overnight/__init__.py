"""Overnight batches: many queries × many buffers, one pipeline job per (query, buffer) item.

Publicly they keep the name "batch" (``rlm batch …``, ``/v1/batches``, tasks
``rlm.batch.*``); inside the code and the tables (``overnight_batches``, ``overnight_batch_items``) they
are "overnight", because an analyst batch (a group of chunks for one analyst call,
``job_batches``) is another thing altogether.

``submit.py`` stores, cancels and reads them; ``scheduler.py`` is the tick that
advances them and the reconciler's re-arm; ``cache.py`` keys the result cache.
The Celery tasks are thin adapters in ``rlm_workers.tasks.overnight``.  A batch
waits in PostgreSQL until a worker serving ``rlm.control`` (``rlm worker`` or
``rlm up``) picks it up.
"""
