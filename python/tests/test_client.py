"""The Python client against real coordinators: jobs end to end, errors, nodes, billing,
watches and their resumption, tenants and tokens."""

import os
import threading

import pytest

from corral_client import (
    Client,
    CorralError,
    InvalidJob,
    Job,
    JobEvent,
    Node,
    NotFound,
    PermissionDenied,
    RevisionTooOld,
    Segment,
    TlsRefused,
    Unauthenticated,
    Unavailable,
)
from corral_client.errors import DeadlineExceeded, error_for

import grpc

from conftest import Dev, Impostor, free_port


@pytest.fixture
def client(dev):
    with Client(dev.addr) as c:
        yield c


def test_a_job_runs_and_its_output_and_exit_are_read(client):
    job = client.submit(["sh", "-c", "echo hello from corral; echo to stderr >&2"], gpus=1, name="hello")
    assert isinstance(job, Job)
    assert job.name == "hello" and job.tenant == "default" and job.gpus == 1
    done = client.wait(job, timeout=120)
    assert done.state == "succeeded" and done.exit_code == 0 and done.done
    assert done.node and len(done.gpu_indices) == 1
    lines = list(client.logs(done))
    assert "hello from corral" in lines and "to stderr" in lines


def test_following_logs_reads_until_the_job_ends(client):
    job = client.submit("echo first; sleep 1; echo second")
    assert list(client.logs(job, follow=True)) == ["first", "second"]
    assert client.job(job).done


def test_a_failing_job_reports_its_exit_code(client):
    done = client.wait(client.submit("exit 3", time="1m"), timeout=120)
    assert done.state == "failed" and done.exit_code == 3
    assert done.time_limit_secs == 60


def test_jobs_lists_and_cancel_stops(client):
    job = client.submit(["sleep", "300"], priority="normal")
    assert job.id in [j.id for j in client.jobs()]
    client.cancel(job.id)
    done = client.wait(job, timeout=120)
    assert done.state == "cancelled"
    assert job.id not in [j.id for j in client.jobs()]
    assert job.id in [j.id for j in client.jobs(all=True, states=["cancelled"])]
    assert all(j.state == "cancelled" for j in client.jobs(states=["cancelled"]))


def test_wait_gives_up_after_its_timeout(client):
    job = client.submit(["sleep", "300"])
    with pytest.raises(DeadlineExceeded) as e:
        client.wait(job, timeout=0.5)
    assert isinstance(e.value, TimeoutError) and str(job.id) in str(e.value)
    client.cancel(job)


def test_unknown_jobs_are_not_found(client):
    with pytest.raises(NotFound) as e:
        client.job(987654)
    assert "987654" in str(e.value)
    with pytest.raises(NotFound):
        client.cancel(987654)
    with pytest.raises(NotFound):
        client.wait(987654, timeout=10)


def test_invalid_jobs_are_refused_with_the_servers_reason(client):
    with pytest.raises(InvalidJob) as e:
        client.submit(["true"], gpus=1000)
    assert "gpu" in str(e.value).lower()
    with pytest.raises(InvalidJob) as e:
        client.submit(["true"], priority="no-such-class")
    assert "no-such-class" in str(e.value)
    with pytest.raises(InvalidJob):
        client.submit([])
    with pytest.raises(InvalidJob):
        client.submit(["true"], time="soon")
    with pytest.raises(InvalidJob):
        client.submit(["true"], memory="lots")
    with pytest.raises(ValueError):
        Client("no-port-here")


def test_an_unreachable_cluster_is_unavailable():
    with Client(f"127.0.0.1:{free_port()}", retry_for=0.5) as c:
        with pytest.raises(Unavailable) as e:
            c.jobs()
    assert isinstance(e.value, CorralError)


def test_calls_to_a_dead_endpoint_fail_over_to_a_live_one(dev):
    with Client([f"127.0.0.1:{free_port()}", dev.addr]) as c:
        assert isinstance(c.jobs(), list)


