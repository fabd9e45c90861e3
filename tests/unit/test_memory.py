import mmap
import sys
import threading
import time

import numpy as np
import pytest

import kvx
from kvx._datapath import gpu
from kvx.memory import LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, RegionTable


@pytest.fixture
def agent():
    with kvx.Agent("mem-test") as a:
        yield a


def test_register_numpy_bytearray_memoryview_mmap_raw(agent):
    arr = np.zeros(4096, np.uint8)
    ba = bytearray(100)
    mm = mmap.mmap(-1, 8192)
    regions = [
        agent.register(arr),
        agent.register(ba),
        agent.register(memoryview(ba)[10:50]),
        agent.register(mm),
        agent.register((arr.ctypes.data, 64)),
    ]
    assert [r.size_bytes for r in regions] == [4096, 100, 40, 8192, 64]
    assert regions[0].address == arr.ctypes.data
    assert regions[4].address == arr.ctypes.data
    assert len({r.id for r in regions}) == 5 and 0 not in {r.id for r in regions}
    for r in regions:
        agent.deregister(r)
    mm.close()


def test_register_keeps_memory_alive_until_deregistered(agent):
    mm = mmap.mmap(-1, 4096)
    region = agent.register(mm)
    with pytest.raises(BufferError):
        mm.close()  # exported to the agent: cannot be unmapped under a peer
    agent.deregister(region)
    mm.close()  # the Region handle left behind no longer pins it


def test_register_torch_cpu_tensor(agent):
    torch = pytest.importorskip("torch", reason="torch is installed by the test extra")
    t = torch.zeros(16, 128, dtype=torch.bfloat16)
    region = agent.register(t)
    assert region.address == t.data_ptr() and region.size_bytes == 16 * 128 * 2
    with pytest.raises(kvx.ConfigError, match="contiguous"):
        agent.register(t.t())


def test_readonly_memory_is_never_remotely_writable(agent):
    region = agent.register(b"immutable bytes")
    assert region.remote_read and not region.remote_write and not region.writable


def test_register_refuses_bad_objects(agent):
    with pytest.raises(kvx.ConfigError):
        agent.register(np.zeros((8, 8))[:, ::2])
    with pytest.raises(kvx.ConfigError):
        agent.register("not memory")
    with pytest.raises(kvx.ConfigError):
        agent.register((0, 10))
    with pytest.raises(kvx.RegionError):
        agent.register(bytearray())


class _FakeCuda:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = {
            "data": (0x7000_0000, False),
            "shape": (4, 8),
            "typestr": "<f2",
            "version": 3,
            **cai,
        }


class _FakeDLPack:
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    def __dlpack__(self, stream=None):
        raise AssertionError("not reached without CuPy")


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError


def test_gpu_memory_without_cupy_names_the_extra(agent, no_cupy):
    for obj in (_FakeCuda(), _FakeDLPack()):
        with pytest.raises(kvx.RegionError, match=r"CuPy.*kvx\[gpu\]"):
            agent.register(obj)
    with pytest.raises(kvx.RegionError, match=r"kvx\[gpu\]"):
        agent.register((0x7000_0000, 4096), device=0)
    assert not agent.regions


def test_device_is_only_for_raw_gpu_ranges(agent):
    with pytest.raises(kvx.ConfigError, match="host memory"):
        agent.register(np.zeros(16, np.uint8), device=0)
    with pytest.raises(kvx.ConfigError, match="device index"):
        agent.register((0x7000_0000, 4096), device=-1)


def test_cuda_array_interface_must_describe_one_contiguous_range():
    assert gpu.interface_extent(_FakeCuda().__cuda_array_interface__) == (0x7000_0000, 64, False)
    c_order = _FakeCuda(strides=(16, 2)).__cuda_array_interface__
    assert gpu.interface_extent(c_order)[1] == 64
    for bad in (_FakeCuda(strides=(2, 8)), _FakeCuda(strides=(32, 2)), _FakeCuda(mask=object())):
        with pytest.raises(kvx.ConfigError):
            gpu.interface_extent(bad.__cuda_array_interface__)
    with pytest.raises(kvx.ConfigError, match="malformed"):
        gpu.interface_extent({"shape": (2,)})
    assert gpu.interface_extent(
        _FakeCuda(data=(0x10, True), shape=(), strides=None).__cuda_array_interface__
    ) == (0x10, 2, True)


