"""Draw one generation's trace as an SVG waterfall, from spans an OTLP receiver captured.

    RSB_TRACE_DUMP=docs/trace-crash.json .venv/bin/python -m pytest tests/broker/test_telemetry.py -k killed
    .venv/bin/python scripts/trace_waterfall.py docs/trace-crash.json docs/trace-crash.svg

The JSON is what tests/broker/test_telemetry.py's crash test wrote: the spans of its trace (the create, the queue
wait, the generations of every attempt that lived to export, the upstream calls), the reads linked to it, ``marks``
(moments the test made happen, such as the SIGKILL) and ``lost`` (what an attempt that died held, from its claim
to its SIGKILL: its spans died with it). Each span is a bar under its parent, colored by the process that sent it;
no styling library, no browser: plain SVG text.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any

ROW, LEFT, WIDTH, TEXT, FACTS = 24, 330, 700, 12, 470
COLORS = {"rsb-consumer": "#4e79a7", "rsb-generator": "#f28e2b"}
SHOWN = ("rsb.generation.attempt", "rsb.generation.continued_from_tokens", "gen_ai.usage.output_tokens",
         "error.type", "rsb.read.events", "http.response.status_code")


def _rows(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The spans in tree order (children under their parent, by start), each with its depth."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s["start_ns"]):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return out


def render(dump: dict[str, Any]) -> str:
    rows = _rows(dump["spans"])
    t0 = min(s["start_ns"] for _, s in rows)
    t1 = max(s["end_ns"] for _, s in rows)
    scale = WIDTH / max(1, t1 - t0)
    height = ROW * (len(rows) + len(dump.get("lost", [])) + 3)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + FACTS}" height="{height}" '
           f'font-family="monospace" font-size="{TEXT}">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="8" y="16" font-weight="bold">{html.escape(dump["title"])}</text>']
    for step in range(0, 11):  # a time axis, tenths of the trace
        x = LEFT + WIDTH * step / 10
        out.append(f'<line x1="{x:.1f}" y1="24" x2="{x:.1f}" y2="{height - ROW}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle" fill="#888">'
                   f'{(t1 - t0) * step / 10 / 1e9:.2f}s</text>')
    for i, (depth, s) in enumerate(rows):
        y = 28 + i * ROW
        x = LEFT + (s["start_ns"] - t0) * scale
        w = max(2.0, (s["end_ns"] - s["start_ns"]) * scale)
        color = COLORS.get(s["service"], "#76b7b2")
        failed = s["status"] == 2
        label = f'{s["service"].removeprefix("rsb-")}: {s["name"]}'
        out.append(f'<text x="{8 + 14 * depth}" y="{y + 14}">{html.escape(label[:44])}</text>')
        out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW - 8}" rx="2" fill="{color}" '
                   f'stroke="{"#c00" if failed else color}" stroke-width="{2 if failed else 1}"/>')
        for name, at, _ in s["events"]:
            ex = LEFT + (at - t0) * scale
            out.append(f'<line x1="{ex:.1f}" y1="{y + 1}" x2="{ex:.1f}" y2="{y + ROW - 3}" stroke="black"/>'
                       f'<title>{html.escape(name)}</title>')
        facts = [f'{(s["end_ns"] - s["start_ns"]) / 1e6:.0f} ms']
        facts += [f'{k.rsplit(".", 1)[-1]}={s["attributes"][k]}' for k in SHOWN if k in s["attributes"]]
        if s["links"]:
            facts.append("linked to the create")
        out.append(f'<text x="{LEFT + WIDTH + 8}" y="{y + 14}" fill="#333">{html.escape(", ".join(facts))}</text>')
    for label, start, end in dump.get("lost", []):  # what a process took with it when it died, drawn apart
        y = 28 + len(rows) * ROW
        x, w = LEFT + (start - t0) * scale, max(2.0, (end - start) * scale)
        out.append(f'<text x="22" y="{y + 14}" fill="#c00">{html.escape(label)}</text>')
        out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW - 8}" rx="2" fill="none" '
                   f'stroke="#c00" stroke-dasharray="4 3"/>')
    for label, at in dump.get("marks", []):
        mx = LEFT + (at - t0) * scale
        out.append(f'<line x1="{mx:.1f}" y1="22" x2="{mx:.1f}" y2="{height - ROW}" stroke="#c00" '
                   f'stroke-dasharray="4 3"/><text x="{mx + 4:.1f}" y="{height - ROW - 4}" fill="#c00">'
                   f'{html.escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    source, target = Path(argv[1]), Path(argv[2])
    target.write_text(render(json.loads(source.read_text())))


if __name__ == "__main__":
    main(sys.argv)
