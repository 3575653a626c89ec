"""Write a suite's results: dated JSON + latest.json, a markdown table, and PNG plots; and
its progress lines."""

from __future__ import annotations

import json
import time
from pathlib import Path


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_results(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = results["gpu"].replace(" ", "-").lower()
    day = results["date"].split()[0]
    text = json.dumps(results, indent=2)
    paths = [out_dir / f"{day}-{gpu}.json", out_dir / "latest.json", out_dir / "latest.md"]
    paths[0].write_text(text)
    paths[1].write_text(text)
    paths[2].write_text(markdown(results))
    paths += plots(results, out_dir)
    return paths


def slow_rounds(entry: dict, below: float = 0.8) -> list[dict]:
    """The measured rounds of a concurrency entry under `below` × its median tok/s, in the
    order they ran: the median round hides them, and a stall decides a ~100 ms round."""
    return [s for s in entry.get("round_summaries", []) if s["tok_s"] < below * entry["tok_s"]]


def markdown(r: dict) -> str:
    lines = [
        f"# Benchmark suite — {r['gpu']}, {r['date']}",
        "",
        f"Commit `{r['commit']}`, torch {r['torch']}; command: `{r['command']}`",
        "",
        f"HBM copy bandwidth: **{r.get('hbm_gbps', 0):.0f} GB/s**",
        "",
        "| layout | weight bytes | floor ms | verify ms (B=1, K=15), bf16-copy reads "
        "| verify / floor | draft ms | verify ms, W4A16 reads (default) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, layout in r.get("layouts", {}).items():
        ratio = layout["verify_ms"] / layout["floor_ms"] if layout.get("floor_ms") else 0
        packed = layout.get("verify_ms_int4_reads")
        lines.append(
            f"| {name} | {layout['weight_bytes'] / 1e9:.2f} GB | {layout['floor_ms']:.2f} | "
            f"{layout['verify_ms']:.2f} | {ratio:.1f}× | {layout['draft_ms']:.2f} | "
            f"{'–' if packed is None else f'{packed:.2f}'} |"
        )
    ar = r.get("ar_tok_s", {})
    lines += [
        "",
        f"Autoregressive decode: ours {ar.get('ours', 0):.1f} tok/s, transformers "
        f"{ar.get('transformers', 0):.1f} tok/s (fla installed: {ar.get('fla_installed')})",
        "",
        "| τ | tok/s | TTFT ms | TPOT ms | overhead | in-process tok/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for tau, e2e in r.get("e2e", {}).items():
        local = r.get("in_process", {}).get(tau, {})
        lines.append(
            f"| {tau} | {e2e['tok_s']} | {e2e['ttft_ms']} | {e2e['tpot_ms']} | "
            f"{e2e['overhead_frac']:.1%} | {local.get('tok_s', '')} |"
        )
    over_grpc = r.get("e2e_grpc", {}).get("6")
    if over_grpc:
        lines += [
            "",
            f"Sessions on {r.get('sessions_on', 'gRPC')} above; τ = 6 with the sessions on gRPC "
            f"streams: {over_grpc['tok_s']} tok/s, TPOT {over_grpc['tpot_ms']} ms, overhead "
            f"{over_grpc['overhead_frac']:.1%}",
        ]
    challenge = r.get("challenge_ms", {})
    if challenge:
        lines += [
            "",
            "AdaptFM workload at τ = 6 (prompt → new tokens, ms): "
            + ", ".join(f"{k}: {v:.0f}" for k, v in challenge.items()),
        ]
    http = r.get("http", {})
    if http:
        lines += [
            "",
            f"HTTP gateway (target-only, streamed): {http['gateway_tok_s']} tok/s vs "
            f"{http['direct_tok_s']} tok/s over gRPC directly; "
            f"{http['http_overhead_ms_per_token']} ms per token added by the HTTP layer",
        ]
    concurrency = r.get("concurrency", {})
    if concurrency:
        lines += [
            "",
            "Throughput at τ = 6: "
            + ", ".join(f"{n} streams {c['tok_s']:.1f} tok/s" for n, c in concurrency.items()),
        ]
        if any("rounds_tok_s" in c for c in concurrency.values()):
            lines.append(
                "(median of measured rounds; each round's tok/s: "
                + "; ".join(
                    f"{n}: {', '.join(f'{t:.0f}' for t in c['rounds_tok_s'])}"
                    for n, c in concurrency.items()
                    if "rounds_tok_s" in c
                )
                + ")"
            )
        for n, c in concurrency.items():
            if "batching" in c:
                lines.append(f"- {n} streams, batching: {json.dumps(c['batching'])}")
            for outline in slow_rounds(c):
                lines.append(f"- {n} streams, a slow round: {json.dumps(outline)}")
    lines += [
        "",
        f"State bytes per sequence: {json.dumps(r.get('state_bytes_per_seq', {}))}",
        "",
        f"Speculative greedy == plain greedy: {json.dumps(r.get('spec_equals_ar'))}",
    ]
    notes = r.get("notes", [])
    if notes:  # merged files say which command measured which section
        lines += ["", "Notes:"] + [f"- {note}" for note in notes]
    errors = r.get("errors", {})
    if errors:
        lines += ["", "Sections that failed:"] + [f"- {k}: {v}" for k, v in errors.items()]
    return "\n".join(lines) + "\n"


def plots(r: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    e2e = r.get("e2e", {})
    if e2e:
        taus = [int(t) for t in e2e]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(taus, [e2e[str(t)]["tok_s"] for t in taus], "o-", label="gRPC services")
        local = r.get("in_process", {})
        if local:
            ax.plot(taus, [local[str(t)]["tok_s"] for t in taus], "s--", label="in-process")
        ax.set_xlabel("acceptance length τ")
        ax.set_ylabel("tokens / s (batch 1)")
        ax.legend()
        ax.grid(alpha=0.3)
        path = out_dir / "tok_s_vs_tau.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)
    breakdown = r.get("step_breakdown_ms", {})
    if breakdown:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(breakdown)
        bottom = 0.0
        for name in names:
            ax.bar(["step at τ=6"], [breakdown[name]], bottom=bottom, label=name)
            bottom += breakdown[name]
        ax.set_ylabel("ms per step")
        ax.legend()
        path = out_dir / "step_breakdown.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        written.append(path)
    return written
