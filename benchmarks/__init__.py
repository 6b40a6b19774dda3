"""Benchmarks of the worker against the local PostgreSQL and RabbitMQ (not part of the tests)."""
