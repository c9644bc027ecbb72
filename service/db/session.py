"""Engine and session factory. SQLite gets WAL, a busy timeout and write-intent transactions.

Several processes (the API and job workers) write one SQLite file; `BEGIN IMMEDIATE` takes the
write lock up front so a read-then-write transaction never fails with SQLITE_BUSY half-way.
Read-only work uses an engine with plain `BEGIN` (`write_intent=False`): WAL readers never
wait for the writer, so GETs do not queue behind writes.
"""

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_db_engine(url: str, write_intent: bool = True) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record) -> None:
            dbapi_conn.isolation_level = None  # let us issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write_intent else "BEGIN")

        return engine
    return create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
