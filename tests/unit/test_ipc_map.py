"""CUDA IPC mappings are opened once per process and closed with the last
connection that holds them (CUDA refuses a second open of a handle in one
context). The CUDA calls are recorded by a stand-in; tests/gpu/ opens real
handles."""

import sys
import types

import pytest

from kvx._datapath import gpu


@pytest.fixture
def calls(monkeypatch):
    log = []

    def open_handle(handle, flags):
        log.append(("open", handle))
        return 0x1000 * len(log)

    class Device:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    runtime = types.SimpleNamespace(
        ipcOpenMemHandle=open_handle, ipcCloseMemHandle=lambda address: log.append(("close", address))
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=Device)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(gpu, "_opened", {})
    # What the driver says of a mapping: it starts an allocation of 4 KiB.
    monkeypatch.setattr(gpu, "_allocation", lambda address: (address, 4096))
    return log


def test_a_handle_opens_once_per_process_and_closes_with_its_last_holder(calls):
    first, second = gpu.IpcMap(0), gpu.IpcMap(0)
    address, length = first.open(b"h1")
    assert first.open(b"h1") == second.open(b"h1") == (address, 4096)
    other, _ = second.open(b"h2")
    assert calls == [("open", b"h1"), ("open", b"h2")]
    first.close()
    assert calls == [("open", b"h1"), ("open", b"h2")]  # second still holds both
    second.close()
    assert sorted(calls[2:]) == sorted([("close", address), ("close", other)])
    with pytest.raises(gpu.TransferError, match="closed"):
        first.open(b"h3")


def test_the_same_handle_on_another_device_is_another_mapping(calls):
    a, b = gpu.IpcMap(0), gpu.IpcMap(1)
    assert a.open(b"h") != b.open(b"h")
    assert [c[0] for c in calls] == ["open", "open"]


def test_a_released_handle_closes_with_its_last_holder_and_opens_anew(calls):
    first, second = gpu.IpcMap(0), gpu.IpcMap(0)
    address, _ = first.open(b"h")
    second.open(b"h")
    first.release(b"h")
    first.release(b"h")  # releasing what is not held does nothing
    assert [c[0] for c in calls] == ["open"]
    second.release(b"h")
    assert calls[-1] == ("close", address)
    assert first.open(b"h") != (address, 4096) and calls[-1][0] == "open"


def test_a_mapping_the_driver_does_not_place_at_an_allocation_start_is_refused(calls, monkeypatch):
    monkeypatch.setattr(gpu, "_allocation", lambda address: (address - 16, 4096))
    with pytest.raises(gpu.TransferError, match="inside another allocation"):
        gpu.IpcMap(0).open(b"h")
    assert [c[0] for c in calls] == ["open", "close"] and gpu._opened == {}
