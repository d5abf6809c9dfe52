"""Mutual TLS that checks the server's corral role before anything is sent to it.

Every corral certificate carries its role as a subject alternative name URI
`corral://role/<role>`, and every certificate of the cluster CA (a worker's too) is valid for
some address. grpcio verifies the chain and the address, but cannot be given a check of its
own: a worker certificate on a coordinator's address would receive the client's calls, bearer
token included. A check after grpc's handshake comes too late (grpc sends the call, token
included, at once), and a second connection made only to look at the certificate proves
nothing about the one grpc makes next.

So the client does the TLS itself: grpc speaks plaintext HTTP/2 to a private Unix socket of
this process (in a directory only this user can enter), and for each connection grpc opens
there, a bridge thread connects to the coordinator with Python's `ssl` module (the cluster CA,
the client certificate, the server's address as its name), checks that the server's
certificate carries the coordinator role, and only then passes bytes both ways. A server that
fails any check is disconnected before a single byte of grpc's reaches it; why is kept for the
client to raise. Every reconnection grpc makes goes through the same checks.
"""

import asyncio
import os
import shutil
import ssl
import tempfile
import threading
import weakref

ROLE_URI_PREFIX = "corral://role/"
# How long connecting and the TLS handshake with a coordinator may take.
CONNECT_TIMEOUT = 10.0
_CHUNK = 1 << 16


def server_role(cert):
    """The corral role a verified peer certificate (as `SSLSocket.getpeercert()` gives it)
    carries, or None without exactly one."""
    roles = [
        value[len(ROLE_URI_PREFIX) :]
        for kind, value in (cert or {}).get("subjectAltName", ())
        if kind == "URI" and value.startswith(ROLE_URI_PREFIX)
    ]
    return roles[0] if len(roles) == 1 else None


def _host_port(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def _pipe(reader, writer):
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                return
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, ssl.SSLError):
        return


def _close(writer):
    try:
        writer.close()
    except (ConnectionError, OSError, RuntimeError):
        pass


class TlsBridge:
    """Per coordinator address, a local Unix socket whose connections are carried to it over
    TLS verified as the module says. `target(addr)` is what to give grpc."""

    def __init__(self, ca, cert=None, key=None, expected_role="coordinator"):
        self.expected_role = expected_role
        self._context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.path.expanduser(ca))
        self._context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert:
            self._context.load_cert_chain(os.path.expanduser(cert), os.path.expanduser(key))
        self._context.set_alpn_protocols(["h2"])
        self._dir = tempfile.mkdtemp(prefix="corral-tls-")
        self._lock = threading.Lock()
        self._targets = {}
        self._servers = []
        self._refusals = {}
        self._errors = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="corral-tls", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(
            self, TlsBridge._shutdown, self._loop, self._thread, self._dir, self._servers
        )

    def target(self, addr):
        """The grpc target that reaches `addr` (host:port) through the checks."""
        with self._lock:
            target = self._targets.get(addr)
            if target is None:
                path = os.path.join(self._dir, f"{len(self._targets)}.sock")
                start = asyncio.start_unix_server(lambda r, w: self._carry(addr, r, w), path=path)
                self._servers.append(asyncio.run_coroutine_threadsafe(start, self._loop).result())
                target = self._targets[addr] = f"unix:{path}"
            return target

    def take_refusal(self, addr):
        """Why the last connection to `addr` was refused by TLS (a certificate that is not the
        expected server's), once; None if it was not."""
        with self._lock:
            return self._refusals.pop(addr, None)

    def last_error(self, addr):
        """Why the last connection to `addr` failed otherwise (e.g. connection refused), if it did."""
        with self._lock:
            return self._errors.get(addr)

    def _note(self, table, addr, line):
        with self._lock:
            table[addr] = line

    async def _carry(self, addr, local_reader, local_writer):
        host, port = _host_port(addr)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._context, server_hostname=host), CONNECT_TIMEOUT
            )
        except ssl.SSLCertVerificationError as e:
            why = e.verify_message or str(e)
            self._note(self._refusals, addr, f"TLS: the server at {addr} failed verification: {why} (check the CA)")
            _close(local_writer)
            return
        except ssl.SSLError as e:
            self._note(self._refusals, addr, f"TLS: the handshake with {addr} failed: {e.reason or e}")
            _close(local_writer)
            return
        except (OSError, asyncio.TimeoutError) as e:
            self._note(self._errors, addr, f"cannot connect to {addr}: {e or 'timed out'}")
            _close(local_writer)
            return
        role = server_role(writer.get_extra_info("peercert"))
        if role != self.expected_role:
            presented = f"with role {role}" if role else "without a corral role"
            line = f"TLS: the server at {addr} presented a certificate {presented}, not {self.expected_role}"
            self._note(self._refusals, addr, line)
            _close(writer)
            _close(local_writer)
            return
        with self._lock:
            self._errors.pop(addr, None)
        tasks = [asyncio.ensure_future(_pipe(local_reader, writer)), asyncio.ensure_future(_pipe(reader, local_writer))]
        # HTTP/2 needs both directions: when one ends, the connection is over.
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        _close(writer)
        _close(local_writer)

    def close(self):
        self._finalizer()

    @staticmethod
    def _shutdown(loop, thread, directory, servers):
        if loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_stop(servers), loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
        if not loop.is_running():
            loop.close()
        shutil.rmtree(directory, ignore_errors=True)


async def _stop(servers):
    """Closes the local sockets and ends every connection still carried."""
    for server in servers:
        server.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
