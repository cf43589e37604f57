"""How a joining replica receives its state: HTTP from a healthy peer, every tensor checksummed.

torchft's Manager hands a replica that is behind (restarted, or dropped from a quorum) the
state of a replica at the quorum's newest step, through a ``CheckpointTransport``. Its own
``HTTPTransport`` listens on every interface, advertises the machine's host name (which inside
an emulated host names another network) and unpickles what it receives. This one:

1. listens on the replica's own address only (the emulated host's), and advertises it;
2. stages the state as one blob when the Manager says a peer needs it (``send_checkpoint``):
   ``torch.save`` of ``{"state": ..., "sha256": {path: digest}}``, the digest of every
   tensor's bytes under its path in the state (``model/fc.weight``);
3. serves the blob for that step only, and stops serving when the Manager says the state may
   change again (``disallow_checkpoint``: waits for transfers in progress);
4. on the joiner, fetches the blob, loads it with ``weights_only=True`` (tensors and plain
   containers only: nothing received is unpickled into code), and checks every tensor against
   its digest: a tensor missing, added or different raises ``ChecksumError``, which the Manager
   records as a failed recovery (the step is not committed, and the joiner tries again at the
   next quorum).
"""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from commfuse.ft.require import require_torchft

require_torchft()
from torchft.checkpointing import CheckpointTransport  # noqa: E402


class ChecksumError(RuntimeError):
    """A received state's tensors do not match the digests its sender computed."""


def tensors_of(obj: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nest of dicts, lists and tuples, with its path (``a/b/0``)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_of(value, f"{path}/{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_of(value, f"{path}/{i}" if path else str(i))


def _tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    flat = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{flat.dtype}{tuple(flat.shape)}".encode())
    digest.update(flat.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def checksums(state: object) -> dict[str, str]:
    """``_tensor_sha256`` of every tensor of ``state``, by path."""
    return {path: _tensor_sha256(t) for path, t in tensors_of(state)}


def pack_state(state: object) -> bytes:
    """``state`` and its checksums as one blob (``unpack_state`` reverses it)."""
    buffer = io.BytesIO()
    torch.save({"state": state, "sha256": checksums(state)}, buffer)
    return buffer.getvalue()


def unpack_state(blob: bytes) -> Any:
    """The state of ``pack_state``'s blob, every tensor checked against its digest.

    Raises:
        ChecksumError: a tensor is missing, extra or differs from what was sent.
    """
    payload = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    state, sent = payload["state"], payload["sha256"]
    got = checksums(state)
    if got.keys() != sent.keys():
        missing, extra = sorted(sent.keys() - got.keys()), sorted(got.keys() - sent.keys())
        raise ChecksumError(f"received state: tensors missing {missing}, unexpected {extra}")
    bad = [path for path, digest in got.items() if sent[path] != digest]
    if bad:
        raise ChecksumError(f"received state: {len(bad)} tensors differ from the sent ones: {bad}")
    return state


class ChecksummedHTTPTransport(CheckpointTransport[Any]):  # type: ignore[misc]
    """torchft's checkpoint transport on one address, with checksummed, weights-only state
    (see the module docstring).

    Args:
        addr: the address to listen on and advertise (the replica's host's).
        timeout: how long a transfer or a wait for the staged step may take.
    """

    def __init__(self, addr: str, *, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._cond = threading.Condition()
        self._blob: bytes | None = None
        self._step = -1
        self._serving = 0
        self._allowed = False
        self.bytes_sent = 0
        """Bytes of state this replica served to joiners."""
        self.bytes_received = 0
        """Bytes of state this replica received as a joiner."""
        transport = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = self._timeout_s

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    self.send_error(400, f"expected /checkpoint/STEP, got {self.path}")
                    return
                blob = transport._acquire(int(parts[1]))
                if blob is None:
                    self.send_error(409, f"step {parts[1]} is not served here now")
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(blob)))
                    self.end_headers()
                    self.wfile.write(blob)
                    transport.bytes_sent += len(blob)
                finally:
                    transport._release()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per request on stderr otherwise

        self._server = http.server.ThreadingHTTPServer((addr, 0), Handler)
        self._server.daemon_threads = True
        self._addr = addr
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="commfuse-ft-state", daemon=True
        )
        self._thread.start()

    def _acquire(self, step: int) -> bytes | None:
        """The staged blob of ``step`` (counted as being served), waiting for it to be staged
        up to the timeout; None if another step is staged or none came."""
        with self._cond:
            self._cond.wait_for(lambda: self._allowed and self._step >= step, self._timeout_s)
            if not self._allowed or self._step != step or self._blob is None:
                return None
            self._serving += 1
            return self._blob

    def _release(self) -> None:
        with self._cond:
            self._serving -= 1
            self._cond.notify_all()

    def metadata(self) -> str:
        port = self._server.server_address[1]
        return f"http://{self._addr}:{port}/checkpoint/"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        blob = pack_state(state_dict)  # a copy: the state may change after disallow
        with self._cond:
            self._blob, self._step, self._allowed = blob, step, True
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._allowed = False
            # Transfers in progress finish first: the Manager changes the state after this.
            self._cond.wait_for(lambda: self._serving == 0, self._timeout_s)
            self._blob = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as r:
            blob = r.read()
        self.bytes_received += len(blob)
        return unpack_state(blob)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout_s)
