"""ingress: requests belong to the client that posted them

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25

A request is now (handler, client, key): each client (the name of its bearer token; every
request is ``anonymous`` without tokens) has keys of its own, and its handler runs under
``handler_key`` (``http:<client>:<key>``), a key space no message sent over AMQP shares.

Rows accepted before: their client is unknown, so they get the empty client, which no request
speaks for (their results are read by nobody), and their ``handler_key`` is their key (their
events, perhaps still in the outbox, carry it). The ingress still finds them for a retry of the
same key within the retention, so a request sent before the upgrade and again after it is
answered as the first was (never a second event). The downgrade keeps every row, keyed by the
key its handler runs under (which the code of 0004 reads the inbox with).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLIENT_COMMENT = "the client that posted it; empty: accepted before clients were told apart"


def upgrade() -> None:
    op.add_column(
        "ingress_requests",
        sa.Column("client", sa.Text(), nullable=False, server_default="", comment=CLIENT_COMMENT),
    )
    op.alter_column("ingress_requests", "client", server_default=None)
    op.add_column(
        "ingress_requests",
        sa.Column(
            "handler_key", sa.Text(), nullable=True, comment="the key its handler runs under"
        ),
    )
    op.execute("UPDATE ingress_requests SET handler_key = key")
    op.alter_column("ingress_requests", "handler_key", nullable=False)
    op.drop_constraint(op.f("pk_ingress_requests"), "ingress_requests", type_="primary")
    op.create_primary_key(
        op.f("pk_ingress_requests"), "ingress_requests", ["handler", "client", "key"]
    )


def downgrade() -> None:
    op.drop_constraint(op.f("pk_ingress_requests"), "ingress_requests", type_="primary")
    op.execute("UPDATE ingress_requests SET key = handler_key")
    op.create_primary_key(op.f("pk_ingress_requests"), "ingress_requests", ["handler", "key"])
    op.drop_column("ingress_requests", "handler_key")
    op.drop_column("ingress_requests", "client")
