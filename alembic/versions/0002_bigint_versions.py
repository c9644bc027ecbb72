"""adapter versions as BIGINT

The API accepts versions 1..2**63-1; PostgreSQL's INTEGER stopped at 2**31-1, so a version it accepted
failed at the row's INSERT, after its objects were written. SQLite's INTEGER is 64-bit already.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS = (("adapter_versions", "version", False), ("aliases", "version", False), ("jobs", "adapter_version", True))


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, nullable in COLUMNS:
        op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer(), existing_nullable=nullable)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, nullable in COLUMNS:
        op.alter_column(table, column, type_=sa.Integer(), existing_type=sa.BigInteger(), existing_nullable=nullable)
