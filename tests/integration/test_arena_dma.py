"""DMA between page-locked arena pages and device memory: the plan per layer and the copies.

:func:`~kvstore.integrations.paged.arena_dma.plan_rows` is pure arithmetic, tested alone. The copies
run twice: on the CPU through the CUDA stand-in (tests/harness/cuda_stand_in.py: queued streams, a
registrar that locks nothing), and, marked ``gpu``, on a real CUDA device with a real mapping
registered through the CUDA runtime, pieces small enough that rows straddle them.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest
import torch
from harness.cuda_stand_in import StandInDevice, StandInRegistrar

from kvstore.client.arena_registration import ArenaRegistration
from kvstore.integrations.paged.arena_dma import (
    ArenaSource,
    RowCopy,
    arena_source,
    plan_rows,
    save_rows,
)
from kvstore.integrations.paged.device import Device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _one_piece(address: int, nbytes: int) -> list[tuple[int, int, int]]:
    return [(address, nbytes, 0)]


def test_rows_at_equal_distances_on_both_sides_are_one_copy() -> None:
    rows = [(1000 + i * 300, i * 100) for i in range(5)]
    assert plan_rows(rows, 100, _one_piece) == [RowCopy(1000, 300, 0, 100, 100, 5)]
    rows = [(1000 + i * 100, i * 700) for i in range(3)]  # a save: device rows apart
    assert plan_rows(rows, 100, _one_piece) == [RowCopy(1000, 100, 0, 700, 100, 3)]


def test_a_change_of_distance_on_either_side_starts_another_copy() -> None:
    rows = [(1000, 0), (1300, 100), (1700, 200), (2100, 300), (2500, 500)]
    assert plan_rows(rows, 100, _one_piece) == [
        RowCopy(1000, 300, 0, 100, 100, 2),
        RowCopy(1700, 400, 200, 100, 100, 2),
        RowCopy(2500, 100, 500, 100, 100, 1),  # its device offset is out of step
    ]


def test_a_save_s_rows_are_one_copy_per_chunk() -> None:
    rows = save_rows([10_000, 50_000], layers=3, layer_nbytes=100)
    assert rows == [
        (10_000, 0), (10_100, 200), (10_200, 400),
        (50_000, 100), (50_100, 300), (50_200, 500),
    ]  # fmt: skip
    assert plan_rows(rows, 100, _one_piece) == [
        RowCopy(10_000, 100, 0, 200, 100, 3),
        RowCopy(50_000, 100, 100, 200, 100, 3),
    ]


def test_rows_overlapping_or_going_backwards_are_never_merged() -> None:
    assert len(plan_rows([(1000, 0), (1050, 100)], 100, _one_piece)) == 2  # pitch < width
    assert len(plan_rows([(1000, 0), (700, 100)], 100, _one_piece)) == 2


def test_rows_are_cut_where_a_piece_ends_and_never_merged_across_it() -> None:
    registration = ArenaRegistration(0x10000, 1 << 16, StandInRegistrar(), piece_bytes=1000)
    base = registration.base
    # Rows of 300 bytes 400 apart from the start: row 2 (800..1100) straddles pieces 0 and 1.
    rows = [(base + i * 400, i * 300) for i in range(5)]
    copies = plan_rows(rows, 300, registration.cut)
    assert copies == [
        RowCopy(base, 400, 0, 300, 300, 2),
        RowCopy(base + 800, 200, 600, 200, 200, 1),  # the part in piece 0
        RowCopy(base + 1000, 100, 800, 100, 100, 1),  # the part in piece 1
        RowCopy(base + 1200, 400, 900, 300, 300, 2),
    ]
    assert registration.close()


def test_a_lease_not_yet_page_locked_asks_for_its_pieces_and_takes_no_direct_path() -> None:
    registrar = StandInRegistrar(delay_s=0.5)
    arena = np.zeros(8 << 20, dtype=np.uint8)
    registration = ArenaRegistration(
        arena.ctypes.data, arena.nbytes, registrar, piece_bytes=1 << 20
    )
    views = [arena[(6 << 20) + i * 4096 : (6 << 20) + (i + 1) * 4096] for i in range(2)]
    assert arena_source([*views, None], registration, 4096, 2) is None
    assert registration.wait_covered(views[0].ctypes.data, 4096, timeout=30)
    # Piece 6 came before the pieces in front of it (each takes 0.5 s here).
    assert registrar.registered[0][0] - arena.ctypes.data <= 6 << 20
    source = arena_source([*views, arena[:100]], registration, 4096, 2)
    assert source is not None
    assert source.addresses == [views[0].ctypes.data, views[1].ctypes.data, None]
    assert source.layer_nbytes == 2048
    registration.leave()
    assert registration.close()


def _arena(nbytes: int) -> tuple[mmap.mmap, np.ndarray[Any, Any]]:
    mapping = mmap.mmap(-1, nbytes)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


def _layers_round_trip(device: Device, registrar: Any, device_name: str) -> None:
    """Chunks at odd places in a mapping cut into small pieces: every layer DMAed into device
    staging equals the chunks' slices; then the chunks DMAed back into other pages."""
    layers, layer_bytes, chunks = 3, 5000, 4
    mapping, arena = _arena(1 << 20)
    arena[:] = np.random.default_rng(1).integers(0, 256, arena.nbytes, dtype=np.uint8)
    registration = ArenaRegistration(arena.ctypes.data, arena.nbytes, registrar, piece_bytes=12288)
    try:
        assert registration.wait_covered(arena.ctypes.data, arena.nbytes, timeout=60)
        chunk_bytes = layers * layer_bytes
        # Two chunks back to back, a gap, two more back to back: two copies per layer at least.
        offsets = [100, 100 + chunk_bytes, 90_000, 90_000 + chunk_bytes]
        views = [arena[o : o + chunk_bytes] for o in offsets]
        source = arena_source(views, registration, chunk_bytes, layers)
        assert isinstance(source, ArenaSource)
        stream = device.new_stream()
        staging = torch.zeros((layers, chunks, layer_bytes), dtype=torch.uint8, device=device_name)
        for layer in range(layers):
            for copy in source.layer_copies(layer):
                device.dma_to_device(copy, staging[layer].data_ptr(), stream)
        done = device.new_event(blocking=True)
        done.record(stream)
        done.synchronize()
        got = staging.cpu().numpy()
        for layer in range(layers):
            for chunk, offset in enumerate(offsets):
                start = offset + layer * layer_bytes
                assert np.array_equal(got[layer, chunk], arena[start : start + layer_bytes])
        # Back, as a save does: chunk i is row i of every layer of the staging.
        targets = [arena.ctypes.data + 500_000 + i * (chunk_bytes + 77) for i in range(chunks)]
        base = staging.data_ptr()
        for copy in plan_rows(
            save_rows(targets, layers, layer_bytes), layer_bytes, registration.cut
        ):
            device.dma_to_host(copy, base, stream)
        done.record(stream)
        done.synchronize()
        for chunk, offset in enumerate(offsets):
            at = 500_000 + chunk * (chunk_bytes + 77)
            assert np.array_equal(
                arena[at : at + chunk_bytes], arena[offset : offset + chunk_bytes]
            )
        registration.leave()
    finally:
        assert registration.close()  # before the mapping goes (with the last view of it)
    del mapping


