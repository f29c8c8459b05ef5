"""The appliance's store: jobs, users and their tokens, and each job's state history, in one SQL database.

SQLAlchemy Core over embedded SQLite by default (a file in the state directory, WAL mode, so the page and the
CLI read while the scheduler writes) or PostgreSQL by URL (`postgresql+psycopg://user@host/db`). The schema
carries its version (table `meta`): opening an older database runs the migrations after its version, in one
transaction, so an upgrade keeps every job. Every state change is a compare-and-set on the job's current state
(`transition`), so two writers can never both move a job, and each one is logged in `job_events`.

Tokens are stored as SHA-256 hashes: the store can tell who a token belongs to, never what it is.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from waferscale.errors import UserError

__all__ = ["ACTIVE", "Job", "STATES", "Store", "StoreError", "TERMINAL", "User", "hash_token"]

STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")
ACTIVE = ("QUEUED", "RUNNING")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class StoreError(UserError):
    """The database cannot be opened or is not one of ours."""


meta = sa.MetaData()
t_meta = sa.Table("meta", meta, sa.Column("key", sa.String(64), primary_key=True), sa.Column("value", sa.Text))
t_users = sa.Table(
    "users", meta,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("admin", sa.Boolean, nullable=False, default=False),
    sa.Column("quota", sa.Integer, nullable=True),  # most systems the user's jobs may hold at once; None: the pool
    sa.Column("created_at", sa.Float, nullable=False),
)
t_jobs = sa.Table(
    "jobs", meta,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # submission order (FIFO within priority)
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("user", sa.String(64), nullable=False, index=True),
    sa.Column("client_id", sa.String(128), nullable=True),
    sa.Column("kind", sa.String(16), nullable=False),  # run | script | deploy
    sa.Column("spec", sa.Text, nullable=False),  # JSON: what to run (launch.py reads it)
    sa.Column("num_csx", sa.Integer, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),  # 1 (p1, first) .. 3
    sa.Column("labels", sa.Text, nullable=False, default="{}"),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("systems", sa.Text, nullable=True),  # JSON list of the pool's system ids while running
    sa.Column("handle", sa.Text, nullable=True),  # JSON: how the launcher finds the job's processes
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("submitted_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=True),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("cancel_at", sa.Float, nullable=True),  # when a cancel was asked for
    sa.UniqueConstraint("user", "client_id", name="uq_jobs_user_client_id"),
)
t_events = sa.Table(
    "job_events", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(32), nullable=False, index=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)


def _v1(conn: Connection) -> None:  # the first schema: users and jobs
    for t in (t_meta, t_users, t_jobs):
        t.create(conn)


def _v2(conn: Connection) -> None:  # each job's state history (`wsc status` shows it)
    t_events.create(conn)
    for row in conn.execute(sa.select(t_jobs.c.id, t_jobs.c.state, t_jobs.c.reason, t_jobs.c.submitted_at)):
        conn.execute(t_events.insert().values(job_id=row.id, at=row.submitted_at, state=row.state, reason=row.reason))


MIGRATIONS: list[Callable[[Connection], None]] = [_v1, _v2]  # MIGRATIONS[i] takes a database to version i + 1


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class User:
    name: str
    admin: bool
    quota: int | None


@dataclass
class Job:
    id: str
    seq: int
    user: str
    kind: str
    spec: dict[str, Any]
    num_csx: int
    priority: int
    state: str
    reason: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    client_id: str | None = None
    systems: list[int] | None = None
    handle: dict[str, Any] | None = None
    attempts: int = 0
    exit_code: int | None = None
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    cancel_at: float | None = None

    @classmethod
    def _from(cls, r: Any) -> Job:
        j = lambda s: json.loads(s) if s else None  # noqa: E731
        return cls(id=r.id, seq=r.seq, user=r.user, kind=r.kind, spec=json.loads(r.spec), num_csx=r.num_csx,
                   priority=r.priority, state=r.state, reason=r.reason, labels=json.loads(r.labels or "{}"),
                   client_id=r.client_id, systems=j(r.systems), handle=j(r.handle), attempts=r.attempts,
                   exit_code=r.exit_code, submitted_at=r.submitted_at, started_at=r.started_at,
                   ended_at=r.ended_at, cancel_at=r.cancel_at)

    def public(self) -> dict[str, Any]:
        """The job as the API shows it (no handle: that is the service's own)."""
        d = {k: v for k, v in self.__dict__.items() if k != "handle"}
        d["priority"] = f"p{self.priority}"
        return d


class Store:
    """One database; safe to share between the service's threads (each call is its own transaction)."""

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self.engine: Engine = sa.create_engine(url, future=True, pool_pre_ping=True)
        except Exception as e:  # an unknown dialect, a malformed URL, a missing driver
            raise StoreError(f"cannot open the appliance database {_safe(url)}: {e} "
                             f"(give --db sqlite:///PATH or postgresql+psycopg://USER@HOST/DB)") from None
        if self.engine.dialect.name == "sqlite":  # (pysqlite runs DDL outside transactions unless told: a
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)  # migration is then not atomic)
            sa.event.listen(self.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
        try:
            self.version = self._migrate()
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"cannot open the appliance database {_safe(url)}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0]}") from None

    # ---- schema --------------------------------------------------------------------------------------------
    def _migrate(self) -> int:
        with self.engine.begin() as conn:
            have = sa.inspect(conn).get_table_names()
            if "meta" in have:
                row = conn.execute(sa.select(t_meta.c.value).where(t_meta.c.key == "schema_version")).first()
                version = int(row.value) if row else 0
            elif have:
                raise StoreError(f"{_safe(self.url)} holds tables that are not the appliance's ({', '.join(have)});"
                                 f" give the appliance a database of its own")
            else:
                version = 0
            if version > len(MIGRATIONS):
                raise StoreError(f"{_safe(self.url)} has schema version {version}, newer than this waferscale "
                                 f"knows ({len(MIGRATIONS)}): upgrade waferscale")
            for v in range(version, len(MIGRATIONS)):
                MIGRATIONS[v](conn)
                conn.execute(t_meta.delete().where(t_meta.c.key == "schema_version"))
                conn.execute(t_meta.insert().values(key="schema_version", value=str(v + 1)))
            return len(MIGRATIONS)

    # ---- users -----------------------------------------------------------------------------------------------
    def create_user(self, name: str, *, admin: bool = False, quota: int | None = None) -> str:
        """A new token for `name` (the user is created, or their token replaced). Returns the token."""
        token = "wsc-" + secrets.token_urlsafe(32)
        row = dict(token_hash=hash_token(token), admin=admin, quota=quota)
        with self.engine.begin() as conn:
            if conn.execute(sa.select(t_users.c.name).where(t_users.c.name == name)).first():
                conn.execute(t_users.update().where(t_users.c.name == name).values(**row))
            else:
                conn.execute(t_users.insert().values(name=name, created_at=time.time(), **row))
        return token

    def user_for_token(self, token: str) -> User | None:
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(t_users).where(t_users.c.token_hash == hash_token(token))).first()
        return User(r.name, bool(r.admin), r.quota) if r else None

    def quotas(self) -> dict[str, int | None]:
        with self.engine.connect() as conn:
            return {r.name: r.quota for r in conn.execute(sa.select(t_users.c.name, t_users.c.quota))}

    # ---- jobs ------------------------------------------------------------------------------------------------
    def submit(self, *, user: str, kind: str, spec: dict[str, Any], num_csx: int, priority: int,
               labels: dict[str, str] | None = None, client_id: str | None = None,
               reason: str = "queued") -> tuple[Job, bool]:
        """Queue a job; with a `client_id` the user already used, the job that id made (and False)."""
        with self.engine.begin() as conn:
            if client_id is not None:
                old = conn.execute(sa.select(t_jobs).where(t_jobs.c.user == user,
                                                           t_jobs.c.client_id == client_id)).first()
                if old:
                    return Job._from(old), False
            now = time.time()
            jid = "j-" + secrets.token_hex(6)
            conn.execute(t_jobs.insert().values(
                id=jid, user=user, client_id=client_id, kind=kind, spec=json.dumps(spec), num_csx=num_csx,
                priority=priority, labels=json.dumps(labels or {}), state="QUEUED", reason=reason,
                attempts=0, submitted_at=now))
            conn.execute(t_events.insert().values(job_id=jid, at=now, state="QUEUED", reason=reason))
            return Job._from(conn.execute(sa.select(t_jobs).where(t_jobs.c.id == jid)).one()), True

    def job(self, jid: str) -> Job | None:
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(t_jobs).where(t_jobs.c.id == jid)).first()
        return Job._from(r) if r else None

    def jobs(self, *, user: str | None = None, states: Iterable[str] | None = None) -> list[Job]:
        """Jobs in submission order, of `user` (None: everyone's), in `states` (None: all)."""
        q = sa.select(t_jobs).order_by(t_jobs.c.seq)
        if user is not None:
            q = q.where(t_jobs.c.user == user)
        if states is not None:
            q = q.where(t_jobs.c.state.in_(list(states)))
        with self.engine.connect() as conn:
            return [Job._from(r) for r in conn.execute(q)]

    def events(self, jid: str) -> list[dict[str, Any]]:
        q = sa.select(t_events.c.at, t_events.c.state, t_events.c.reason).where(t_events.c.job_id == jid)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q.order_by(t_events.c.id))]

    def transition(self, jid: str, frm: Iterable[str], to: str, reason: str, **fields: Any) -> bool:
        """Move job `jid` from one of `frm` to `to` with `reason` (and set `fields`), only if it is in one of
        `frm` now. Returns whether it moved."""
        vals = {k: json.dumps(v) if k in ("systems", "handle") and v is not None else v for k, v in fields.items()}
        with self.engine.begin() as conn:
            n = conn.execute(t_jobs.update().where(t_jobs.c.id == jid, t_jobs.c.state.in_(list(frm)))
                             .values(state=to, reason=reason, **vals)).rowcount
            if n:
                conn.execute(t_events.insert().values(job_id=jid, at=time.time(), state=to, reason=reason))
            return bool(n)

    def update(self, jid: str, **fields: Any) -> None:
        """Set fields of a job without a state change (a queued job's reason, a running job's handle)."""
        vals = {k: json.dumps(v) if k in ("systems", "handle") and v is not None else v for k, v in fields.items()}
        with self.engine.begin() as conn:
            conn.execute(t_jobs.update().where(t_jobs.c.id == jid).values(**vals))

    def request_cancel(self, jid: str) -> bool:
        """Mark an active job for cancelling (the service's loop carries it out). Returns whether it was active."""
        active = (t_jobs.c.id == jid) & t_jobs.c.state.in_(ACTIVE)
        with self.engine.begin() as conn:
            conn.execute(t_jobs.update().where(active, t_jobs.c.cancel_at.is_(None)).values(cancel_at=time.time()))
            return conn.execute(sa.select(t_jobs.c.id).where(active)).first() is not None


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # transactions are begun by the "begin" event
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _safe(url: str) -> str:
    """The URL without its password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        return repr(url)
