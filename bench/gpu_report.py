"""The figures of one `make verify-gpu` run, each with the command that produced it.

    .venv/bin/python -m bench.gpu_report --results DIR [--doc docs/gpu.md]

Reads what scripts/verify_gpu.sh left in DIR (commands.tsv: each step's name, seconds,
exit status and command line; the JSON each step wrote) and writes DIR/report.md, and the
same as the section of `--doc` that belongs to this machine's device (one section per
device, replaced when the same device runs it again; the rest of the document is kept).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

BEGIN = "<!-- verify-gpu: {} -->"
END = "<!-- /verify-gpu: {} -->"


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def steps(results: Path) -> list[dict[str, str]]:
    """Each step's latest run (a run of some steps adds to an earlier run's list)."""
    rows: dict[str, dict[str, str]] = {}
    for line in (results / "commands.tsv").read_text().splitlines():
        name, seconds, status, command = line.split("\t", 3)
        rows.pop(name, None)
        rows[name] = {"name": name, "seconds": seconds, "status": status, "command": command}
    return list(rows.values())


def smoke_lines(smoke: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in smoke["versions"].items())
    lines = [f"Python {smoke['python']}; {versions}.", ""]
    for name, check in smoke["checks"].items():
        verdict = "ok" if check["ok"] else "**failed**"
        result = check["result"]
        if isinstance(result, str) and "\n" in result:
            result = result.strip().splitlines()[-1]
        lines.append(f"- {name}: {verdict} — `{result}`")
    return lines


def parity_lines(parity: dict) -> list[str]:
    lines = [
        f"{parity['prompts']} image prompts, {parity['max_tokens']} greedy tokens each, "
        "beside one offline vLLM engine with the workers' settings:",
        "",
        "| mode | prompts equal | first difference (prompt: position, margin offline / mesh) |",
        "|---|---:|---|",
    ]
    for mode, rows in parity["modes"].items():
        equal = sum(row["equal"] for row in rows)
        differences = "; ".join(
            f"{i}: {row['first_difference']}, "
            f"{row.get('margin_offline', float('nan')):.3f} / "
            f"{row.get('margin_mesh', float('nan')):.3f}" + (" (a tie)" if row.get("tie") else "")
            for i, row in enumerate(rows)
            if not row["equal"]
        )
        lines.append(f"| {mode} | {equal}/{len(rows)} | {differences or '—'} |")
    return lines


def serve_lines(serve: dict) -> list[str]:
    lines = [
        f"{serve['requests']} streamed chat requests per level, one image and "
        f"{serve['max_tokens']} tokens each:",
        "",
        "| server | concurrency | req/s | over vllm serve | tokens/s | TTFT p50 ms "
        "| TTFT p99 ms | ITL p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    anchor = {r["concurrency"]: r for r in serve["rows"] if r["server"] == "vllm_serve"}
    for row in serve["rows"]:
        base = anchor.get(row["concurrency"])
        ratio = f"{row['requests_per_s'] / base['requests_per_s']:.2f}" if base else "—"
        lines.append(
            f"| {row['server']} | {row['concurrency']} | {row['requests_per_s']:.2f} | {ratio} | "
            f"{row['output_tokens_per_s']:.1f} | {row['ttft_ms_p50']:.1f} | "
            f"{row['ttft_ms_p99']:.1f} | {row['itl_ms_p50']:.2f} |"
        )
    if serve.get("not_run"):
        lines += ["", "Not run: " + "; ".join(serve["not_run"])]
    return lines


def transfer_lines(transfer: dict) -> list[str]:
    lines = [
        f"Between two processes, {transfer['device']} memory on both sides, medians of "
        f"{transfer['reps']}:",
        "",
        "| MiB | NIXL READ GB/s | READ ms | request to tensor ms | device copy GB/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in transfer["results"]:
        lines.append(
            f"| {r['size_mib']:g} | {r['nixl_read_gbps']:.2f} | {r['nixl_read_ms']:.3f} | "
            f"{r['nixl_ms']:.3f} | {r['memcpy_gbps']:.2f} |"
        )
    return lines


def encoder_lines(encoder: dict) -> list[str]:
    results = encoder["results"]
    return [
        f"{encoder['requests_per_round']} one-image requests ({encoder['image_size']} px), "
        f"{encoder['concurrency']} at a time:",
        "",
        "| encoder | images/s | p50 ms |",
        "|---|---:|---:|",
        *(
            f"| {name} | {r['images_per_s']:.1f} | {r['latency_p50_ms']:.0f} |"
            for name, r in results.items()
        ),
        "",
        f"Batched over unbatched: {encoder['batched_over_unbatched']:.2f}x.",
    ]


def section(results: Path) -> tuple[str, str]:
    """This run's device and its section of the document."""
    smoke = load(results, "smoke.json")
    device = (smoke or {}).get("gpu") or "CPU"
    run = steps(results)
    lines = [
        f"### {device}, {(results / 'when').read_text().strip()}",
        "",
        f"`scripts/verify_gpu.sh` ({'GPU' if device != 'CPU' else 'CPU'} form); results in "
        f"`{results}`. Each step, its command and how long it took:",
        "",
        "| step | command | seconds | exit |",
        "|---|---|---:|---:|",
        *(
            f"| {r['name']} | `{r['command']}` | {float(r['seconds']):.0f} | {r['status']} |"
            for r in run
        ),
    ]
    parts = [
        ("Smoke", "smoke.json", smoke_lines),
        ("Parity", "serve.json", lambda s: parity_lines(s["parity"]) if "parity" in s else []),
        ("Serving", "serve.json", serve_lines),
        ("NIXL", "transfer.json", transfer_lines),
        ("Encoder", "encoder.json", encoder_lines),
    ]
    for title, name, render in parts:
        data = load(results, name)
        body = render(data) if data else ["Not measured: the step did not finish."]
        if body:
            lines += ["", f"**{title}.** " + body[0], *body[1:]]
    return device, "\n".join(lines) + "\n"


def replace_section(document: str, device: str, text: str) -> str:
    begin, end = BEGIN.format(device), END.format(device)
    block = f"{begin}\n{text}{end}\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end) + "\n?", re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: block, document)
    return document.rstrip("\n") + "\n\n" + block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--doc", type=Path, default=Path("docs/gpu.md"))
    args = parser.parse_args()
    device, text = section(args.results)
    (args.results / "report.md").write_text(text)
    document = args.doc.read_text() if args.doc.exists() else "# Prism on GPUs\n"
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(replace_section(document, device, text))
    print(text)


if __name__ == "__main__":
    main()
