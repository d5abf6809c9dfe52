"""The corral client: endpoint failover, leader redirects and retries that reuse a submit's
request id (as the Rust client does), typed results and one exception per gRPC status."""

import os
import re
import threading
import time as _time
import uuid

import grpc

from . import errors
from ._proto import corral_pb2 as pb
from ._proto import corral_pb2_grpc as pb_grpc
from ._tls import TlsBridge
from .errors import CorralError, DeadlineExceeded, InvalidJob, TlsRefused, Unavailable
from .types import JobEvent, STATES, datetime_to_tso, job_from_pb, node_from_pb, segment_from_pb

# Set by a coordinator that does not lead on its refusal: the leader's API address.
LEADER_ADDR_METADATA = "corral-leader-addr"
# Largest message accepted from a coordinator (a long job list).
MAX_MESSAGE_BYTES = 64 << 20
# Codes after which another coordinator (or the same, a little later) is tried.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)
# A stream that broke on these is opened again (resumed where it can be).
_STREAM_BROKEN = _RETRYABLE + (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
# A watch whose reader fell too far behind is dropped with ABORTED: it resumes from its revision.
_WATCH_BROKEN = _STREAM_BROKEN + (grpc.StatusCode.ABORTED,)

_ENDPOINT = re.compile(r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# Variables of the caller's environment never exported by default (export="ALL"): the client's
# credentials and endpoint, and handles to the login session. The same list as the CLI's
# `EXPORT_DENY` (crates/corral-cli/src/jobspec.rs): keep them in step.
EXPORT_DENY = (
    "CORRAL_TOKEN",
    "CORRAL_CA",
    "CORRAL_CERT",
    "CORRAL_KEY",
    "CORRAL_ENDPOINT",
    "SSH_AUTH_SOCK",
    "SSH_AGENT_PID",
    "GPG_AGENT_INFO",
    "KRB5CCNAME",
    "XAUTHORITY",
    "DBUS_SESSION_BUS_ADDRESS",
    "VAULT_TOKEN",
)
# A job's environment limits (corral_types::MAX_ENV_VARS, MAX_ENV_BYTES).
MAX_ENV_VARS = 1024
MAX_ENV_BYTES = 256 * 1024
_DURATION_UNITS = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def _valid_name(key):
    return bool(key) and "=" not in key and "\0" not in key


def exported_environment(spec, environment, explicit):
    """A job's environment for an export spec ('ALL', 'NONE', 'VAR,VAR=value,...') from the
    caller's `environment`, with `explicit` on top: what the CLI's `--export` does. Variables
    past the job's limits are left out with a warning."""
    import warnings

    items = [i.strip() for i in str(spec).split(",")]
    everything = False
    named = {}
    for item in items:
        if item == "ALL":
            everything = True
        elif item == "NONE":
            pass
        elif item == "":
            raise InvalidJob(f"invalid export '{spec}': an empty item (expected ALL, NONE or VAR[,VAR=value...])")
        elif "=" in item:
            key, value = item.split("=", 1)
            if not _valid_name(key):
                raise InvalidJob(f"invalid export item '{item}': expected a variable name or VAR=value")
            named[key] = value
        elif _valid_name(item):
            # Named explicitly: exported even if on the deny list; absent, nothing.
            if item in environment:
                named[item] = environment[item]
        else:
            raise InvalidJob(f"invalid export item '{item}': expected a variable name or VAR=value")
    if "NONE" in items and len(items) > 1:
        raise InvalidJob(f"invalid export '{spec}': NONE cannot be combined with other items")
    env = dict(explicit)
    for k, v in named.items():
        env.setdefault(k, v)
    size = sum(len(k) + len(v) for k, v in env.items())
    dropped = []
    if everything:
        for key in sorted(environment):
            value = environment[key]
            if key in env or key in EXPORT_DENY or not _valid_name(key):
                continue
            if len(env) >= MAX_ENV_VARS or size + len(key) + len(value) > MAX_ENV_BYTES:
                dropped.append(key)
                continue
            size += len(key) + len(value)
            env[key] = value
    if dropped:
        warnings.warn(
            f"{len(dropped)} environment variables not exported (a job carries at most {MAX_ENV_VARS} "
            f"variables, {MAX_ENV_BYTES // 1024} KiB): {', '.join(dropped)}"
        )
    return env


def _endpoints(endpoints):
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    out = [e.strip() for e in endpoints if e and e.strip()]
    if not out:
        raise ValueError("no endpoint given: pass host:port, e.g. Client('127.0.0.1:7070')")
    for e in out:
        if not _ENDPOINT.match(e):
            raise ValueError(f"invalid endpoint '{e}': expected host:port, e.g. 127.0.0.1:7070")
    return out


def _tls_files(tls):
    """(ca, cert, key) paths from a dict or an object with ca/cert/key attributes."""
    get = tls.get if isinstance(tls, dict) else (lambda k: getattr(tls, k, None))
    ca, cert, key = get("ca"), get("cert"), get("key")
    if not ca:
        raise ValueError("tls needs at least 'ca' (the cluster CA certificate), and 'cert' and 'key' for mutual TLS")
    if bool(cert) != bool(key):
        raise ValueError("tls: give both 'cert' and 'key', or neither")
    return ca, cert, key


def parse_size(value):
    """Bytes from an int or a size such as '16GiB', '512M'."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", str(value), re.IGNORECASE)
    if not m:
        raise InvalidJob(f"invalid size '{value}': expected e.g. 16GiB, 512M or a number of bytes")
    return int(round(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]))


def parse_seconds(value):
    """Seconds from a number or a duration such as '90s', '1h30m', '2d', 'HH:MM:SS'."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    s = str(value).strip()
    if re.match(r"^\d+(:\d+){1,2}$", s):
        total = 0
        for part in s.split(":"):
            total = total * 60 + int(part)
        return total
    parts = re.findall(r"(\d+)([a-z]+)", s.lower())
    if not parts or "".join(n + u for n, u in parts) != s.lower() or any(u not in _DURATION_UNITS for _, u in parts):
        raise InvalidJob(f"invalid duration '{value}': expected e.g. 90s, 30m, 1h30m, 2d or HH:MM:SS")
    return int(sum(int(n) * _DURATION_UNITS[u] for n, u in parts))


def _tso(value, what):
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if hasattr(value, "timestamp"):
        return datetime_to_tso(value)
    raise InvalidJob(f"invalid {what} '{value}': expected a datetime or a TSO timestamp (int)")


def _state_enum(state):
    name = str(state).lower()
    if name not in STATES:
        raise InvalidJob(f"unknown job state '{state}' ({', '.join(STATES)})")
    return pb.JobState.Value("JOB_STATE_" + name.upper())


def _job_id(job):
    if isinstance(job, int):
        return job
    if hasattr(job, "id"):
        return job.id
    if isinstance(job, str) and job.isdigit():
        return int(job)
    raise InvalidJob(f"invalid job '{job}': expected a Job or a job id")


class Client:
    """A connection to a corral cluster.

    endpoints: "host:port[,host:port...]" or a list of them (any coordinators; calls go to the
    leader). token: an access token (`corral token create`). tls: the cluster CA and a client
    certificate, as a dict or object with `ca`, `cert` and `key` paths; every server must then
    present a coordinator certificate of that CA valid for its address, or nothing is sent to
    it and the call raises TlsRefused (see `_tls.py`). timeout: seconds one attempt of a call
    may take; retry_for: seconds spent retrying an unavailable cluster.
    """

    def __init__(self, endpoints, token=None, tls=None, timeout=10.0, retry_for=10.0):
        self.endpoints = _endpoints(endpoints)
        self.token = token
        self.timeout = timeout
        self.retry_for = retry_for
        self._tls = None
        if tls is not None:
            ca, cert, key = _tls_files(tls)
            self._tls = TlsBridge(ca, cert, key)
        self._lock = threading.Lock()
        self._channels = {}
        self._preferred = None

    def close(self):
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()
        if self._tls is not None:
            self._tls.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- plumbing ----

    def _metadata(self):
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _stub(self, addr):
        with self._lock:
            channel = self._channels.get(addr)
            if channel is None:
                options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
                if self._tls is not None:
                    # Plaintext to the local end of the bridge, which does the TLS and its checks.
                    options.append(("grpc.default_authority", addr))
                    channel = grpc.insecure_channel(self._tls.target(addr), options)
                else:
                    channel = grpc.insecure_channel(addr, options)
                self._channels[addr] = channel
            return pb_grpc.CorralStub(channel)

    def _candidates(self):
        with self._lock:
            preferred = self._preferred
        first = [preferred] if preferred else []
        return first + [e for e in self.endpoints if e != preferred]

    def _retry(self, call):
        """Runs call(stub) against the coordinators until one answers, following leader
        redirects and retrying unavailability for up to retry_for seconds."""
        deadline = _time.monotonic() + self.retry_for
        backoff = 0.02
        last = "no endpoint tried"
        while True:
            redirected = False
            for addr in self._candidates():
                try:
                    result = call(self._stub(addr))
                except grpc.RpcError as e:
                    refusal = self._tls.take_refusal(addr) if self._tls is not None else None
                    if refusal is not None:
                        raise TlsRefused(refusal, grpc.StatusCode.UNAVAILABLE) from None
                    if e.code() not in _RETRYABLE:
                        raise errors.from_rpc_error(e) from None
                    last = e.details() or str(e.code())
                    if self._tls is not None and self._tls.last_error(addr):
                        last = self._tls.last_error(addr)
                    leader = dict(e.trailing_metadata() or ()).get(LEADER_ADDR_METADATA)
                    if leader and leader != addr:
                        with self._lock:
                            self._preferred = leader
                        redirected = True
                        break
                    continue
                with self._lock:
                    self._preferred = addr
                return result
            if redirected and _time.monotonic() < deadline:
                continue
            if _time.monotonic() + backoff > deadline:
                raise Unavailable(
                    f"cannot reach the leader at {','.join(self.endpoints)}: {last}", grpc.StatusCode.UNAVAILABLE
                )
            _time.sleep(backoff)
            backoff = min(backoff * 2, 0.1)

    def _unary(self, method, request):
        return self._retry(lambda stub: getattr(stub, method)(request, timeout=self.timeout, metadata=self._metadata()))

    def _stream(self, method, request, timeout=None):
        """The messages of a server stream. Opening it (up to its first message) is retried and
        redirected like a unary call; a stream that breaks later raises the mapped error."""

        def open_stream(stub):
            call = getattr(stub, method)(request, timeout=timeout, metadata=self._metadata())
            try:
                return call, [next(call)]
            except StopIteration:
                return call, []

        call, first = self._retry(open_stream)
        try:
            yield from first
            for message in call:
                yield message
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        finally:
            call.cancel()

    # ---- jobs ----

    def submit(
        self,
        command,
        gpus=0,
        tenant=None,
        priority=None,
        name=None,
        time=None,
        cpus=None,
        memory=None,
        env=None,
        image=None,
        workdir=None,
        gpus_per_node=None,
        max_restarts=None,
        hold=False,
        request_id=None,
        export=None,
    ):
        """Submits a job and returns it (pending). command: a list of arguments, or a string
        run with `sh -c`. time: the time limit (seconds or '1h30m'; 0: none); memory: bytes or
        '16GiB'. As `corral submit` does, the job runs in the caller's working directory (or
        `workdir`) with the caller's environment (less `EXPORT_DENY`) under `env`, and is named
        after its program; export: 'ALL' (the default without `image`), 'NONE' (the default
        with `image`, which also keeps the container's own directory) or 'VAR,VAR=value,...' as
        `--export`. A retry after a lost reply never creates a second job (one request id per
        call)."""
        if isinstance(command, str):
            command = ["sh", "-c", command]
        command = [str(c) for c in command]
        if not command:
            raise InvalidJob("empty command: give the program to run, e.g. ['python', 'train.py']")
        if cpus is not None and not (0 < float(cpus) <= 4096):
            raise InvalidJob(f"invalid cpus {cpus}: expected a number of cores greater than 0, e.g. 2 or 0.5")
        sched = pb.SchedOptions(hold=bool(hold))
        if gpus_per_node is not None:
            sched.gpus_per_node = int(gpus_per_node)
        if max_restarts is not None:
            sched.max_restarts = int(max_restarts)
        spec = pb.JobSpec(
            name=name or command[0].rsplit("/", 1)[-1],
            tenant=tenant or "",
            priority_class=priority or "",
            gpus=int(gpus or 0),
            cpu_millis=int(round(float(cpus) * 1000)) if cpus is not None else 0,
            memory_bytes=parse_size(memory),
            command=command,
            env=exported_environment(
                export if export is not None else ("NONE" if image else "ALL"),
                dict(os.environ),
                {str(k): str(v) for k, v in (env or {}).items()},
            ),
            sched=sched,
        )
        limit = parse_seconds(time)
        # 0 is no limit, as in Slurm.
        if limit:
            spec.time_limit_secs = limit
        if image:
            spec.image = image
        if workdir:
            spec.workdir = os.path.abspath(str(workdir))
        elif not image:
            spec.workdir = os.getcwd()
        request = pb.SubmitRequest(request_id=request_id or str(uuid.uuid4()), spec=spec)
        reply = self._unary("Submit", request)
        return self.job(reply.job_id)

    def job(self, job):
        """The job now."""
        return job_from_pb(self._unary("GetJob", pb.GetJobRequest(job_id=_job_id(job))), pb)

    def jobs(self, all=False, tenant=None, states=None):
        """Jobs, oldest first: unfinished ones, or every job with all=True; optionally of one
        tenant and in the given states ('pending', 'running', ...), filtered by the server.
        Follows the listing's pages to the end."""
        request = pb.ListJobsRequest(all=bool(all), states=[_state_enum(s) for s in states or ()])
        if tenant is not None:
            request.tenant = tenant
        jobs = []
        while True:
            reply = self._unary("ListJobs", request)
            jobs.extend(job_from_pb(j, pb) for j in reply.jobs)
            if not reply.next_page_token:
                return jobs
            request.page_token = reply.next_page_token

    def cancel(self, job):
        """Cancels a job; returns it (a running job ends once its worker stopped it)."""
        return job_from_pb(self._unary("CancelJob", pb.CancelJobRequest(job_id=_job_id(job))), pb)

    def wait(self, job, timeout=None):
        """Waits until the job ends and returns it; raises DeadlineExceeded (a TimeoutError)
        after timeout seconds. Follows leader changes."""
        job_id = _job_id(job)
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - _time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"job {job_id} did not end within {timeout}s", grpc.StatusCode.DEADLINE_EXCEEDED)
            try:
                for message in self._stream("WatchJob", pb.WatchJobRequest(job_id=job_id), timeout=remaining):
                    current = job_from_pb(message, pb)
                    if current.done:
                        return current
            except errors.CorralError as e:
                if e.code not in _STREAM_BROKEN:
                    raise
                if deadline is not None and _time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"job {job_id} did not end within {timeout}s", grpc.StatusCode.DEADLINE_EXCEEDED
                    ) from None
            # The stream ended before the job (a leader change): watch again.

    def logs(self, job, follow=False, rank=0):
        """The job's output (stdout and stderr), line by line without the newline; with
        follow=True, until the job ends. rank: the part of a gang."""
        request = pb.ReadLogsRequest(job_id=_job_id(job), follow=bool(follow), rank=int(rank))
        pending = {}
        for chunk in self._stream("ReadLogs", request):
            text = pending.pop(chunk.stream, "") + chunk.data.decode("utf-8", errors="replace")
            *lines, rest = text.split("\n")
            yield from lines
            if rest:
                pending[chunk.stream] = rest
        for rest in pending.values():
            yield rest

    def watch(self, jobs=None, tenant=None, states=None, from_revision=None):
        """A Watch: an iterator of JobEvents for each matching job (first as they are now, or
        those changed after from_revision), then for each change of one, without end. It is
        opened at once (errors such as PermissionDenied are raised here). A dropped stream
        (leader change, lost connection) is resumed from the last revision received, so no
        change is missed; RevisionTooOld when the cluster no longer remembers from_revision."""
        request = pb.WatchJobsRequest(
            job_ids=[_job_id(j) for j in jobs or ()],
            states=[_state_enum(s) for s in states or ()],
        )
        if tenant is not None:
            request.tenant = tenant
        return Watch(self, request, from_revision)

    # ---- nodes and billing ----

    def nodes(self):
        """The worker nodes and their GPUs."""
        return [node_from_pb(n) for n in self._unary("ListNodes", pb.ListNodesRequest()).nodes]

    def billing(self, tenant=None, since=None, until=None, job=None):
        """Billing segments (one per priced run), oldest first; since/until: datetimes or TSO
        timestamps. Follows the listing's pages to the end."""
        request = pb.ListSegmentsRequest()
        if tenant is not None:
            request.tenant = tenant
        for name, value in (("since", since), ("until", until)):
            ts = _tso(value, name)
            if ts is not None:
                setattr(request, name, ts)
        if job is not None:
            request.job_id = _job_id(job)
        segments = []
        while True:
            reply = self._unary("ListSegments", request)
            segments.extend(segment_from_pb(s) for s in reply.segments)
            if not reply.next_page_token:
                return segments
            request.page_token = reply.next_page_token


