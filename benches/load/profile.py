"""Where a request's CPU goes: reads `perf script` output (samples with
call stacks) on stdin and prints the CPU time per request of each part of
the proxy, and how much of it the kernel spent on that part's behalf.

    perf script -i perf.data | python3 profile.py SECONDS FREQUENCY REQUESTS_PER_SECOND

A sample belongs to the innermost frame of the proxy's own code (or of the
libraries it is built from) that matches one of PARTS, in that order of
precedence within a frame; kernel frames are skipped when looking, so a
system call counts for the part that made it. Socket reads and writes are
made by tokio's TCP stream, so they count as "runtime and sockets".
"""
import collections
import re
import sys

# (part, frame pattern). A frame is checked against every pattern in turn.
PARTS = [
    # The control, when benches/profile.sh samples nginx instead.
    ("nginx", r"/nginx\)$"),
    ("fingerprint: SHA-256", r"sha2::"),
    ("fingerprint: JSON parse", r"canonical::Document::parse|serde_json::de|serde_json::read|NameSeed|EntrySeed"),
    ("fingerprint: canonical form", r"canonical::write|Document::write_node|utf16_cmp|smallsort"),
    ("fingerprint: memo and rest", r"fingerprint::|quick_cache|foldhash"),
    ("store", r"idemproxy::store::|fjall::|lsm_tree::"),
    ("record encode/decode", r"core::record::|postcard::"),
    ("log line", r"log_format|log_writer|RequestLog|tracing_core|tracing_subscriber"),
    ("metrics", r"idemproxy::observe::metrics|prometheus_client"),
    ("request id", r"request_id"),
    ("upstream client", r"hyper_util::client|hyper::client|idemproxy::forward::client"),
    ("idempotency exchange", r"idemproxy::idempotency::"),
    ("routing and rescue", r"idemproxy::forward::Forward|idemproxy::server|axum"),
    ("hyper server", r"hyper::server|hyper::proto|hyper_util::server|httparse"),
    ("runtime and sockets", r"tokio::|mio::"),
]
COMPILED = [(name, re.compile(pattern)) for name, pattern in PARTS]


def part_of(user_frames):
    for frame in user_frames:
        for name, pattern in COMPILED:
            if pattern.search(frame):
                return name
    return "other"


def main():
    seconds, frequency, rps = (float(a) for a in sys.argv[1:4])
    total = collections.Counter()
    kernel = collections.Counter()
    for sample in sys.stdin.read().split("\n\n"):
        lines = [line.strip() for line in sample.strip().split("\n")]
        if len(lines) < 2:
            continue
        # `ADDRESS SYMBOL (DSO)`: keep the symbol and the DSO.
        frames = [line.split(" ", 1)[1] if " " in line else line for line in lines[1:]]
        in_kernel = "kernel.kallsyms" in frames[0]
        part = part_of([f for f in frames if "kernel.kallsyms" not in f])
        total[part] += 1
        if in_kernel:
            kernel[part] += 1
    # CPU seconds per sample, over the requests served while sampling.
    per_request_us = 1e6 / frequency / (seconds * rps)
    print(f"{'part':<30} {'µs/request':>10} {'of which kernel':>16} {'share':>6}")
    all_samples = sum(total.values())
    for part, n in total.most_common():
        print(f"{part:<30} {n * per_request_us:>10.2f} {kernel[part] * per_request_us:>16.2f} {n / all_samples:>6.1%}")
    print(f"{'total':<30} {all_samples * per_request_us:>10.2f} {sum(kernel.values()) * per_request_us:>16.2f}")


if __name__ == "__main__":
    main()
