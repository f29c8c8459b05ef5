"""The appliance's store on a real PostgreSQL server, started by the test from Debian's package (initdb and
pg_ctl in a temp directory, on a free loopback port; as the `postgres` user when the tests run as root), then the
service on it: jobs queue, run and survive a kill -9 of the service the same as on SQLite."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_helpers import free_port
from waferscale.appliance.store import Store

pytestmark = pytest.mark.slow


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


@pytest.fixture
def postgres() -> Iterator[str]:
    bin_ = _pg_bin()
    if bin_ is None:
        pytest.skip("PostgreSQL's server is not installed (Debian's postgresql package; `make setup` installs it "
                    "when it can)")
    root = os.geteuid() == 0
    as_pg = ["runuser", "-u", "postgres", "--"] if root else []
    d = Path(tempfile.mkdtemp(prefix="wsc-pg-"))  # (not under pytest's 0700 tmp: the postgres user must reach it)
    if root:
        shutil.chown(d, "postgres")
    port = free_port()
    data = d / "data"
    run = lambda *a: subprocess.run(as_pg + list(a), capture_output=True, text=True, timeout=120)  # noqa: E731
    r = run(str(bin_ / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync")
    assert r.returncode == 0, r.stderr
    r = run(str(bin_ / "pg_ctl"), "-D", str(data), "-l", str(d / "log"), "-w", "-t", "60", "-o",
            f"-p {port} -k {d} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    assert r.returncode == 0, r.stderr + (d / "log").read_text(errors="replace")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        run(str(bin_ / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(d, ignore_errors=True)


def test_the_store_on_postgresql(postgres: str) -> None:
    store = Store(postgres)
    assert store.engine.dialect.name == "postgresql" and store.version == 2
    token = store.create_user("alice", quota=2)
    assert store.user_for_token(token).quota == 2
    job, new = store.submit(user="alice", kind="script", spec={"script": "x.py"}, num_csx=1, priority=2, client_id="c")
    again, new2 = store.submit(user="alice", kind="script", spec={}, num_csx=1, priority=2, client_id="c")
    assert new and not new2 and again.id == job.id
    assert store.transition(job.id, ["QUEUED"], "RUNNING", "started", systems=[0], attempts=1)
    assert not store.transition(job.id, ["QUEUED"], "RUNNING", "again")  # compare-and-set: nobody moves it twice
    assert Store(postgres).job(job.id).systems == [0]  # a second opening migrates nothing and sees it all
    assert [e["state"] for e in store.events(job.id)] == ["QUEUED", "RUNNING"]


def test_the_service_on_postgresql_survives_a_kill_9(postgres: str, tmp_path: Path) -> None:
    from appliance_helpers import ApplianceProc, wait_file, wait_state
    from test_appliance import USERS, gate_script

    s = ApplianceProc(tmp_path, users=USERS, db=postgres)
    try:
        script = gate_script(tmp_path)
        b = s.client("bob")
        r = b.submit_script(script, [str(tmp_path / "r")], num_csx=2)
        q = b.submit_script(script, [str(tmp_path / "q")])
        wait_file(tmp_path / "r.starts")
        assert b.status(q["id"])["reason"] == "waiting for 1 system, 0 free"
        s.kill9()
        s.start()
        assert b.status(r["id"])["state"] == "RUNNING" and b.status(q["id"])["state"] == "QUEUED"
        (tmp_path / "r.gate").write_text("0")
        (tmp_path / "q.gate").write_text("0")
        assert wait_state(b, q["id"], ("SUCCEEDED",))["attempts"] == 1
        assert len((tmp_path / "r.starts").read_text().splitlines()) == 1
    finally:
        s.stop()
