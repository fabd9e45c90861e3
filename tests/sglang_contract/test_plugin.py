"""kvx's SGLang plugin, inside SGLang 0.5.23 (run from .venv-sglang by scripts/test.sh).

What the plugin leaves behind after SGLang's own ``load_plugins()``: the
``kvx`` choice, a ``TransferBackend.KVX`` member, and a ``get_kv_class`` that
answers for kvx and leaves every other backend as it was.
"""

from __future__ import annotations

import pytest

sglang = pytest.importorskip(
    "sglang", reason="SGLang contract tests run in .venv-sglang (scripts/sglang_env.sh)"
)

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class  # noqa: E402

from kvx.connectors.sglang import plugin  # noqa: E402


def test_the_flag_accepts_kvx_once() -> None:
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvx") == 1
    for builtin in ("mooncake", "nixl", "fake", "mooncake_tcp"):
        assert builtin in DISAGG_TRANSFER_BACKEND_CHOICES
    plugin.register()  # loaded again (another process, or twice): nothing doubles
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvx") == 1


def test_the_enum_has_a_kvx_member_and_keeps_the_others() -> None:
    assert TransferBackend("kvx") is TransferBackend.KVX
    assert TransferBackend.KVX.name == "KVX" and TransferBackend.KVX.value == "kvx"
    assert isinstance(TransferBackend.KVX, TransferBackend)
    assert TransferBackend("mooncake") is TransferBackend.MOONCAKE
    assert [m.value for m in TransferBackend][:5] == ["mooncake", "mori", "nixl", "ascend", "fake"]
    assert plugin.add_enum_member(TransferBackend, "KVX", "kvx") is TransferBackend.KVX


def test_class_lookup_answers_for_kvx_and_passes_the_rest_through() -> None:
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.mooncake import MooncakeKVManager, MooncakeKVSender

    from kvx.connectors.sglang import conn

    kvx = TransferBackend.KVX
    assert get_kv_class(kvx, KVClassType.MANAGER) is conn.KvxKVManager
    assert get_kv_class(kvx, KVClassType.SENDER) is conn.KvxKVSender
    assert get_kv_class(kvx, KVClassType.RECEIVER) is conn.KvxKVReceiver
    assert get_kv_class(kvx, KVClassType.BOOTSTRAP_SERVER) is conn.KvxKVBootstrapServer
    assert get_kv_class(kvx, KVClassType.KVARGS) is KVArgs
    assert get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER) is MooncakeKVManager
    assert get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER) is MooncakeKVSender
    # Modules that imported the function by name see the same lookup.
    import sglang.srt.managers.disagg_service as disagg_service

    assert disagg_service.get_kv_class(kvx, KVClassType.MANAGER) is conn.KvxKVManager
    # kvx's sender never takes the pinned host-index path (it fails on CPU-only engines).
    assert conn.KvxKVSender.supports_host_tensor_indices is False


def test_an_unsupported_sglang_version_gets_a_clear_error(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match=r"supports SGLang 0\.5\.23, not 0\.5\.22"):
        plugin.check_version("0.5.22")
    monkeypatch.setattr(plugin, "_version", lambda: "0.6.0")
    with pytest.raises(RuntimeError, match="not 0.6.0"):
        get_kv_class(TransferBackend.KVX, KVClassType.MANAGER)
    # Other backends are unaffected by kvx's version check.
    assert get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER) is not None


def test_a_failed_transfer_reaches_sglang_with_kvx_reason(monkeypatch) -> None:
    """The engine returns -1 to SGLang's transfer thread, which concludes the room failed
    with a reason of its own; the manager adds what kvx knows of the cause."""
    from sglang.srt.disaggregation.mooncake import MooncakeKVManager

    from kvx.connectors.sglang import conn
    from kvx.connectors.sglang.engine import KvxTransferEngine

    owner = next(c for c in MooncakeKVManager.__mro__ if "conclude_failure" in vars(c))
    concluded: dict[int, str] = {}

    def conclude_failure(self, *, bootstrap_room, failure_reason, targets=None):
        concluded[bootstrap_room] = failure_reason

    monkeypatch.setattr(owner, "conclude_failure", conclude_failure)
    engine = KvxTransferEngine("prefill-contract")
    try:
        manager = object.__new__(conn.KvxKVManager)  # the failure path needs none of SGLang's setup
        manager.engine = engine
        dead, fine = "127.0.0.1:1", "127.0.0.1:2"
        assert engine.batch_transfer_sync(dead, [0x1000], [0x2000], [16]) == -1
        manager.transfer_infos = {7: {dead: object(), fine: object()}, 8: {fine: object()}}
        manager.conclude_failure(bootstrap_room=7, failure_reason="Failed to send kv chunk of 7")
        manager.conclude_failure(bootstrap_room=8, failure_reason="Failed to send kv chunk of 8")
        manager.conclude_failure(bootstrap_room=9, failure_reason="Failed to send kv chunk of 9")
    finally:
        engine.close()
    assert concluded[7].startswith("Failed to send kv chunk of 7: kvx: ")
    assert "not inside registered memory" in concluded[7] or "unreachable" in concluded[7], concluded[7]
    assert concluded[8] == "Failed to send kv chunk of 8"
    assert concluded[9] == "Failed to send kv chunk of 9"


def test_a_room_cleared_during_the_transfer_threads_check_reads_as_failed() -> None:
    """SGLang's transfer thread tests ``room in request_status`` and then reads the status;
    the scheduler thread can pop the room in between. SGLang's own check raised KeyError
    there, which ended the thread that serves every later request."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvx.connectors.sglang import conn

    class PoppedAfterTheTest(dict):
        def __contains__(self, room: object) -> bool:
            found = dict.__contains__(self, room)
            self.pop(room, None)  # the scheduler clears the room right after the test
            return found

    manager = object.__new__(conn.KvxKVManager)  # the check needs none of SGLang's setup
    manager.request_status = PoppedAfterTheTest({7: KVPoll.Success, 8: KVPoll.WaitingForInput})
    assert 7 in manager.request_status
    assert manager.check_status(7) == KVPoll.Failed  # gone: as absent, not a KeyError
    manager.request_status = {8: KVPoll.WaitingForInput}
    assert manager.check_status(8) == KVPoll.WaitingForInput
    owner = next(c for c in conn.MooncakeKVManager.__mro__ if "check_status" in vars(c))
    with pytest.raises(KeyError):  # SGLang's own, which the thread died of
        owner.check_status(manager, 9)