def test_layers_dma_out_of_arena_pieces_and_back_through_the_cuda_stand_in() -> None:
    _layers_round_trip(StandInDevice(torch.device("cpu")), StandInRegistrar(), "cpu")


@pytest.mark.gpu
@needs_cuda
def test_layers_dma_out_of_a_registered_mapping_and_back_on_cuda() -> None:
    device = Device(torch.device("cuda"))
    _layers_round_trip(device, device.host_registrar(), "cuda")


def test_the_device_hands_each_copy_to_the_runtime_as_destination_then_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real :class:`Device`'s call of ``cudaMemcpy2DAsync`` (a recording stand-in for the
    runtime: no CUDA here): loads write the device side, saves the host side."""
    import contextlib

    from kvstore.integrations.paged import device as device_module

    calls: list[tuple[int, ...]] = []

    class Runtime:
        def copy_2d_async(self, *args: int) -> None:
            calls.append(args)

    monkeypatch.setattr(device_module, "cuda_runtime", Runtime)
    monkeypatch.setattr(device_module.torch.cuda, "device", lambda _: contextlib.nullcontext())
    device = Device(torch.device("cuda"))
    stream = device_module.Stream(type("Raw", (), {"cuda_stream": 99})())
    copy = RowCopy(host=5000, host_pitch=300, device=40, device_pitch=100, width=100, height=4)
    device.dma_to_device(copy, 1 << 30, stream)
    device.dma_to_host(copy, 1 << 30, stream)
    assert calls == [
        ((1 << 30) + 40, 100, 5000, 300, 100, 4, 1, 99),  # dst, pitch, src, pitch, w, h, H2D
        (5000, 300, (1 << 30) + 40, 100, 100, 4, 2, 99),  # D2H
    ]
