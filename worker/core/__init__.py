"""A message's path, transport-free: handlers and their router, the checks that turn a delivery
into an envelope, the unit of work (one transaction: inbox claim, business write, outbox append)
and workflows. Nothing here imports the broker client, the settings, metrics or operator tools.
"""
