"""The CPU stand-ins (:mod:`harness.sglang_cpu`) still fit the installed SGLang.

Each stand-in replaces one piece of the pinned SGLang (0.5.23) that needs CUDA. When SGLang is
upgraded, a piece may move, be renamed or take other arguments, and a stand-in would then quietly
stand in for nothing (or break the engine tier in a way that reads as a kvstore bug). Each test
here fails with a message that names what changed and where, so the stand-in is fixed first:

- the version is the pinned one (``scripts/setup-sglang.sh`` and ``PINNED_SGLANG`` move together);
- SGLang's CPU engine is on, and its norm and activation layers run without calling
  ``sgl_kernel`` (the stand-in raises, naming the function, if they do);
- torchvision still has the two registration modules the stand-in skips;
- the host pool's base class still takes ``pin_memory`` and reserves host memory by the constant
  the stand-in lowers, and a real ``MHATokenToKVPoolHost``
  built with ``pin_memory=True`` comes out unpinned;
- SGLang's MHA host pool still calls ``transfer_kv_direct`` with the stand-in's keywords, and a
  real host pool moves a device pool's pages out and back through it byte for byte;
- ``python -m sglang.launch_server`` still does what the launcher repeats, with ``spawn``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

from harness import sglang_cpu


def _source(module: Any) -> str:
    return Path(inspect.getfile(module)).read_text()


def test_sglang_is_the_pinned_release() -> None:
    import sglang

    assert sglang.__version__ == sglang_cpu.PINNED_SGLANG, (
        f"SGLang {sglang.__version__} is installed, the CPU stand-ins were written for "
        f"{sglang_cpu.PINNED_SGLANG}: check each stand-in against it (this file's tests say "
        "which), then move PINNED_SGLANG and scripts/setup-sglang.sh together"
    )


def test_the_cpu_engine_is_on_and_its_layers_need_no_sgl_kernel() -> None:
    import torch
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.utils import common

    assert common.is_cpu(), "sglang.srt.utils.is_cpu() is False under SGLANG_USE_CPU_ENGINE=1"
    assert not common.cpu_has_amx_support(), (
        "this CPU has AMX: SGLang's norms would call sgl_kernel's CPU ops, which the import-only "
        "stand-in does not have"
    )
    x = torch.randn(3, 8)
    norm = RMSNorm(8)
    out = norm.forward_cpu(x)
    assert out.shape == x.shape
    with_residual = norm.forward_cpu(x.clone(), torch.randn(3, 8))
    assert isinstance(with_residual, tuple) and len(with_residual) == 2
    gated = SiluAndMul().forward_cpu(torch.randn(3, 16))
    assert gated.shape == (3, 8)


def test_the_import_only_sgl_kernel_names_what_was_called() -> None:
    import sgl_kernel

    assert sgl_kernel.__version__.endswith("cpu-stand-in"), (
        f"a real sgl_kernel ({sgl_kernel.__version__}) is installed: the stand-in is not used"
    )
    for name in sglang_cpu.SGL_KERNEL_NAMES:
        try:
            getattr(sgl_kernel, name)()
        except RuntimeError as exc:
            assert f"sgl_kernel.{name}" in str(exc)
        else:
            raise AssertionError(f"sgl_kernel.{name} stand-in returned instead of raising")


def test_torchvision_still_has_the_registrations_that_are_skipped() -> None:
    import torchvision

    folder = Path(torchvision.__path__[0])
    for name in ("_meta_registrations", "_autograd_registrations"):
        assert (folder / f"{name}.py").exists(), (
            f"torchvision {torchvision.__version__} has no {name}.py: the stand-in that skips "
            "it (harness/sglang_cpu.py _skip_torchvision_registrations) is stale"
        )
    assert "_meta_registrations" in (folder / "__init__.py").read_text()


def test_the_host_pool_takes_pin_memory_and_comes_out_unpinned() -> None:
    from sglang.srt.mem_cache.pool_host import base

    init = base.HostKVCache.__init__
    assert getattr(init, "_kvstore_cpu_stand_in", False), "HostKVCache.__init__ is not wrapped"
    parameters = inspect.signature(init.__wrapped__).parameters
    assert "pin_memory" in parameters, (
        "sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__ has no pin_memory parameter any "
        f"more ({list(parameters)}): the unpinned-host-pool stand-in is stale"
    )
    assert isinstance(getattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", None), int), (
        "pool_host/base.py has no HICACHE_HOST_MEMORY_RESERVE_BYTES any more: the lowered "
        "host-memory reserve (harness/sglang_cpu.py) is stale"
    )
    assert "HICACHE_HOST_MEMORY_RESERVE_BYTES" in inspect.getsource(base.host_memory_budget_bytes)
    pool = _host_pool(pin_memory=True)
    assert pool.pin_memory is False
    assert not pool.kv_buffer.is_pinned()


def test_the_direct_transfer_is_called_with_the_stand_ins_keywords() -> None:
    from sglang.srt.mem_cache.pool_host import mha

    assert mha.transfer_kv_direct is sglang_cpu.transfer_kv_direct
    expected = set(inspect.signature(sglang_cpu.transfer_kv_direct).parameters)
    calls = [
        node
        for node in ast.walk(ast.parse(_source(mha)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "transfer_kv_direct"
    ]
    assert calls, "sglang's pool_host/mha.py no longer calls transfer_kv_direct"
    for call in calls:
        keywords = {keyword.arg or "**" for keyword in call.keywords}  # None: a **mapping
        assert keywords == expected and not call.args, (
            f"pool_host/mha.py line {call.lineno} calls transfer_kv_direct with "
            f"{sorted(keywords)} (+{len(call.args)} positional); the stand-in takes "
            f"{sorted(expected)}"
        )


def test_a_real_host_pool_moves_pages_through_the_direct_stand_in() -> None:
    import torch

    pool, device = _host_pool(pin_memory=False, with_device=True)
    generator = torch.Generator().manual_seed(1)
    for layer in (*device.k_buffer, *device.v_buffer):
        layer.copy_(torch.randn(layer.shape, generator=generator).to(layer.dtype))
    pages = torch.arange(2 * 16, 4 * 16, dtype=torch.int64)  # device pages 2 and 3
    host = pool.alloc(len(pages))
    assert host is not None
    pool.backup_from_device_all_layer(device, host, pages, "direct")
    before = [layer[pages].clone() for layer in (*device.k_buffer, *device.v_buffer)]
    target = torch.arange(5 * 16, 7 * 16, dtype=torch.int64)  # back into device pages 5 and 6
    for layer_id in range(len(device.k_buffer)):
        pool.load_to_device_per_layer(device, host, target, layer_id, "direct")
    after = [layer[target] for layer in (*device.k_buffer, *device.v_buffer)]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)


def test_the_launcher_repeats_sglangs_own_main() -> None:
    import sglang.launch_server
    from sglang.srt.entrypoints import engine

    source = _source(sglang.launch_server)
    main = source.split('if __name__ == "__main__":', 1)[-1]
    for step in ("load_plugins()", "prepare_server_args(sys.argv[1:])", "run_server(server_args)"):
        assert step in main, (
            f"sglang/launch_server.py's __main__ no longer runs {step}: "
            "tests/sglang_engine/launch_cpu_server.py main() repeats it and must follow"
        )
    assert 'set_start_method("spawn"' in _source(engine), (
        "SGLang no longer spawns its workers: check that the launcher's top-level install() "
        "still reaches them"
    )


def _host_pool(*, pin_memory: bool, with_device: bool = False) -> Any:
    """SGLang's real MHA host pool (layer_first) over a CPU device pool of 8 pages of 16."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers = 2
    device = MHATokenToKVPool(
        128, 16, torch.float32, 2, 8, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    pool = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        16,
        "layer_first",
        pin_memory=pin_memory,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers,
    )
    return (pool, device) if with_device else pool
