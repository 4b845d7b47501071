"""Page-locking a client's arena mapping for DMA: in pieces, in the background, in the right order.

:class:`~kvstore.client.arena_registration.ArenaRegistration` is driven here by a stand-in
registrar (harness/cuda_stand_in.py: it records ranges, and can refuse or be slow), since no CUDA
runs here; the registration of a real mapping with the CUDA runtime is a ``gpu`` test in
tests/integration/test_arena_dma.py. Also the runtime's lookup among this process's mappings and
the client setting that bounds the bytes.
"""

from __future__ import annotations

import threading
import time

import pytest
from harness.cuda_stand_in import StandInRegistrar

from kvstore.client.arena_registration import ArenaRegistration
from kvstore.client.cuda_runtime import CudaRuntimeUnavailable, cuda_runtime, loaded_runtime_path
from kvstore.client.settings import ClientSettings
from kvstore.errors import ConfigError

BASE, PIECE = 1 << 40, 1 << 20


def _settle(registration: ArenaRegistration, timeout: float = 30.0) -> None:
    """Until the thread has nothing left to do (every piece, a failure, or the limit)."""
    deadline = time.monotonic() + timeout
    while registration._thread.is_alive():
        assert time.monotonic() < deadline, registration.stats()
        time.sleep(0.005)


def test_every_piece_is_registered_once_and_unregistered_at_close() -> None:
    registrar = StandInRegistrar()
    registration = ArenaRegistration(BASE, 5 * PIECE + 7, registrar, piece_bytes=PIECE)
    _settle(registration)
    assert sorted(registrar.registered) == [
        *[(BASE + i * PIECE, PIECE) for i in range(5)],
        (BASE + 5 * PIECE, 7),  # the last piece is what is left
    ]
    assert registration.covers(BASE, 5 * PIECE + 7)
    assert registration.stats()["registered_bytes"] == 5 * PIECE + 7
    assert registration.close()
    assert sorted(registrar.unregistered) == [BASE + i * PIECE for i in range(6)]
    assert not registration.covers(BASE, 1), "a closed registration covers nothing"


def test_pieces_a_transfer_asked_for_come_before_hinted_ones_and_those_before_the_rest() -> None:
    registrar = StandInRegistrar(delay_s=0.02)
    hints = [(7 * PIECE + 10, 100)]  # a published block in piece 7
    registration = ArenaRegistration(
        BASE, 10 * PIECE, registrar, piece_bytes=PIECE, hints=lambda: hints
    )
    registration.want(BASE + 4 * PIECE + 5, PIECE)  # straddles pieces 4 and 5
    _settle(registration)
    order = [(address - BASE) // PIECE for address, _ in registrar.registered]
    # The thread may have begun piece 7 (or 0) before the want arrived; 4 and 5 come at once.
    assert order.index(4) <= 1 and order.index(5) == order.index(4) + 1, order
    assert order.index(7) < order.index(1), order
    assert sorted(order) == list(range(10))


def test_covers_needs_every_piece_under_the_range_and_cut_stays_inside_pieces() -> None:
    registrar = StandInRegistrar(delay_s=0.05)
    registration = ArenaRegistration(BASE, 4 * PIECE, registrar, piece_bytes=PIECE)
    assert registration.wait_covered(BASE + PIECE - 1, 2, timeout=30)  # pieces 0 and 1
    assert registration.covers(BASE, 2 * PIECE)
    assert not registration.covers(BASE - 1, 2), "outside the mapping"
    assert not registration.covers(BASE + 4 * PIECE - 1, 2), "past its end"
    assert not registration.covers(BASE, 0)
    assert registration.cut(BASE + PIECE - 3, PIECE + 6) == [
        (BASE + PIECE - 3, 3, 0),
        (BASE + PIECE, PIECE, 1),
        (BASE + 2 * PIECE, 3, 2),
    ]
    assert registration.close()


def test_a_refused_piece_stops_registration_with_its_reason_and_keeps_the_others() -> None:
    class RefusesTheThird(StandInRegistrar):
        def register(self, address: int, nbytes: int) -> int:
            return 2 if len(self.registered) == 2 else super().register(address, nbytes)

    registrar = RefusesTheThird()
    registration = ArenaRegistration(BASE, 6 * PIECE, registrar, piece_bytes=PIECE)
    _settle(registration)
    failure = registration.failure or ""
    assert "stand-in refusal 2" in failure, failure
    assert len(registrar.registered) == 2
    assert registration.covers(BASE, 2 * PIECE) and not registration.covers(BASE, 3 * PIECE)
    assert not registration.wait_covered(BASE + 5 * PIECE, 1, timeout=5), "it never will be"
    assert registration.close()


def test_an_exception_from_the_registrar_is_a_failure_too() -> None:
    class Raises(StandInRegistrar):
        def register(self, address: int, nbytes: int) -> int:
            raise OSError("driver gone")

    registration = ArenaRegistration(BASE, PIECE, Raises(), piece_bytes=PIECE)
    _settle(registration)
    assert "OSError: driver gone" in (registration.failure or "")
    assert registration.close()


def test_the_limit_bounds_the_bytes_registered() -> None:
    registrar = StandInRegistrar()
    registration = ArenaRegistration(
        BASE, 10 * PIECE, registrar, piece_bytes=PIECE, limit=3 * PIECE + 1
    )
    _settle(registration)
    assert len(registrar.registered) == 3
    assert "limit" in (registration.failure or "")
    assert registration.close()


def test_close_waits_for_transfers_in_flight_and_refuses_new_ones() -> None:
    registrar = StandInRegistrar()
    registration = ArenaRegistration(BASE, PIECE, registrar, piece_bytes=PIECE)
    assert registration.wait_covered(BASE, PIECE, timeout=30)
    assert registration.enter()
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(registration.close(timeout=30)))
    closer.start()
    deadline = time.monotonic() + 30
    while not registration._closing:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not registration.enter(), "a closing registration takes no new transfer"
    assert not registrar.unregistered, "unregistered under a transfer in flight"
    registration.leave()
    closer.join(30)
    assert closed == [True] and registrar.unregistered == [BASE]


