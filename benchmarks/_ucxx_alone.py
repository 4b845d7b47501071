"""The same batches through ucxx alone: what the UCX data path's Python binding manages by itself.

``ucx_perftest`` (:mod:`_ucx_perftest`) measures UCX in C. The data path adds two things on top of
it: ucxx's Python binding (a request object, a future and a wake-up per message) and kvstore's own
work (the gRPC control call, leases or reservations, checksums at commit). This module measures the
first alone, between two processes over loopback, with the settings and endpoint options the data
path uses (``kvstore.protocol.ucx``: error handling on, so TCP), or between two network
namespaces (``hosts``):

* the receiver posts one receive per block of the next batch, then waits for them;
* the sender sends the batch as one tagged message per block, then waits for a one-byte
  acknowledgement the receiver sends once every block is in.

One sample is the sender's time from the first send to the acknowledgement: the batch through
ucxx with no control call and no store behind it. Where kvstore's path takes longer, the
difference is the control call and the store; where it does not, ucxx itself is the limit.
:func:`ucxx_alone` runs both sides as child processes (ucxx binds its context to one event loop,
and the benchmark process already has one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from _common import free_port, launchers, reap

from kvstore.protocol.ucx import load_ucxx, transfer_tag

__all__ = ["ucxx_alone"]

#: Tag of the receiver's acknowledgement (transfer tags start at transfer id 1, far above).
_ACK_TAG = 2
_WARMUP = 5
#: How long the receiver may take to listen, and each batch at most (a generous bound: the
#: largest batches take about 30 ms here).
_START_TIMEOUT_S = 30.0
_BATCH_TIMEOUT_S = 1.0


def ucxx_alone(
    cases: dict[str, tuple[int, int, int]], hosts: tuple[Any, Any] | None = None
) -> dict[str, list[float]]:
    """Seconds per batch for each ``label: (block bytes, blocks per batch, batches timed)``;
    ``hosts``: ``(receiver's, sender's)``, each with ``popen``, ``run`` and ``address`` (a
    ``harness.netns_hosts.Host``), instead of this host's loopback."""
    script = str(Path(__file__).resolve())
    popen, run, address = launchers(hosts)
    spec = {"cases": cases, "port": free_port(), "address": address}
    timeout = _time_limit(spec)
    argument = json.dumps(spec)
    with tempfile.TemporaryFile("w+") as receiver_log:
        receiver = popen(
            [sys.executable, script, "receive", argument],
            stdout=subprocess.PIPE,
            stderr=receiver_log,
            text=True,
        )
        try:
            _wait_for_ready(receiver, receiver_log)
            sender = run(
                [sys.executable, script, "send", argument],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if sender.returncode != 0:
                raise RuntimeError(
                    f"ucxx sender failed:\n{sender.stdout}\n{sender.stderr}\n"
                    f"receiver:\n{_contents(receiver_log)}"
                )
            samples: dict[str, list[float]] = json.loads(sender.stdout.splitlines()[-1])
            return samples
        finally:
            reap(receiver)
            if receiver.stdout is not None:
                receiver.stdout.close()


def _wait_for_ready(receiver: subprocess.Popen[str], log: IO[str]) -> None:
    """Wait until the receiver listens; raise with its log if it does not within the limit."""
    assert receiver.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(receiver.stdout, selectors.EVENT_READ)
        line = receiver.stdout.readline() if selector.select(_START_TIMEOUT_S) else ""
    if line.strip() != "ready":
        receiver.kill()
        receiver.wait()
        raise RuntimeError(f"ucxx receiver did not start: {line!r}\n{_contents(log)}")


def _contents(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


def _time_limit(spec: dict[str, Any]) -> float:
    """Seconds both sides may take for every batch of ``spec``, start-up included."""
    return _START_TIMEOUT_S + len(_rounds(spec)) * _BATCH_TIMEOUT_S


def _rounds(spec: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """``(label, block bytes, blocks, transfer id)`` of every batch both sides go through."""
    rounds = []
    transfer_id = 1
    for label, (size, batch, reps) in spec["cases"].items():
        for _ in range(_WARMUP + reps):
            rounds.append((label, size, batch, transfer_id))
            transfer_id += 1
    return rounds


async def _receive(spec: dict[str, Any]) -> None:
    ucxx = load_ucxx()
    done = asyncio.get_running_loop().create_future()

    async def serve(endpoint: Any) -> None:
        buffers: dict[str, list[np.ndarray[Any, np.dtype[np.uint8]]]] = {}
        ack = np.ones(1, dtype=np.uint8)
        try:
            for label, size, batch, transfer_id in _rounds(spec):
                blocks = buffers.setdefault(
                    label, [np.empty(size, dtype=np.uint8) for _ in range(batch)]
                )
                await asyncio.gather(
                    *(
                        endpoint.recv(block, tag=transfer_tag(transfer_id, index))
                        for index, block in enumerate(blocks)
                    )
                )
                await endpoint.send(ack, tag=_ACK_TAG)
            done.set_result(None)
        except Exception as exc:
            done.set_exception(exc)

    listener = ucxx.create_listener(serve, port=spec["port"], endpoint_error_handling=True)
    print("ready", flush=True)
    await asyncio.wait_for(done, _time_limit(spec))
    await asyncio.sleep(0.1)  # let the last acknowledgement leave before the endpoint goes
    listener.close()


async def _send(spec: dict[str, Any]) -> dict[str, list[float]]:
    ucxx = load_ucxx()
    endpoint = await ucxx.create_endpoint(
        spec["address"], spec["port"], endpoint_error_handling=True, connect_timeout=10.0
    )
    rng = np.random.default_rng(0)
    payloads = {
        label: [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(batch)]
        for label, (size, batch, _) in spec["cases"].items()
    }
    ack = np.empty(1, dtype=np.uint8)
    samples: dict[str, list[float]] = {label: [] for label in spec["cases"]}
    seen: dict[str, int] = {}
    for label, _, _, transfer_id in _rounds(spec):
        started = time.perf_counter()
        await asyncio.gather(
            *(
                endpoint.send(block, tag=transfer_tag(transfer_id, index))
                for index, block in enumerate(payloads[label])
            ),
            endpoint.recv(ack, tag=_ACK_TAG),
        )
        elapsed = time.perf_counter() - started
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > _WARMUP:
            samples[label].append(elapsed)
    await endpoint.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description="one side of the ucxx-alone measurement")
    parser.add_argument("role", choices=["receive", "send"])
    parser.add_argument("spec", help="JSON: cases (label: [bytes, blocks, reps]), port")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if args.role == "receive":
        asyncio.run(_receive(spec))
    else:
        print(json.dumps(asyncio.run(_send(spec))), flush=True)


if __name__ == "__main__":
    main()
