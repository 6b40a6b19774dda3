"""Producers of the payments example's messages, as ``docs/publishing.md`` shows them: over AMQP
with aio-pika (``publish_amqp``, also a command for the shell), and through the outbox in the
producer's own transaction (``publish_outbox``). ``tests/integration/test_producer_snippets.py``
runs them against the real broker and a worker."""
