"""SGLang general plugin: makes ``kvx`` a ``--disaggregation-transfer-backend`` choice.

Installed as a ``sglang.srt.plugins`` entry point, so SGLang runs it in every
process it starts (launcher, scheduler, detokenizer). SGLang has an extension
point only for the flag's choices; the ``TransferBackend`` enum gains a
``KVX`` member through its value maps, and ``get_kv_class`` an AROUND hook
(SGLang's ``HookRegistry``) that answers for ``kvx`` and passes every other
backend through. Nothing else of SGLang changes.
"""

from __future__ import annotations

import enum
import logging

logger = logging.getLogger(__name__)

NAME = "kvx"
# kvx's backend builds on SGLang's shared disaggregation classes, whose
# internals change between releases: only these are known to work.
SUPPORTED_VERSIONS = ("0.5.23",)


def _version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def check_version(version: str | None = None) -> None:
    version = version or _version()
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"the kvx transfer backend supports SGLang {', '.join(SUPPORTED_VERSIONS)}, "
            f"not {version}: install one of those (pip install 'sglang=={SUPPORTED_VERSIONS[-1]}') "
            "or choose another --disaggregation-transfer-backend"
        )


def add_enum_member(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add ``cls.NAME = value`` to an existing Enum (idempotent)."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls  # type: ignore[attr-defined]  # Enum sets it on members; typeshed omits it
    member.__init__(value)  # type: ignore[misc]  # what EnumMeta does for a new member
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    type.__setattr__(cls, name, member)
    return member


def _get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) != NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        from sglang.srt.disaggregation.base import KVArgs

        return KVArgs
    check_version()
    from kvx.connectors.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvxKVManager,
        KVClassType.SENDER: conn.KvxKVSender,
        KVClassType.RECEIVER: conn.KvxKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvxKVBootstrapServer,
    }.get(class_type)


def register() -> None:
    try:
        from sglang.srt.arg_groups.choices import (
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:
        # Another SGLang layout: the choice stays absent, and the reason is logged once per process.
        logger.error(
            "kvx transfer backend not available in SGLang %s (%s); supported: %s",
            _version(),
            exc,
            ", ".join(SUPPORTED_VERSIONS),
        )
        return
    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    add_enum_member(TransferBackend, "KVX", NAME)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
    if _version() not in SUPPORTED_VERSIONS:
        logger.error(
            "kvx transfer backend: SGLang %s is not a supported version (%s); selecting kvx will fail",
            _version(),
            ", ".join(SUPPORTED_VERSIONS),
        )
