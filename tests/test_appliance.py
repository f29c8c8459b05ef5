"""Appliance mode on one machine, for real: the service is `wsc appliance start` in its own process (real HTTP,
real SQLite in WAL mode), jobs are real processes (small scripts, and real `wsc run` training runs), users drive it
with the real CLI and the Python client. The scheduler's rule is also checked as a pure function."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from appliance_helpers import ApplianceProc, wait_file, wait_for, wait_state
from conftest import tiny_params, wsc
from serve_helpers import free_port, have_smollm2, tiny_model_dir
from waferscale.appliance import ApplianceError, Client
from waferscale.appliance.scheduler import Pending, schedule
from waferscale.appliance.store import MIGRATIONS, Store


# ---- the scheduler's rule, as a pure function ---------------------------------------------------------------------
def test_priority_then_fifo_and_gang_placement() -> None:
    q = [Pending("a", "u", 1, 2, 1), Pending("b", "u", 1, 1, 2), Pending("c", "v", 2, 2, 3), Pending("d", "v", 1, 2, 4)]
    d = schedule(q, [0, 1, 2], {}, {})
    assert d.starts == [("b", [0]), ("a", [1])]  # p1 first, then FIFO at p2
    assert d.reasons["c"] == "waiting for 2 systems, 1 free"  # all or nothing: c does not take the one left
    assert d.reasons["d"].startswith("waiting behind c (p2, v), which needs 2 systems")  # and d does not pass it


def test_a_stream_of_small_jobs_never_starves_a_large_one() -> None:
    """Every tick, small jobs keep arriving; the large one starts as soon as the pool drains."""
    running: dict[str, list[int]] = {"s0": [0], "s1": [1]}
    queue = [Pending("big", "u", 2, 2, 0)]
    seq = 1
    for tick in range(4):
        queue.append(Pending(f"new{seq}", "v", 1, 2, seq))
        seq += 1
        running.pop(next(iter(running)))  # a small job ends
        free = [s for s in (0, 1) if all(s not in v for v in running.values())]
        d = schedule(queue, free, {}, {})
        for jid, got in d.starts:
            running[jid] = got
            queue = [j for j in queue if j.id != jid]
        if not running or "big" in running:
            break
        assert not d.starts, d  # nothing passes the waiting large job
    assert "big" in running and running["big"] == [0, 1]


def test_quota_holds_a_users_job_without_holding_back_others() -> None:
    q = [Pending("a2", "alice", 1, 1, 1), Pending("b1", "bob", 1, 2, 2)]
    d = schedule(q, [1], {"alice": 1}, {"alice": 1})
    assert d.starts == [("b1", [1])]
    assert d.reasons["a2"] == "waiting for alice's quota: 1 system asked, 1 of 1 in use by their running jobs"


# ---- the store ----------------------------------------------------------------------------------------------------
def test_an_older_database_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'old.db'}"
    eng = sa.create_engine(url)
    with eng.begin() as conn:  # a database as the first schema wrote it, with a queued job
        MIGRATIONS[0](conn)
        conn.exec_driver_sql("INSERT INTO meta VALUES ('schema_version', '1')")
        conn.exec_driver_sql("INSERT INTO jobs (id, user, kind, spec, num_csx, priority, labels, state, reason, "
                             "attempts, submitted_at) VALUES ('j-old', 'alice', 'script', '{}', 1, 2, '{}', 'QUEUED', "
                             "'queued', 0, 1.0)")
    eng.dispose()
    store = Store(url)
    assert store.version == len(MIGRATIONS) == 2
    (job,) = store.jobs()
    assert (job.id, job.state, job.user) == ("j-old", "QUEUED", "alice")
    assert store.events("j-old") == [{"at": 1.0, "state": "QUEUED", "reason": "queued"}]
    token = store.create_user("alice")
    assert store.user_for_token(token).name == "alice" and token not in (tmp_path / "old.db").read_bytes().decode(
        "latin-1")  # only its hash is stored


# ---- the service, for real -------------------------------------------------------------------------------------------
USERS = {"alice": ["--quota", "1"], "bob": [], "carol": []}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ApplianceProc]:
    s = ApplianceProc(tmp_path, users=USERS)
    yield s
    s.stop()


def gate_script(tmp: Path) -> Path:
    """A job that records each start, prints, then waits for its gate file and exits with the code in it
    (SIGTERM: prints 'stopping' and exits 0)."""
    p = tmp / "gated.py"
    p.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('stopping', flush=True), sys.exit(0)))\n"
        "name = sys.argv[1]\n"
        "with open(name + '.starts', 'a') as f: f.write(os.environ['WSC_APPLIANCE_SYSTEMS'] + '\\n')\n"
        "print('started', name, 'on', os.environ['WSC_APPLIANCE_SYSTEMS'], flush=True)\n"
        "while not os.path.exists(name + '.gate'): time.sleep(0.05)\n"
        "code = open(name + '.gate').read().strip()\n"
        "print('boom' if code != '0' else 'done', flush=True)\n"
        "sys.exit(int(code or 0))\n")
    return p


@pytest.mark.slow
def test_two_users_share_two_systems_and_a_third_waits_with_a_reason(service: ApplianceProc, tmp_path: Path) -> None:
    script = gate_script(tmp_path)
    a, b, c = (service.client(u) for u in ("alice", "bob", "carol"))
    ja = a.submit_script(script, [str(tmp_path / "a")])
    jb = b.submit_script(script, [str(tmp_path / "b")])
    alice_systems = wait_state(a, ja["id"], ("RUNNING",))["systems"]
    wait_state(b, jb["id"], ("RUNNING",))
    wait_file(tmp_path / "a.starts")
    wait_file(tmp_path / "b.starts")
    assert {(tmp_path / f"{n}.starts").read_text() for n in "ab"} == {"0\n", "1\n"}  # the systems they were given
    jc = c.submit_script(script, [str(tmp_path / "c")])
    assert jc["state"] == "QUEUED" and jc["reason"] == "waiting for 1 system, 0 free"
    # each user sees only their own jobs; the admin sees everyone's
    assert [j["id"] for j in a.jobs()] == [ja["id"]]
    with pytest.raises(ApplianceError) as e:
        b.status(ja["id"])
    assert e.value.status == 403 and "another user" in str(e.value)
    with pytest.raises(ApplianceError) as e:
        b.cancel(ja["id"])
    assert e.value.status == 403
    assert {j["id"] for j in service.client("admin").jobs()} == {ja["id"], jb["id"], jc["id"]}
    assert sorted(service.client("admin").pool()["used"]) == ["0", "1"]
    # the CLI shows the same
    r = service.cli("carol", "jobs")
    assert r.returncode == 0 and "waiting for 1 system, 0 free" in r.stdout, r.stderr
    (tmp_path / "a.gate").write_text("0")
    jc = wait_state(c, jc["id"], ("RUNNING",))
    assert jc["systems"] == alice_systems  # the system alice's job gave back
    assert wait_state(a, ja["id"], ("SUCCEEDED",))["systems"] is None
    for name, cl, j in (("b", b, jb), ("c", c, jc)):
        (tmp_path / f"{name}.gate").write_text("0")
        assert wait_state(cl, j["id"], ("SUCCEEDED",))["reason"] == "exited with code 0"
    assert service.client("admin").pool()["free"] == 2


@pytest.mark.slow
def test_quota_and_priority_order(service: ApplianceProc, tmp_path: Path) -> None:
    script = gate_script(tmp_path)
    a, b = service.client("alice"), service.client("bob")
    a1 = a.submit_script(script, [str(tmp_path / "a1")])
    a2 = a.submit_script(script, [str(tmp_path / "a2")])  # alice's quota is 1 system
    wait_state(a, a1["id"], ("RUNNING",))
    a2 = a.status(a2["id"])
    assert a2["state"] == "QUEUED" and a2["reason"].startswith("waiting for alice's quota")
    b1 = b.submit_script(script, [str(tmp_path / "b1")])  # passes alice's held job: the quota holds back only her
    wait_state(b, b1["id"], ("RUNNING",))
    b2 = b.submit_script(script, [str(tmp_path / "b2")], priority="p3")
    b3 = b.submit_script(script, [str(tmp_path / "b3")], priority="p1")
    (tmp_path / "b1.gate").write_text("0")
    wait_state(b, b3["id"], ("RUNNING",))  # p1 before the earlier p3
    assert b.status(b2["id"])["state"] == "QUEUED"
    for n in ("a1", "a2", "b2", "b3"):
        (tmp_path / f"{n}.gate").write_text("0")
    for cl, j in ((a, a2), (b, b2)):
        wait_state(cl, j["id"], ("SUCCEEDED",))


@pytest.mark.slow
def test_a_failed_job_says_why_and_gives_back_its_systems(service: ApplianceProc, tmp_path: Path) -> None:
    script = gate_script(tmp_path)
    b = service.client("bob")
    j = b.submit_script(script, [str(tmp_path / "f")], num_csx=2)
    wait_state(b, j["id"], ("RUNNING",))
    (tmp_path / "f.gate").write_text("3")
    j = wait_state(b, j["id"], ("FAILED",))
    assert j["reason"] == "exited with code 3: boom" and j["exit_code"] == 3
    assert j["log_tail"][-1] == "boom" and service.client("bob").pool()["free"] == 2
    r = service.cli("bob", "status", j["id"])
    assert "state: FAILED: exited with code 3: boom" in r.stdout


@pytest.mark.slow
def test_cancel_is_graceful_then_forced(service: ApplianceProc, tmp_path: Path) -> None:
    script = gate_script(tmp_path)
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                        "time.sleep(600)\n")
    b = service.client("bob")
    g = b.submit_script(script, [str(tmp_path / "g")])
    s = b.submit_script(stubborn)
    q = b.submit_script(script, [str(tmp_path / "q")])
    wait_state(b, g["id"], ("RUNNING",))
    wait_state(b, s["id"], ("RUNNING",))
    assert b.cancel(q["id"])["id"] == q["id"]
    assert wait_state(b, q["id"], ("CANCELLED",))["reason"] == "cancelled while queued"
    r = service.cli("bob", "cancel", g["id"])
    assert r.returncode == 0, r.stderr
    g = wait_state(b, g["id"], ("CANCELLED",))
    assert g["reason"] == "cancelled (exited with code 0)" and g["log_tail"][-1] == "stopping"
    t0 = time.monotonic()
    b.cancel(s["id"])
    s = wait_state(b, s["id"], ("CANCELLED",))
    assert s["reason"] == "cancelled (killed by SIGKILL)" and time.monotonic() - t0 >= service.grace_s


@pytest.mark.slow
def test_bad_input_is_refused_and_nothing_is_queued(service: ApplianceProc, tmp_path: Path) -> None:
    b = service.client("bob")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(tiny_params(tmp_path, tmp_path / "m")) + "sparsity: {algorithm: nope}\n")
    with pytest.raises(ApplianceError) as e:
        b.submit_run(bad)
    assert e.value.status == 400 and "bad.yaml" in str(e.value) and "nope" in str(e.value)
    r = service.cli("bob", "submit", "--params", str(bad))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "nope" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ApplianceError) as e:
        b.submit_script(gate_script(tmp_path), num_csx=3)
    assert e.value.status == 400 and "more than the pool's 2 systems" in str(e.value)
    with pytest.raises(ApplianceError) as e:  # alice's quota is 1 system: a 2-system job could never start
        service.client("alice").submit_script(gate_script(tmp_path), num_csx=2)
    assert e.value.status == 400 and e.value.code == "over_quota" and "quota of 1 system" in str(e.value)
    r = service.cli("bob", "submit", "--script", str(tmp_path / "gated.py"), "--job_priority", "p9")
    assert r.returncode == 2 and "p9" in r.stderr
    with pytest.raises(ApplianceError) as e:
        b.submit("script", {"script": str(tmp_path / "gated.py")}, priority="p9")
    assert e.value.status == 400
    assert b.jobs(all=True) == []
    wrong = tmp_path / "wrong.token"
    wrong.write_text("wsc-not-a-token")
    with pytest.raises(ApplianceError) as e:
        Client(service.address, credentials_path=wrong).jobs()
    assert e.value.status == 401 and e.value.code == "invalid_token"
    r = wsc("jobs", "--mgmt_address", service.address, "--credentials_path", str(tmp_path / "missing.token"))
    assert r.returncode == 2 and "cannot read the token file" in r.stderr
    r = wsc("appliance", "start", "--state_dir", str(tmp_path / "s2"), "--port", str(free_port()),
            "--db", "postgresql+psycopg://nobody@127.0.0.1:1/x", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot open the appliance database") \
        and "Traceback" not in r.stderr
    r = wsc("appliance", "start", "--state_dir", str(service.state), "--port", str(free_port()), timeout=60)
    assert r.returncode == 2 and "another appliance service is running" in r.stderr


@pytest.mark.slow
def test_kill_9_of_the_service_loses_nothing(service: ApplianceProc, tmp_path: Path) -> None:
    """Running jobs live on and are re-attached; queued ones stay queued in order; no job runs twice."""
    script = gate_script(tmp_path)
    b, c = service.client("bob"), service.client("carol")
    r1 = b.submit_script(script, [str(tmp_path / "r1")])
    r2 = c.submit_script(script, [str(tmp_path / "r2")])
    wait_state(b, r1["id"], ("RUNNING",))
    wait_state(c, r2["id"], ("RUNNING",))
    q = [b.submit_script(script, [str(tmp_path / f"q{i}")], client_id=f"q{i}") for i in range(3)]
    wait_file(tmp_path / "r1.starts")
    pids = service.job_pids(r1["id"])
    followed: list[str] = []  # `logs -f` rides out the restart
    follower = threading.Thread(target=lambda: [followed.append(t) for t in b.logs(r1["id"], follow=True,
                                                                                   poll_s=0.1)])
    follower.start()
    wait_for(lambda: followed, "logs -f to show the job's first line")
    service.kill9()
    os.kill(pids["pgid"], 0)  # the job lives on without the service
    service.start()
    assert b.status(r1["id"])["state"] == "RUNNING" and service.job_pids(r1["id"]) == pids
    assert [j["state"] for j in (b.status(x["id"]) for x in q)] == ["QUEUED"] * 3
    assert b.submit_script(script, [str(tmp_path / "q0")], client_id="q0")["id"] == q[0]["id"]  # idempotent
    for n in ("r1", "r2", "q0", "q1", "q2"):
        (tmp_path / f"{n}.gate").write_text("0")
    done = [wait_state(b, x["id"], ("SUCCEEDED",)) for x in q]
    follower.join(timeout=60)
    assert not follower.is_alive() and "".join(followed) == (service.state / "jobs" / r1["id"] / "log").read_text()
    assert "".join(followed).endswith("done\n")
    assert [d["started_at"] for d in done] == sorted(d["started_at"] for d in done)  # in their order
    for n in ("r1", "r2", "q0", "q1", "q2"):
        assert len((tmp_path / f"{n}.starts").read_text().splitlines()) == 1, n  # each ran once
    assert b.status(r1["id"])["attempts"] == 1


def _run_params(tmp_path: Path, corpus: Path, **run: object) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(tiny_params(corpus, tmp_path / "unused", **run)))
    return p


@pytest.mark.slow
def test_a_training_run_through_the_cli_and_the_notebook_client(service: ApplianceProc, tmp_path: Path,
                                                                 corpus: Path) -> None:
    params = _run_params(tmp_path, corpus, max_steps=8, checkpoint_steps=4)
    r = service.cli("bob", "submit", "--params", str(params), "--mode", "train", "--num_csx", "2",
                    "--job_labels", "team=nlp", "--id", "first-run")
    assert r.returncode == 0, r.stderr
    jid = r.stdout.split()[0]
    r = service.cli("bob", "logs", "-f", jid, timeout=300)
    assert r.returncode == 0 and "0 -> 8" in r.stdout and "final loss" in r.stdout, r.stdout[-2000:]  # the summary
    b = service.client("bob")
    j = b.status(jid)
    assert j["state"] == "SUCCEEDED" and j["labels"] == {"team": "nlp"} and j["num_csx"] == 2
    rows = b.metrics(jid)
    assert [row["step"] for row in rows if "loss" in row][-1] == 8 and all(row.get("num_csx") == 2 for row in rows
                                                                           if "loss" in row)
    r = service.cli("bob", "submit", "--params", str(params), "--num_csx", "2", "--id", "first-run")
    assert r.stdout.split()[0] == jid  # the same client id: the same job, not a second run


@pytest.mark.slow
def test_a_run_whose_processes_are_lost_resumes_from_its_checkpoint(service: ApplianceProc, tmp_path: Path,
                                                                    corpus: Path) -> None:
    """kill -9 of the service and of the job together: the restarted service re-queues the job in its place and
    the next attempt resumes from the last checkpoint, finishing the run once."""
    params = _run_params(tmp_path, corpus, max_steps=40, checkpoint_steps=5)
    b = service.client("bob")
    j = b.submit_run(params, num_csx=1)
    model_dir = service.state / "jobs" / j["id"] / "model_dir"
    wait_for(lambda: list(model_dir.glob("checkpoint_*.safetensors")), "the run's first checkpoint", timeout=120)
    pids = service.job_pids(j["id"])
    service.kill9()
    os.killpg(pids["pgid"], signal.SIGKILL)
    os.kill(pids["shim"], signal.SIGKILL)
    service.start()
    j = wait_state(b, j["id"], ("SUCCEEDED", "FAILED"), timeout=240)
    assert j["state"] == "SUCCEEDED" and j["attempts"] == 2, j
    events = [e["reason"] for e in b.status(j["id"])["events"]]
    assert any(r.startswith("re-queued in its place") for r in events), events
    log = "".join(b.logs(j["id"]))
    assert "appliance: attempt 2, resuming from the last checkpoint" in log and "resumed from" in log


@pytest.mark.slow
@pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 tokenizer package (make setup)")
def test_a_deployment_answers_the_openai_client_by_model_name(service: ApplianceProc, tmp_path: Path) -> None:
    import openai

    model = tiny_model_dir(tmp_path)
    c = service.client("carol")
    oa = openai.OpenAI(base_url=f"{service.address}/v1", api_key=service.tokens["bob"].read_text().strip(),
                       max_retries=0)
    # both systems busy: the deployment waits in the queue, and its clients are told to retry (503), not 404
    script = gate_script(tmp_path)
    holders = [(service.client(u), u) for u in ("alice", "bob")]
    for cl, u in holders:
        wait_state(cl, cl.submit_script(script, [str(tmp_path / u)])["id"], ("RUNNING",))
    r = service.cli("carol", "deploy", "--model", str(model))
    assert r.returncode == 0, r.stderr
    jid = r.stdout.split()[0]
    assert c.status(jid)["state"] == "QUEUED"
    with pytest.raises(openai.APIStatusError) as queued:
        oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert queued.value.status_code == 503 and queued.value.code == "model_starting", queued.value
    assert "queued to start (waiting for 1 system, 0 free)" in queued.value.message
    with pytest.raises(ApplianceError) as e:
        service.client("bob").deploy(str(model))
    assert e.value.status == 409 and e.value.code == "already_deployed"
    for _, u in holders:
        (tmp_path / f"{u}.gate").write_text("0")
    wait_state(c, jid, ("RUNNING",))

    def answer():
        try:
            return oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        except openai.APIStatusError as err:  # 503 while its server loads the model
            assert err.status_code == 503, (err, c.status(jid))
            return None

    out = wait_for(answer, "the deployment to answer", timeout=180)
    assert out.choices[0].message.content and out.usage.completion_tokens == 8
    # its key went by environment, in a launch.json only its user reads, never in argv (`ps` shows argv)
    launch = sorted((service.state / "jobs" / jid).glob("attempt-*"))[-1] / "launch.json"
    assert launch.stat().st_mode & 0o777 == 0o600
    key = json.loads(launch.read_text())["env"]["WSC_API_KEY"]
    cmdline = Path(f"/proc/{service.job_pids(jid)['pgid']}/cmdline").read_bytes().decode(errors="replace")
    assert key and key not in cmdline and "--api-key" not in cmdline, cmdline
    assert [m.id for m in oa.models.list().data] == ["tiny-chat"]
    chunks = list(oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == out.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as nf:
        oa.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{service.address}/v1", api_key="wrong", max_retries=0).models.list()
    r = service.cli("carol", "undeploy", "--model", str(model))
    assert r.returncode == 0, r.stderr
    assert wait_state(c, jid, ("CANCELLED",))["state"] == "CANCELLED"
    with pytest.raises(openai.NotFoundError) as gone:
        oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert f"its last deployment, {jid}, ended CANCELLED" in gone.value.message
