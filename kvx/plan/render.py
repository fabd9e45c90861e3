"""``kvx plan``'s output: a table, JSON, and plots."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from kvx.errors import ConfigError
from kvx.plan.links import LINKS, Curve, rdma_link, tcp_link
from kvx.plan.model import Cluster, Plan, evaluate

_BYTE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def size(n: float) -> str:
    for unit, scale in _BYTE_UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


# Past these a fixed-point figure runs to hundreds of digits (a rate of
# 1e-300 tokens/s is valid input): switch to an exponent.
_SECONDS_FIXED_MAX = 1e6
_PERCENT_FIXED_MAX = 1e4


def secs(t: float) -> str:
    if not math.isfinite(t):
        return "unbounded"
    if t >= _SECONDS_FIXED_MAX:
        return f"{t:.3g} s"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} us"


def pct(x: float, digits: int = 0) -> str:
    if math.isfinite(x) and abs(x) >= _PERCENT_FIXED_MAX:
        return f"{x * 100:.3g}%"
    return f"{x:.{digits}%}"


def table(cluster: Cluster, plan: Plan, link_name: str) -> str:
    c, p = cluster, plan
    tokens = ", ".join(f"{t}" for t, _ in c.prompt[:4]) + (" ..." if len(c.prompt) > 4 else "")
    rows = [
        ("model", f"{c.shape.name}: {size(p.bytes_per_token)} KV per token"),
        ("prompt tokens", tokens + (f" ({len(c.prompt)} lengths)" if len(c.prompt) > 1 else "")),
        (
            "cluster",
            f"{c.prefill_instances} prefill instance(s), TP {c.prefill_tp} PP {c.prefill_pp} -> decode "
            f"TP {c.decode_tp} PP {c.decode_pp}, {c.rate_rps:g} req/s, {c.prefill_tokens_per_s:g} tokens/s each",
        ),
        ("link", f"{link_name}, {c.nics} per prefill instance; curve: {c.curve.source}"),
        ("KV per request", f"{size(p.request_bytes)} on the wire, {size(p.nic_bytes)} per NIC"),
        ("KV per rank", f"prefill {size(p.prefill_rank_bytes)}, decode {size(p.decode_rank_bytes)}"),
        ("prefill", f"{secs(p.prefill_s)} compute, {pct(p.prefill_utilisation)} busy"),
        (
            "prefill wait",
            f"mean {secs(p.prefill_wait_mean_s)}, p50 {secs(p.prefill_wait_p50_s)}, p99 {secs(p.prefill_wait_p99_s)}",
        ),
        ("NIC", f"{pct(p.nic_utilisation, 1)} busy"),
        (
            "transfer",
            f"{secs(p.transfer_service_s)} alone; with waiting mean {secs(p.transfer_mean_s)}, "
            f"p50 {secs(p.transfer_p50_s)}, p99 {secs(p.transfer_p99_s)}",
        ),
        ("TTFT", f"mean {secs(p.ttft_mean_s)}, p50 {secs(p.ttft_p50_s)}, p99 {secs(p.ttft_p99_s)}"),
        ("transfer share", f"{pct(p.transfer_share, 1)} of mean TTFT (target {pct(p.target_share)})"),
        (
            "NICs needed",
            f"{p.nics_needed} per prefill instance" if p.nics_needed else "none reaches the target",
        ),
        (
            "layer by layer",
            f"{secs(p.layer_transfer_s)} transfer vs {secs(p.layer_compute_s)} compute per layer: "
            + (
                "hidden behind prefill"
                if p.overlap_hides
                else f"not hidden, {secs(p.overlap_exposed_s)} exposed"
            ),
        ),
    ]
    if p.approximation:
        rows.append(("note", p.approximation))
    if p.overloaded:
        rows.append(("OVERLOADED", f"{p.overloaded}: queues grow without bound; add instances or NICs"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def to_json(cluster: Cluster, plan: Plan, link_name: str) -> str:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    out = {k: clean(v) for k, v in plan.as_dict().items()}
    out["inputs"] = {
        "model": dataclasses.asdict(cluster.shape),
        "prompt": [list(x) for x in cluster.prompt],
        "rate_rps": cluster.rate_rps,
        "prefill_instances": cluster.prefill_instances,
        "prefill_tokens_per_s": cluster.prefill_tokens_per_s,
        "overhead_s": cluster.overhead_s,
        "link": link_name,
        "curve": cluster.curve.source,
        "block_tokens": cluster.block_tokens,
        "prefill_tp": cluster.prefill_tp,
        "prefill_pp": cluster.prefill_pp,
        "decode_tp": cluster.decode_tp,
        "decode_pp": cluster.decode_pp,
    }
    return json.dumps(out, sort_keys=True)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib: pip install 'kvx[bench]' ({exc})") from None
    return plt


def _save(fig: Any, path: str) -> None:
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path} ({exc})") from None


def plot(cluster: Cluster, directory: str, link_name: str) -> list[str]:
    """Two PNGs in ``directory``: transfer time against prompt length for
    each default link (and the cluster's own curve), and utilisation and
    TTFT against the request rate. Returns their paths."""
    plt = _pyplot()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--plot {directory}: cannot make that directory ({exc}); name a directory"
        ) from None
    if not os.path.isdir(directory):
        raise ConfigError(f"--plot {directory}: not a directory; name a directory for the PNGs")
    c = cluster
    lengths = [1 << k for k in range(8, 18)]  # 256 .. 128k tokens
    curves: list[tuple[str, Curve]] = [(f"{link_name} (this plan)", c.curve)]
    curves += [(name, link.curve()) for name, link in LINKS.items() if name in ("nvlink4", "pcie5")]
    curves += [("rdma 400 Gb/s", rdma_link(400).curve()), ("tcp 100 Gb/s", tcp_link(100).curve())]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves:
        times = [curve.transfer_s(c.request_bytes(n) / c.nics) * 1e3 for n in lengths]
        ax.plot(lengths, times, "o-" if "this plan" in name else ".--", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"transfer time, ms ({c.nics} NIC(s)/links per instance)")
    ax.set_title(f"KV transfer of one request: {c.shape.name}, decode TP {c.decode_tp}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    first = os.path.join(directory, "transfer-vs-prompt.png")
    _save(fig, first)
    plt.close(fig)

    prefill_one = evaluate(dataclasses.replace(c, rate_rps=0.0))
    saturation = c.prefill_instances / max(prefill_one.prefill_s, prefill_one.transfer_service_s)
    rates = [saturation * k / 40 for k in range(1, 40)]
    plans = [evaluate(dataclasses.replace(c, rate_rps=r)) for r in rates]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rates, [p.prefill_utilisation for p in plans], label="prefill instance")
    top.plot(rates, [p.nic_utilisation for p in plans], label=f"NIC ({link_name})")
    top.set_ylabel("utilisation")
    top.set_ylim(0, 1)
    top.legend()
    top.grid(True, alpha=0.3)
    top.set_title(f"{c.shape.name}, {c.prefill_instances} prefill instance(s), {c.nics} NIC(s) each")
    bottom.plot(rates, [p.ttft_p50_s for p in plans], label="TTFT p50")
    bottom.plot(rates, [p.ttft_p99_s for p in plans], label="TTFT p99")
    bottom.plot(rates, [p.transfer_p99_s for p in plans], "--", label="transfer p99")
    bottom.set_yscale("log")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("requests/s (whole cluster)")
    bottom.legend()
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    second = os.path.join(directory, "utilisation-vs-rate.png")
    _save(fig, second)
    plt.close(fig)
    return [first, second]
