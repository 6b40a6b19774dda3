"""The inventory service: stock levels kept by the worker, exactly once per message."""
