"""The generator's Prometheus metrics, served by a tiny HTTP endpoint (``--metrics-port``).

Updated once per generation (never per token): jobs by outcome, tokens generated and tokens generated
for answers that were then aborted, and TTFT/TPOT histograms."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from typing import Any

TTFT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TPOT_BUCKETS_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{self.name}_sum {self.total:g}")
        lines.append(f"{self.name}_count {self.n}")
        return lines


class GeneratorMetrics:
    def __init__(self) -> None:
        self.jobs: dict[str, int] = {}
        self.tokens_generated = 0
        self.tokens_aborted = 0
        self.running = 0
        self.ttft = Histogram("rsb_generator_ttft_ms", "time from claim to first token", TTFT_BUCKETS_MS)
        self.tpot = Histogram("rsb_generator_tpot_ms", "time per output token after the first", TPOT_BUCKETS_MS)

    def finished(self, status: str, usage: dict[str, Any], generated_here: int) -> None:
        """One generation ended. ``generated_here``: tokens this worker computed for it (not earlier attempts)."""
        self.jobs[status] = self.jobs.get(status, 0) + 1
        self.tokens_generated += generated_here
        if status != "done":
            self.tokens_aborted += generated_here
        if usage.get("ttft_ms") is not None:
            self.ttft.observe(float(usage["ttft_ms"]))
        if usage.get("tpot_ms") is not None:
            self.tpot.observe(float(usage["tpot_ms"]))

    def render(self) -> str:
        lines = ["# HELP rsb_generator_jobs_total generations this worker ended, by final status",
                 "# TYPE rsb_generator_jobs_total counter"]
        lines += [f'rsb_generator_jobs_total{{status="{s}"}} {n}' for s, n in sorted(self.jobs.items())]
        lines += ["# HELP rsb_generator_tokens_total tokens this worker generated",
                  "# TYPE rsb_generator_tokens_total counter", f"rsb_generator_tokens_total {self.tokens_generated}",
                  "# HELP rsb_generator_tokens_wasted_total tokens generated for answers that were then aborted",
                  "# TYPE rsb_generator_tokens_wasted_total counter",
                  f"rsb_generator_tokens_wasted_total {self.tokens_aborted}",
                  "# HELP rsb_generator_running generations in flight on this worker",
                  "# TYPE rsb_generator_running gauge", f"rsb_generator_running {self.running}"]
        lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"


async def serve_metrics(metrics: GeneratorMetrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics over plain HTTP/1.0; anything else is a 404. Enough for a Prometheus scraper."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: not needed
            parts = request_line.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                body, status = metrics.render().encode(), b"200 OK"
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = b'{"error":{"code":"not_found","message":"try /metrics"}}', b"404 Not Found", \
                    b"application/json"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)
