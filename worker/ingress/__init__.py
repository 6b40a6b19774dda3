"""The HTTP ingress (the ``http`` extra): clients post messages for the worker's handlers, each
accepted once per Idempotency-Key, and read back what their handler returned.

``create_app`` is the ingress as an application (what ``worker serve`` runs); ``ingress_router``
is its routes, to mount in an application of your own. Importing this package needs FastAPI and
uvicorn: ``pip install 'rabbit-outbox-worker[http]'``; nothing else in the worker imports it.
"""

from worker.ingress.app import create_app
from worker.ingress.routes import ingress_router

__all__ = ["create_app", "ingress_router"]