def test_calls_to_a_follower_are_redirected_to_the_leader(cluster3):
    import json

    statuses = {addr: json.loads(cluster3.cli(i, "cluster", "status")) for i, addr in enumerate(cluster3.addrs)}
    leader = next(a for a, s in statuses.items() if s.get("state") == "leader")
    follower = next(a for a in cluster3.addrs if a != leader)
    with Client(follower) as c:
        job = c.submit(["true"], name="through-a-follower")
        assert c._preferred == leader
        assert [j.id for j in c.jobs()] == [job.id]


class _Busy(grpc.RpcError):
    """What a busy coordinator answers: RESOURCE_EXHAUSTED with a retry-after."""

    def __init__(self, retry_after_ms="20"):
        self._metadata = (("retry-after-ms", retry_after_ms),) if retry_after_ms is not None else ()

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "the coordinator is serving as many client requests as it admits: retry after 20ms"

    def trailing_metadata(self):
        return self._metadata


def test_a_busy_coordinator_is_waited_out_within_the_patience():
    from corral_client.errors import ResourceExhausted

    calls = []

    def busy_three_times(stub):
        calls.append(1)
        if len(calls) <= 3:
            raise _Busy()
        return "answered"

    with Client(f"127.0.0.1:{free_port()}", overload_retry_for=5.0) as c:
        assert c._retry(busy_three_times) == "answered" and len(calls) == 4

        def always_busy(stub):
            raise _Busy()

        c.overload_retry_for = 0.2
        with pytest.raises(ResourceExhausted):
            c._retry(always_busy)

        def quota(stub):
            calls.append(1)
            raise _Busy(retry_after_ms=None)

        calls.clear()
        with pytest.raises(ResourceExhausted):
            c._retry(quota)
        assert len(calls) == 1, "a refusal without a retry-after (a quota) is not retried"


def test_every_status_code_maps_to_an_exception():
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        e = error_for(code, "the server's words")
        assert isinstance(e, CorralError) and type(e) is not CorralError, code
        assert str(e) == "the server's words" and e.code == code


def test_nodes_show_the_pools_gpus(client):
    nodes = client.nodes()
    assert len(nodes) == 1 and isinstance(nodes[0], Node)
    node = nodes[0]
    assert node.state == "up" and len(node.gpus) == 2
    assert node.gpus[0].model == "RTX 5090" and node.gpus[0].memory_mib == 32 * 1024


def test_nodes_name_every_partition_of_a_node():
    pool = Dev(gpus=1, extra=["--node-labels", "partition=train,partition=debug,zone=a"])
    try:
        with Client(pool.addr) as c:
            (node,) = c.nodes()
            assert node.partitions == ["train", "debug"], node
            assert node.labels.get("zone") == "a", node.labels
    finally:
        pool.close()


def test_billing_has_a_segment_per_gpu_run(client):
    job = client.wait(client.submit(["true"], gpus=1), timeout=120)
    segments = client.billing(tenant="default")
    mine = [s for s in segments if s.job_id == job.id]
    assert len(mine) == 1 and isinstance(mine[0], Segment)
    assert mine[0].gpus == 1 and mine[0].tenant == "default" and mine[0].end_state == "succeeded"
    assert client.billing(job=job) == mine
    assert client.billing(tenant="default", since=mine[0].end + 1) == [s for s in segments if s.end > mine[0].end]


def take(events, predicate, limit=1000):
    """Events from a watch until one satisfies predicate (that one included)."""
    seen = []
    for event in events:
        seen.append(event)
        if predicate(event) or len(seen) >= limit:
            return seen
    return seen


