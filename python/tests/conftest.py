"""Fixtures: a real `corral dev` pool, and a coordinator that requires tokens, each on a free
loopback port in a temp dir. The binary is $CORRAL_BIN, else target/debug/corral."""

import hashlib
import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def corral_bin():
    path = os.environ.get("CORRAL_BIN") or os.path.join(REPO, "target", "debug", "corral")
    if not os.path.exists(path):
        pytest.fail(f"{path} not found: build it (cargo build -p corral-cli) or set CORRAL_BIN")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Dev:
    """A `corral dev` process; `addr` is its endpoint."""

    def __init__(self, gpus=2, extra=()):
        self.extra = list(extra)
        self.dir = tempfile.mkdtemp(prefix="corral-py-")
        self.data = os.path.join(self.dir, "data")
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")
        self.gpus = gpus
        self.start()

    def start(self):
        args = [corral_bin(), "dev", "--data-dir", self.data, "--listen", "127.0.0.1:0", "--gpus", str(self.gpus)]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines = queue.Queue()

        def read():
            for line in self.proc.stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line and line.startswith("corral dev ready at "):
                self.addr = line.split()[4]
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                stop(self.proc)
                pytest.fail("corral dev did not get ready within 60s:\n" + self.log.read()[-4000:])

    def restart(self):
        stop(self.proc)
        self.start()

    def snapshot(self):
        """Builds a snapshot of the pool's state machine now (`corral cluster snapshot`)."""
        out = subprocess.run(
            [corral_bin(), "--endpoint", self.addr, "cluster", "snapshot"], capture_output=True, text=True
        )
        if out.returncode != 0:
            pytest.fail(f"corral cluster snapshot: {out.stderr}")

    def close(self):
        stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def dev():
    pool = Dev()
    yield pool
    pool.close()


@pytest.fixture
def fresh_dev():
    """A pool of its own, for tests that restart it."""
    pool = Dev(gpus=1)
    yield pool
    pool.close()


class Secured:
    """A coordinator that requires a token on every user call (no worker), with tokens for the
    admin and the tenants team-a and team-b."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="corral-py-auth-")
        self.admin = "admin-secret-of-the-python-tests"
        self.addr = f"127.0.0.1:{free_port()}"
        config = os.path.join(self.dir, "coordinator.toml")
        with open(config, "w") as f:
            f.write(
                f'node-id = 1\nlisten = "{self.addr}"\ndata-dir = "{self.dir}/data"\n\n'
                f'[auth]\nrequire-tokens = true\nadmin-token-sha256 = "{hashlib.sha256(self.admin.encode()).hexdigest()}"\n'
            )
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")
        self.proc = subprocess.Popen(
            [corral_bin(), "coordinator", "--config", config], stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 60
        while True:
            out = self.cli("cluster", "init", check=False)
            if out.returncode == 0:
                break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                self.close()
                pytest.fail(f"cannot init the coordinator: {out.stderr}\n{self.log.read()[-4000:]}")
            time.sleep(0.2)
        self.team_a = self.cli("token", "create", "--tenant", "team-a").stdout.strip()
        self.team_b = self.cli("token", "create", "--tenant", "team-b").stdout.strip()

    def cli(self, *args, check=True):
        out = subprocess.run(
            [corral_bin(), "--endpoint", self.addr, "--token", self.admin, *args], capture_output=True, text=True
        )
        if check and out.returncode != 0:
            pytest.fail(f"corral {args}: {out.stderr}")
        return out

    def close(self):
        stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def secured():
    cluster = Secured()
    yield cluster
    cluster.close()


class Cluster3:
    """Three coordinators (no worker) in one Raft cluster."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="corral-py-3-")
        self.addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
        self.procs = []
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")
        for i, addr in enumerate(self.addrs):
            config = os.path.join(self.dir, f"coordinator-{i}.toml")
            with open(config, "w") as f:
                f.write(f'node-id = {i + 1}\nlisten = "{addr}"\ndata-dir = "{self.dir}/data-{i}"\n')
            self.procs.append(
                subprocess.Popen([corral_bin(), "coordinator", "--config", config], stdout=self.log, stderr=self.log)
            )
        self.cli(0, "cluster", "init", retry=True)
        for addr in self.addrs[1:]:
            self.cli(0, "cluster", "join", addr, retry=True)

    def cli(self, index, *args, retry=False):
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(
                [corral_bin(), "--endpoint", self.addrs[index], "--output", "json", *args],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0 or not retry or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if out.returncode != 0:
            self.log.seek(0)
            pytest.fail(f"corral {args}: {out.stderr}\n{self.log.read()[-4000:]}")
        return out.stdout

    def close(self):
        for proc in self.procs:
            stop(proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cluster3():
    cluster = Cluster3()
    yield cluster
    cluster.close()


class TlsCoordinator:
    """A coordinator serving mutual TLS (no worker), with the certificates of `corral certs init`
    in `certs`: coordinator-1, worker-w1, admin."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="corral-py-tls-")
        self.certs = os.path.join(self.dir, "certs")
        subprocess.run(
            [corral_bin(), "certs", "init", "--dir", self.certs, "--coordinators", "1", "--workers", "w1"],
            check=True,
            capture_output=True,
        )
        self.addr = f"127.0.0.1:{free_port()}"
        config = os.path.join(self.dir, "coordinator.toml")
        with open(config, "w") as f:
            f.write(
                f'node-id = 1\nlisten = "{self.addr}"\ndata-dir = "{self.dir}/data"\n\n'
                f'[tls]\nca = "{self.certs}/ca.pem"\ncert = "{self.certs}/coordinator-1.pem"\n'
                f'key = "{self.certs}/coordinator-1-key.pem"\n'
            )
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")
        self.proc = subprocess.Popen([corral_bin(), "coordinator", "--config", config], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(
                [corral_bin(), "--endpoint", self.addr, *self.cli_tls("admin"), "cluster", "init"],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0:
                break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                self.close()
                pytest.fail(f"cannot init the TLS coordinator: {out.stderr}\n{self.log.read()[-4000:]}")
            time.sleep(0.2)

    def files(self, name):
        """The `tls` argument of a Client presenting certificate `name`."""
        return {
            "ca": os.path.join(self.certs, "ca.pem"),
            "cert": os.path.join(self.certs, f"{name}.pem"),
            "key": os.path.join(self.certs, f"{name}-key.pem"),
        }

    def cli_tls(self, name):
        files = self.files(name)
        return ["--ca", files["ca"], "--cert", files["cert"], "--key", files["key"]]

    def close(self):
        stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tls_coordinator():
    coordinator = TlsCoordinator()
    yield coordinator
    coordinator.close()


class Impostor:
    """A TLS server on a free loopback port presenting `cert` (a worker's, say), answering
    nothing and keeping what clients send after the handshake."""

    def __init__(self, cert, key):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.context.set_alpn_protocols(["h2"])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                conn = self.context.wrap_socket(raw, server_side=True)
                conn.settimeout(5)
                while True:
                    data = conn.recv(4096)
                    if not data:
                        break
                    self.received.extend(data)
            except (OSError, ssl.SSLError):
                pass
            finally:
                raw.close()

    def close(self):
        self.sock.close()
