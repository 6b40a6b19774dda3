"""Every SQL statement the worker runs on its own tables, and nowhere else: SQLAlchemy Core with
bound parameters, each function taking the caller's connection so that it runs in the caller's
transaction. One module per audience: ``inbox`` and ``outbox`` (the hot path), ``maintenance``
(janitor, probes) and ``inspection`` (metrics, admin, verify); ``tables`` declares the schema.
"""