def test_what_counts_as_cuda_memory_needs_neither_cupy_nor_torch(no_cupy):
    assert gpu.is_cuda(_FakeCuda()) and gpu.is_cuda(_FakeDLPack())
    assert not gpu.is_cuda(np.zeros(4)) and not gpu.is_cuda(bytearray(4))
    torch = pytest.importorskip("torch")
    assert not gpu.is_cuda(torch.zeros(4))


def test_resolve_checks_bounds_flags_and_unknown_regions():
    table = RegionTable(16)
    buf = np.zeros(100, np.uint8)
    r = table.add(buf, remote_access=True)
    local_only = table.add(np.zeros(10, np.uint8), remote_access=False)
    ok = kvx.Descs.build(r, [0, 90], [10, 10]).array
    addrs, lens, total, token = table.resolve(ok, REMOTE_READ | REMOTE_WRITE, "t")
    assert list(addrs) == [buf.ctypes.data, buf.ctypes.data + 90] and list(lens) == [10, 10] and total == 20
    table.release(token)
    many = kvx.Descs.build(r, np.arange(40), 1).array  # the vectorised path gives the same
    addrs, lens, total, token = table.resolve(many, REMOTE_READ, "t")
    assert list(addrs) == list(buf.ctypes.data + np.arange(40)) and total == 40
    table.release(token)
    for n in (1, 40):  # the small-list path and the vectorised path say the same
        pad = [0] * (n - 1)
        cases = {
            "outside": kvx.Descs.build(r, pad + [95], 10),
            "unknown region 9": kvx.Descs.build([r.id] * (n - 1) + [9], pad + [0], 1),
            "without remote access": kvx.Descs.build([r.id] * (n - 1) + [local_only.id], pad + [0], 1),
            "unknown region 0": kvx.Descs.build([r.id] * (n - 1) + [0], pad + [0], 1),
        }
        for message, descs in cases.items():
            with pytest.raises(kvx.AccessError, match=message):
                table.resolve(descs.array, REMOTE_READ, "t")
    huge = kvx.Descs.build(r, [2**63], [2**63]).array  # offset + length overflows 64 bits
    with pytest.raises(kvx.AccessError, match="outside"):
        table.resolve(huge, REMOTE_READ, "t")
    readonly = table.add(b"ro", remote_access=True)
    with pytest.raises(kvx.AccessError, match="does not allow"):
        table.resolve(kvx.Descs.build(readonly, 0, 1).array, LOCAL_WRITE, "t")


def test_deregister_waits_for_accesses_in_flight_then_refuses_new_ones():
    table = RegionTable(16)
    r = table.add(np.zeros(100, np.uint8), remote_access=True)
    descs = kvx.Descs.build(r, 0, 10).array
    _, _, _, token = table.resolve(descs, REMOTE_READ, "t")
    with pytest.raises(kvx.RegionBusyError):
        table.remove(r, timeout_s=0.05)
    table.resolve(descs, REMOTE_READ, "t")  # still usable after the refused deregister
    threading.Timer(0.1, table.release, args=(token,)).start()
    start = time.monotonic()
    with pytest.raises(kvx.RegionBusyError):  # the second resolve above still pins it
        table.remove(r, timeout_s=0.3)
    assert time.monotonic() - start >= 0.25