def test_watch_sends_each_change_until_the_end(client):
    events = client.watch(states=None)
    job = client.submit(["true"])
    seen = take(events, lambda e: e.job.id == job.id and e.job.done)
    assert all(isinstance(e, JobEvent) for e in seen)
    states = [e.job.state for e in seen if e.job.id == job.id]
    # Changes within one window are sent once, as the job is then: a job placed at once may be
    # seen running first. Never out of order, and always to the end.
    order = ["pending", "running", "succeeded"]
    assert states[-1] == "succeeded", states
    assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), states
    revisions = [e.revision for e in seen if e.job.id == job.id]
    assert revisions == sorted(revisions)
    events.close()


def test_watch_from_a_revision_sends_only_what_changed_since(client):
    first = client.wait(client.submit(["true"]), timeout=120)
    events = client.watch(jobs=[first.id])
    [event] = take(events, lambda e: True)
    events.close()
    second = client.wait(client.submit(["true"]), timeout=120)
    resumed = client.watch(from_revision=event.revision)
    seen = take(resumed, lambda e: e.job.id == second.id and e.job.done)
    resumed.close()
    assert first.id not in [e.job.id for e in seen]


def test_a_dropped_watch_resumes_without_missing_a_change(dev):
    c = Client(dev.addr)
    events = c.watch()
    job = c.submit(["sleep", "1"])
    take(events, lambda e: e.job.id == job.id)
    old = c._channels[dev.addr]
    # Every channel closes under the watch: it reconnects and resumes from its last revision.
    c.close()
    later = Client(dev.addr).submit(["true"])
    done = set()

    def both_done(e):
        if e.job.done:
            done.add(e.job.id)
        return {job.id, later.id} <= done

    seen = take(events, both_done)
    assert [e.job.state for e in seen if e.job.id == job.id][-1] == "succeeded"
    # The new channel is the client's own again: the old one is gone.
    assert c._channels and all(ch is not old for ch in c._channels.values())
    events.close()
    c.close()


def test_a_watch_dropped_for_falling_behind_resumes_from_its_revision():
    """A coordinator drops a reader that fell too far behind with ABORTED, naming the revision
    to resume from: the watch opens again from its last resume point and misses nothing."""
    from corral_client.client import Watch, pb

    opened = []

    class Streams:
        def _stream(self, method, request):
            assert method == "WatchJobs"
            opened.append(request.from_revision if request.HasField("from_revision") else None)
            if len(opened) == 1:
                yield pb.JobEvent(revision=5, job=pb.Job(id=1, state=pb.JOB_STATE_PENDING), resume_revision=5)
                yield pb.JobEvent(revision=6, job=pb.Job(id=2, state=pb.JOB_STATE_PENDING))
                raise error_for(grpc.StatusCode.ABORTED, "the watch fell behind: resume from revision 5")
            yield pb.JobEvent(revision=6, job=pb.Job(id=2, state=pb.JOB_STATE_PENDING), resume_revision=6)
            yield pb.JobEvent(revision=7, job=pb.Job(id=3, state=pb.JOB_STATE_PENDING), resume_revision=7)

    watch = Watch(Streams(), pb.WatchJobsRequest(), None)
    seen = [next(watch).job.id for _ in range(4)]
    assert seen == [1, 2, 2, 3], "job 2, sent after the resume point, comes again"
    assert opened == [None, 5]
    assert watch.revision == 7


def test_a_forgotten_revision_is_refused(fresh_dev):
    with Client(fresh_dev.addr) as c:
        c.wait(c.submit(["true"]), timeout=120)
    # A restart remembers the changes after the last snapshot: revision 1 is forgotten once a
    # snapshot covers it.
    fresh_dev.snapshot()
    fresh_dev.restart()
    with Client(fresh_dev.addr) as c:
        with pytest.raises(RevisionTooOld) as e:
            next(c.watch(from_revision=1))
    assert "list the jobs again" in str(e.value)