class Watch:
    """Iterator of JobEvents from `Client.watch`. `revision` is the last revision up to which
    every matching change was received: pass it as from_revision to a later watch to go on
    from there. A stream that broke, ended with the leadership, or was dropped because this
    reader fell too far behind (ABORTED) is opened again from `revision`."""

    def __init__(self, client, request, from_revision):
        self._client = client
        self._request = request
        self.revision = from_revision
        self._stream = None
        self._peeked = None
        self._closed = False
        self._open()

    def _open(self):
        if self._stream is not None:
            self._stream.close()
        if self.revision is not None:
            self._request.from_revision = self.revision
        self._stream = self._client._stream("WatchJobs", self._request)
        # Opens the stream now (retried and redirected like a unary call).
        self._peeked = next(self._stream, None)

    def __iter__(self):
        return self

    def __next__(self):
        while not self._closed:
            try:
                if self._peeked is not None:
                    message, self._peeked = self._peeked, None
                else:
                    message = next(self._stream)
            except StopIteration:
                # The leader changed: go on at the new one from the last revision.
                self._open()
                continue
            except CorralError as e:
                if e.code not in _WATCH_BROKEN:
                    raise
                self._open()
                continue
            if message.HasField("resume_revision"):
                self.revision = message.resume_revision
            if message.HasField("job"):
                return JobEvent(revision=message.revision, job=job_from_pb(message.job, pb))
        raise StopIteration

    def close(self):
        """Ends the watch."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Client", "Watch"]
