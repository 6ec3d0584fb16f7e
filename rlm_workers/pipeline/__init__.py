"""The query pipeline, one module per stage: its messages, the parsing of its replies and its logic.

The order of the stages and the prologue they share are in ``flow.py``; the
Celery tasks that run them are thin adapters in ``rlm_workers/tasks/pipeline.py``.
"""
