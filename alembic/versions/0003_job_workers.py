"""job workers' heartbeats

Each job worker (`inkwell serve`'s or `inkwell worker` on any host) renews its row; /healthz and /metrics count
the rows seen within the lease.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_workers",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("job_workers")