def test_deregister_completes_once_released():
    table = RegionTable(16)
    r = table.add(np.zeros(100, np.uint8), remote_access=True)
    descs = kvx.Descs.build(r, 0, 10).array
    _, _, _, token = table.resolve(descs, REMOTE_READ, "t")
    threading.Timer(0.1, table.release, args=(token,)).start()
    table.remove(r, timeout_s=5)
    with pytest.raises(kvx.AccessError, match="unknown region"):
        table.resolve(descs, REMOTE_READ, "t")
    with pytest.raises(kvx.RegionError):
        table.remove(r, timeout_s=1)


@pytest.mark.parametrize("small", [True, False], ids=["short-list", "numpy"])
def test_a_pin_on_named_regions_holds_back_only_their_deregistration(small):
    """resolve() (both of its paths) and pin_table(ids) pin the regions their
    descriptors name: a transfer that lasts (a peer trickling a WRITE's data,
    a target slow to answer) holds back the deregistration of those, not of
    any other region. A whole-table pin (pin_table()) still holds back all."""
    table = RegionTable(16)
    a, b, c = (table.add(np.zeros(1 << 16, np.uint8), remote_access=True) for _ in range(3))
    n = 2 if small else 200  # resolve's short-list path, or its numpy one
    descs = kvx.Descs.from_blocks(a, np.arange(n), 64).array
    descs["region"][1] = b.id  # two regions named, a third not
    _, _, _, named = table.resolve(descs, REMOTE_READ, "t")
    started = time.monotonic()
    table.remove(c, timeout_s=5)
    assert time.monotonic() - started < 1, "a region the pin does not name waited for it"
    for region in (a, b):
        with pytest.raises(kvx.RegionBusyError, match="still has transfers in flight"):
            table.remove(region, timeout_s=0.2)
    table.release(named)
    d = table.add(np.zeros(64, np.uint8), remote_access=True)
    by_ids, *_ = table.pin_table((a.id, 999))  # an unknown id is pinned for nothing
    whole, *_ = table.pin_table()
    with pytest.raises(kvx.RegionBusyError):
        table.remove(d, timeout_s=0.2)  # the whole-table pin
    table.release(whole)
    table.remove(d, timeout_s=5)
    with pytest.raises(kvx.RegionBusyError):
        table.remove(a, timeout_s=0.2)
    table.release(by_ids)
    table.remove(a, timeout_s=5)
    table.remove(b, timeout_s=5)


def test_a_table_pin_holds_deregister_and_a_later_one_sees_the_region_gone():
    """pin_table and release take no lock (the shm latency path): a pin taken
    before a deregister is waited for, and woken on, and one taken while the
    deregister waits already sees the region's flags cleared."""
    from kvx.memory import VALID

    table = RegionTable(16)
    r = table.add(np.zeros(100, np.uint8), remote_access=True)
    token, _, _, flags, _ = table.pin_table()
    assert flags[r.id] & VALID
    removed = threading.Event()
    remover = threading.Thread(target=lambda: (table.remove(r, timeout_s=20), removed.set()), daemon=True)
    remover.start()
    deadline = time.monotonic() + 10
    while not table._waiters:  # the deregister waits for the pin now
        assert time.monotonic() < deadline
        time.sleep(0.001)
    later, _, _, flags, _ = table.pin_table()
    assert not flags[r.id], "a pin taken during the deregister saw the region as valid"
    table.release(later)  # not one the deregister waits for
    assert not removed.wait(0.2), "the deregister did not wait for the pin taken before it"
    started = time.monotonic()
    table.release(token)
    assert removed.wait(10), "the release did not wake the deregister"
    assert time.monotonic() - started < 5
    remover.join(10)


def test_a_release_racing_a_deregister_wakes_it():
    """release() pops its pin, then looks for a waiting deregister: a pop that
    lands just as the deregister goes to sleep still wakes it (looking first,
    then popping, would leave it asleep until its timeout)."""
    table = RegionTable(16)
    r = table.add(np.zeros(100, np.uint8), remote_access=True)
    token, *_ = table.pin_table()

    class PopOnceAsleep(dict):
        def pop(self, *args):
            while not table._waiters:
                time.sleep(0.001)
            with table._lock:  # free only once the deregister sleeps in its wait
                pass
            return super().pop(*args)

    table._active = PopOnceAsleep(table._active)
    releaser = threading.Thread(target=table.release, args=(token,), daemon=True)
    releaser.start()
    started = time.monotonic()
    table.remove(r, timeout_s=20)
    assert time.monotonic() - started < 10, "the deregister slept through the release"
    releaser.join(10)


