"""The operator console, ``worker console``: pages over the worker's own tables and queues for a
person in a browser, and the actions the command line has (replay and purge dead letters, retry,
hurry and cancel outbox rows), carried out by the same code.

Layout: ``app`` builds the application; ``accounts`` says who a token is and what they may do
(``Role``); ``sessions`` keeps logged-in browsers in memory; ``guard`` is what every request
passes (Host check, security headers) and the dependencies a page declares (``viewer``,
``operator_action``); ``templating`` renders the Jinja2 templates of ``templates/``, escaping
every value; ``audit`` records each action; ``pages/`` holds one module per page, each an
``APIRouter`` listed in ``pages.ROUTERS``; ``serve`` runs it under uvicorn.

Invariants: the console is off unless started, listens on 127.0.0.1 unless told otherwise, and
serves nothing but ``/login`` and its static files to a browser without a session. A session is
an HttpOnly, SameSite=Strict cookie (``Secure`` behind TLS, see ``console_url``) naming a random
id kept in memory. Every POST but the login's carries the session's CSRF token, and a read-only
session changes nothing. Every action, refused or done, leaves a row in ``console_audit``.
Every value a page shows is escaped by the template engine: message bodies and headers are
attacker-controlled.
"""
