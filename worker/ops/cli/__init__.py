"""The ``worker`` command: run the consumer or a relay, serve the HTTP ingress, apply migrations,
expire inbox keys, inspect and replay the dead-letter queue, send demo traffic.

Every setting is a ``WORKER_*`` environment variable, read by every command. A command takes as
flags only the settings of the groups it reads, each shown once in its ``--help``, and refuses
another command's setting flag naming the commands that read it; a flag wins over its variable.
Every command takes the deployment's and the logging's flags.

Each command is declared once (``command.Command``: name, help, own flags, body, the settings it
reads) beside its body, in a module per family: ``run`` (run, relay, serve, gc, workflows),
``dlq``, ``outbox``, ``status`` (status, verify, health), ``schema`` (migrate, asyncapi, declare,
convert-queues) and ``demo``. ``parser`` collects them; ``dispatch.main`` runs one.
"""

from worker.ops.cli.command import EVERY_COMMAND, Command, Family
from worker.ops.cli.dispatch import main
from worker.ops.cli.exits import Exit, Interrupted
from worker.ops.cli.flags import load_settings
from worker.ops.cli.parser import COMMANDS, LEAVES, READS, build_parser, settings_table

__all__ = [
    "COMMANDS",
    "EVERY_COMMAND",
    "LEAVES",
    "READS",
    "Command",
    "Exit",
    "Family",
    "Interrupted",
    "build_parser",
    "load_settings",
    "main",
    "settings_table",
]