def test_region_limit():
    table = RegionTable(2)
    table.add(bytearray(1), remote_access=True)
    table.add(bytearray(1), remote_access=True)
    with pytest.raises(kvx.RegionError, match="max_regions"):
        table.add(bytearray(1), remote_access=True)


def test_insecure_listen_needs_a_secret_or_explicit_consent():
    with pytest.raises(kvx.ConfigError, match="auth_secret"):
        kvx.Agent("open", listen="0.0.0.0:0")
    with kvx.Agent("open", listen="0.0.0.0:0", allow_insecure=True) as agent:
        assert not agent.endpoint.startswith("0.0.0.0")
    with kvx.Agent("locked", listen="0.0.0.0:0", auth_secret="s" * 16):
        pass
    with pytest.raises(kvx.ConfigError):
        kvx.Agent("short", auth_secret="short")
    with pytest.raises(kvx.ConfigError):
        kvx.Agent("bad name!")


def test_a_second_concurrent_deregister_is_refused_not_raced():
    table = RegionTable(16)
    r = table.add(np.zeros(100, np.uint8), remote_access=True)
    _, _, _, token = table.resolve(kvx.Descs.build(r, 0, 10).array, REMOTE_READ, "t")
    first = threading.Thread(target=lambda: pytest.raises(kvx.RegionBusyError, table.remove, r, 0.5))
    first.start()
    time.sleep(0.1)
    with pytest.raises(kvx.RegionBusyError, match="another thread"):
        table.remove(r, timeout_s=5)
    first.join()
    table.release(token)
    table.remove(r, timeout_s=1)


def test_the_one_pass_descriptor_check_agrees_with_its_twin_and_numpy():
    from kvx._datapath import cma_py
    from kvx.descs import DESC_DTYPE
    from kvx.memory import REMOTE_READ, VALID, check_descs

    try:
        from kvx._datapath import _cma
    except ImportError:
        pytest.skip("the C extension is not built (the twin is checked by the numpy path below)")
    rng = np.random.default_rng(7)
    flags = np.array([0, VALID | REMOTE_READ, VALID, VALID | REMOTE_READ], np.uint8)
    sizes = np.array([0, 1 << 20, 1 << 20, 4096], np.uint64)
    for _ in range(300):
        n = int(rng.integers(17, 80))
        descs = np.zeros(n, DESC_DTYPE)
        descs["region"] = rng.choice([1, 3], n)
        descs["offset"] = rng.integers(0, 2048, n)
        descs["length"] = rng.integers(0, 2048, n)
        if rng.random() < 0.7:  # one bad descriptor somewhere
            i = int(rng.integers(0, n))
            kind = int(rng.integers(0, 4))
            if kind == 0:
                descs["region"][i] = int(rng.choice([0, 2, 4, 1 << 20]))
            elif kind == 1:
                descs["offset"][i] = 4097 if descs["region"][i] == 3 else (1 << 20) + 1
            elif kind == 2:
                descs["length"][i] = 1 << 63
            else:
                descs["offset"][i], descs["length"][i] = 4000, 97 if descs["region"][i] == 3 else 0
        need = VALID | REMOTE_READ
        got = _cma.descs_bad(descs, flags, sizes, need)
        assert got == cma_py.descs_bad(descs, flags, sizes, need)
        if got < 0:
            check_descs(descs, flags, sizes, REMOTE_READ, "t")
        else:
            with pytest.raises(kvx.AccessError, match=f"region {int(descs['region'][got])}\\b"):
                check_descs(descs, flags, sizes, REMOTE_READ, "t")
