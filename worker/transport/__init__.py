"""The RabbitMQ side: consuming the work queue (an ack only after the commit), the copies a failed
delivery is turned into, the topology, and the relay that publishes committed outbox rows."""