def test_close_gives_up_on_a_transfer_that_never_ends_and_keeps_the_pages() -> None:
    registrar = StandInRegistrar()
    registration = ArenaRegistration(BASE, PIECE, registrar, piece_bytes=PIECE)
    assert registration.wait_covered(BASE, PIECE, timeout=30)
    assert registration.enter()
    assert not registration.close(timeout=0.1)
    assert registrar.unregistered == [], "the pages stay registered (and mapped)"


def test_unreadable_hints_do_not_stop_registration() -> None:
    def torn() -> list[tuple[int, int]]:
        raise ValueError("a torn index row")

    registrar = StandInRegistrar()
    registration = ArenaRegistration(BASE, 2 * PIECE, registrar, piece_bytes=PIECE, hints=torn)
    _settle(registration)
    assert len(registrar.registered) == 2 and registration.failure is None


def test_the_runtime_is_found_among_the_process_s_mappings() -> None:
    maps = (
        "7f00-7f01 r--p 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /x/nvidia/cu13/lib/libcudart.so.13\n"
    )
    assert loaded_runtime_path(maps) == "/x/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_runtime_path("7f00-7f01 r--p 0 08:01 12 /usr/lib/libc.so.6\n") is None


def test_without_cuda_the_runtime_is_unavailable_with_a_reason() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")  # the gpu tests use the runtime there
    with pytest.raises(CudaRuntimeUnavailable, match="no CUDA device"):
        cuda_runtime()


def test_the_registration_bound_is_a_client_setting() -> None:
    assert ClientSettings.from_env({}).shm_cuda_register is None
    assert ClientSettings.from_env({"KVSTORE_SHM_CUDA_REGISTER": "off"}).shm_cuda_register == 0
    assert (
        ClientSettings.from_env({"KVSTORE_SHM_CUDA_REGISTER": "2GiB"}).shm_cuda_register == 2 << 30
    )
    with pytest.raises(ConfigError, match="KVSTORE_SHM_CUDA_REGISTER must be all, off or a size"):
        ClientSettings.from_env({"KVSTORE_SHM_CUDA_REGISTER": "most"})