def test_a_tenant_sees_and_touches_only_its_own_jobs(secured):
    a = Client(secured.addr, token=secured.team_a)
    b = Client(secured.addr, token=secured.team_b)
    job_a = a.submit(["sleep", "300"])
    job_b = b.submit(["sleep", "300"])
    assert job_a.tenant == "team-a"
    with pytest.raises(PermissionDenied) as e:
        a.job(job_b.id)
    assert "team-a" in str(e.value)
    with pytest.raises(PermissionDenied):
        a.cancel(job_b)
    with pytest.raises(PermissionDenied):
        a.submit(["true"], tenant="team-b")
    with pytest.raises(PermissionDenied):
        a.jobs(tenant="team-b")
    with pytest.raises(PermissionDenied):
        next(a.watch(tenant="team-b"))
    assert {j.id for j in a.jobs()} == {job_a.id}
    with pytest.raises(Unauthenticated):
        Client(secured.addr).jobs()
    with pytest.raises(PermissionDenied):
        Client(secured.addr, token="crl_not_a_token").jobs()
    a.close()
    b.close()


def test_over_tls_the_client_talks_to_a_coordinator(tls_coordinator):
    with Client(tls_coordinator.addr, tls=tls_coordinator.files("admin")) as c:
        assert c.nodes() == []
        assert c.jobs() == []


def test_a_server_without_the_coordinator_role_gets_nothing_not_even_the_token(tls_coordinator):
    """The outage of the hardening issue: a worker certificate of the cluster CA on the address
    the client dials. The client refuses it after the handshake and before grpc sends a byte."""
    worker = tls_coordinator.files("worker-w1")
    impostor = Impostor(worker["cert"], worker["key"])
    try:
        with Client(impostor.addr, token="crl_secret-for-the-impostor", tls=tls_coordinator.files("admin")) as c:
            with pytest.raises(TlsRefused) as refused:
                c.nodes()
        assert str(refused.value) == (
            f"TLS: the server at {impostor.addr} presented a certificate with role worker, not coordinator"
        )
        assert isinstance(refused.value, Unavailable)
        assert impostor.connections >= 1
        assert bytes(impostor.received) == b"", "the impostor received data"
    finally:
        impostor.close()


def test_a_server_of_another_ca_is_refused_over_tls(tls_coordinator):
    files = dict(tls_coordinator.files("admin"))
    files["ca"] = files["cert"]  # a CA that did not sign the coordinator's certificate
    with Client(tls_coordinator.addr, tls=files, retry_for=1) as c:
        with pytest.raises(TlsRefused) as refused:
            c.nodes()
    assert str(refused.value).startswith(f"TLS: the server at {tls_coordinator.addr} failed verification")



def test_submit_runs_in_the_callers_directory_with_its_environment(client, tmp_path, monkeypatch):
    # As `corral submit`: a program found on the caller's PATH, run in the caller's directory
    # with the caller's variables, less the deny list; named after the program.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mytool"
    tool.write_text('#!/bin/sh\necho "dir=$(pwd) var=$NEWCOMER_VAR token=${CORRAL_TOKEN:-unset} x=$EXPLICIT"\n')
    tool.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("NEWCOMER_VAR", "from-caller")
    monkeypatch.setenv("CORRAL_TOKEN", "secret")
    job = client.submit(["mytool"], env={"EXPLICIT": "yes"}, time=0)
    assert job.name == "mytool" and job.time_limit_secs is None
    done = client.wait(job, timeout=120)
    assert done.state == "succeeded", done
    assert list(client.logs(done)) == [f"dir={work} var=from-caller token=unset x=yes"]


def test_export_none_sends_only_the_named_variables(client, monkeypatch):
    monkeypatch.setenv("NEWCOMER_VAR", "from-caller")
    job = client.submit(
        ["/bin/sh", "-c", "echo ${NEWCOMER_VAR:-unset} $ONLY"], export="NONE", env={"ONLY": "this"}
    )
    assert job.name == "sh"
    assert client.wait(job, timeout=120).state == "succeeded"
    assert list(client.logs(job)) == ["unset this"]
    with pytest.raises(InvalidJob, match="NONE cannot be combined"):
        client.submit(["true"], export="NONE,FOO")
