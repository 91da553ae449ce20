"""Loss-engine benchmark: forward+backward time and peak extra memory, each case in its own process.

usage:
    python benchmarks/loss.py [--sizes 1024 4096 16384 65536] [--anchor-python PATH]
                              [--cap-gb 16] [--json results.jsonl]
    python benchmarks/loss.py --case IMPL --n N [--d 128] [--k 4]      (one case; prints JSON)

Cases (d = 128, temperature 0.1, unnormalised float32 embeddings, one timed call after a
small untimed warm-up):

  two views (N = 2B, rows [view 1; view 2]):
    ours_ntxent      receipt_embed NTXentLoss (tiled engine)
    dense_ntxent     plain autograd: full N x N logits, masked cross entropy
    lightly_ntxent   lightly.loss.NTXentLoss(z[:B], z[B:])
    pml_ntxent       pytorch_metric_learning.losses.NTXentLoss(z, labels)
  multi-positive (P identities x K = 4 captures):
    ours_supcon      receipt_embed SupConLoss
    dense_supcon     plain autograd L_out
    pml_supcon       pytorch_metric_learning.losses.SupConLoss(z, labels)
  matmul             plain Z @ Z^T of the same shape (row blocks of 8192 above N = 16384)
  matmul_tiles       the same product as 1024 x 1024 blocks into one reused buffer: the
                     cache-resident GEMM rate, the practical ceiling of a tiled engine

With --repeat R every case runs R times (each in a fresh process) and the tables show the
median; a case that could not allocate is not repeated.

"Extra memory" is the process's peak RSS during the timed call minus its RSS just before it
(VmHWM reset through /proc/self/clear_refs). Each child runs under an address-space limit
(RLIMIT_AS = its size after imports + the cap), so an anchor that would need more than the cap
fails with "cannot allocate" instead of pushing the machine into the OOM killer. Anchors
(pytorch-metric-learning, lightly) are optional: run them with --anchor-python pointing at an
interpreter that has them (they are not project dependencies).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.1
TWO_VIEW = ["ours_ntxent", "dense_ntxent", "lightly_ntxent", "pml_ntxent"]
MULTI_POSITIVE = ["ours_supcon", "dense_supcon", "pml_supcon"]
ANCHORS = {"lightly_ntxent", "pml_ntxent", "pml_supcon"}


# ----------------------------------------------------------------------------- child side


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _with_module(module, labels):
    fn = lambda z: module(z, labels)  # noqa: E731
    fn.module = module  # so the child can report which engine path ran
    return fn


def _build(impl: str, n: int, k: int, t: float = TEMPERATURE):
    """Return fn(z) -> scalar loss for one implementation."""
    import torch

    if impl in TWO_VIEW:
        b = n // 2
        labels = torch.arange(b).repeat(2)
    else:
        labels = torch.arange(n // k).repeat(k)

    if impl == "ours_ntxent":
        from receipt_embed.losses import NTXentLoss

        return _with_module(NTXentLoss(temperature=t), labels)
    if impl == "ours_supcon":
        from receipt_embed.losses import SupConLoss

        return _with_module(SupConLoss(temperature=t), labels)
    if impl == "dense_ntxent":

        def dense_ntxent(z):
            zn = torch.nn.functional.normalize(z, dim=1)
            s = (zn @ zn.T / t).masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
            return torch.nn.functional.cross_entropy(s, (torch.arange(n) + n // 2) % n)

        return dense_ntxent
    if impl == "dense_supcon":

        def dense_supcon(z):
            zn = torch.nn.functional.normalize(z, dim=1)
            eye = torch.eye(n, dtype=torch.bool)
            s = (zn @ zn.T / t).masked_fill(eye, float("-inf"))
            log_prob = s - torch.logsumexp(s, dim=1, keepdim=True)
            positive = (labels[:, None] == labels[None, :]) & ~eye
            per_anchor = -(log_prob.masked_fill(~positive, 0)).sum(1) / positive.sum(1)
            return per_anchor.mean()

        return dense_supcon
    if impl == "lightly_ntxent":
        from lightly.loss import NTXentLoss

        f = NTXentLoss(temperature=t)
        return lambda z: f(z[: n // 2], z[n // 2 :])
    if impl == "pml_ntxent":
        from pytorch_metric_learning.losses import NTXentLoss

        f = NTXentLoss(temperature=t)
        return lambda z: f(z, labels)
    if impl == "pml_supcon":
        from pytorch_metric_learning.losses import SupConLoss

        f = SupConLoss(temperature=t)
        return lambda z: f(z, labels)
    raise SystemExit(f"unknown case {impl!r}")


def _matmul_case(n: int, d: int) -> dict:
    import torch

    torch.manual_seed(0)
    z = torch.randn(n, d)
    rows = min(n, 8192)
    out = torch.empty(rows, n)
    torch.mm(z[:rows], z.T, out=out)  # warm-up
    start = time.perf_counter()
    for r0 in range(0, n, rows):
        torch.mm(z[r0 : r0 + rows], z.T, out=out[: min(rows, n - r0)])
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 4), "gflops": round(2 * n * n * d / seconds / 1e9, 1)}


def _matmul_tiles_case(n: int, d: int, tile: int = 1024) -> dict:
    """Every (tile x tile) block of Z @ Z^T into one reused buffer: the cache-resident GEMM
    rate a tiled engine could reach at best."""
    import torch

    torch.manual_seed(0)
    z = torch.randn(n, d)
    out = torch.empty(tile, tile)
    torch.mm(z[:tile], z[:tile].T, out=out)  # warm-up
    start = time.perf_counter()
    for r0 in range(0, n, tile):
        for c0 in range(0, n, tile):
            torch.mm(z[r0 : r0 + tile], z[c0 : c0 + tile].T, out=out)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 4), "gflops": round(2 * n * n * d / seconds / 1e9, 1)}


def run_case(impl: str, n: int, d: int, k: int, cap_gb: float, temperature: float = TEMPERATURE) -> dict:
    import warnings

    import torch

    warnings.simplefilter("ignore", UserWarning)  # the low-temperature warning, if asked for

    sys.path.insert(0, str(REPO))
    result = {
        "impl": impl,
        "n": n,
        "d": d,
        "k": k if impl in MULTI_POSITIVE else 2,
        "temperature": temperature,
        "threads": torch.get_num_threads(),
    }
    if impl in ("matmul", "matmul_tiles"):
        result.update((_matmul_case if impl == "matmul" else _matmul_tiles_case)(n, d), status="ok")
        return result
    try:
        warm = _build(impl, 256, k, temperature)
        z = torch.randn(256, d, requires_grad=True)
        warm(z).backward()
        fn = _build(impl, n, k, temperature)
    except ImportError as exc:
        result.update(status="not installed", error=str(exc))
        return result
    # Address-space cap: allocations beyond it fail cleanly instead of invoking the OOM killer.
    vm_bytes = _rss_kb("VmSize") * 1024
    limit = vm_bytes + int(cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    torch.manual_seed(0)
    z = torch.randn(n, d, requires_grad=True)
    before_kb = _rss_kb("VmRSS")
    peak_reset = _reset_peak()
    start = time.perf_counter()
    try:
        loss = fn(z)
        loss.backward()
    except (RuntimeError, MemoryError) as exc:
        text = str(exc)
        if isinstance(exc, MemoryError) or "alloc" in text.lower() or "memory" in text.lower():
            result.update(
                status="cannot allocate",
                cap_gb=cap_gb,
                seconds_until_failure=round(time.perf_counter() - start, 2),
                error=text[:200],
            )
            return result
        raise
    seconds = time.perf_counter() - start
    peak_kb = _rss_kb("VmHWM") if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result.update(
        status="ok",
        loss=round(float(loss.detach()), 6),
        seconds=round(seconds, 3),
        extra_mb=round((peak_kb - before_kb) / 1024, 1),
        peak_rss_mb=round(peak_kb / 1024, 1),
        grad_finite=bool(torch.isfinite(z.grad).all()),
    )
    if impl.startswith("ours"):
        result["engine"] = fn.module.last_stats.get("path")
        result["engine_gflops"] = round(4 * n * n * d / seconds / 1e9, 1)
    return result


# ----------------------------------------------------------------------------- parent side


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _busy_fraction(seconds: float = 1.0) -> float:
    """Share of CPU time used machine-wide over ``seconds`` (from /proc/stat)."""

    def snapshot():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = snapshot()
    time.sleep(seconds)
    total1, idle1 = snapshot()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Background load distorts timings on 2 cores: wait (up to max_wait s) until 3 s in a row are nearly idle, so a
    timing is not an artefact of someone else's job. Returns the last busy share seen."""
    deadline = time.monotonic() + max_wait
    quiet = 0
    busy = _busy_fraction()
    while time.monotonic() < deadline:
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= 3:
            break
        busy = _busy_fraction()
    return busy


def spawn(impl: str, n: int, args) -> dict:
    busy = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else float("nan")
    python = args.anchor_python if impl in ANCHORS else sys.executable
    cap = min(args.cap_gb, max(1.0, _mem_available_gb() - 3.0))
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--case",
        impl,
        "--n",
        str(n),
        "--d",
        str(args.d),
        "--k",
        str(args.k),
        "--cap-gb",
        f"{cap:.1f}",
        "--temperature",
        str(args.temperature),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "n": n, "status": f"timeout > {args.timeout}s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        died = "killed (out of memory?)" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"impl": impl, "n": n, "status": died, "error": proc.stderr[-300:]}
    result = json.loads(lines[-1])
    result["load_before"] = round(load, 2)
    result["cpu_busy_before"] = round(busy, 2)
    return result


def median_of(runs: list[dict]) -> dict:
    """One row per case: the median run by time (its memory alongside), plus the spread."""
    ok = sorted((r for r in runs if r.get("status") == "ok"), key=lambda r: r["seconds"])
    if not ok:
        return runs[-1]
    mid = dict(ok[len(ok) // 2])
    mid["runs"] = len(ok)
    mid["seconds_range"] = [ok[0]["seconds"], ok[-1]["seconds"]]
    if "extra_mb" in mid:
        mid["extra_mb"] = sorted(r["extra_mb"] for r in ok)[len(ok) // 2]
    return mid


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return r.get("status", "?") + (f" (cap {r['cap_gb']} GB)" if "cap_gb" in r else "")
    return f"{r['seconds']:.2f} s{_range(r)} / {r['extra_mb']:.0f} MB"


def _range(r: dict | None) -> str:
    if not r or r.get("status") != "ok" or r.get("runs", 1) < 2:
        return ""
    lo, hi = r["seconds_range"]
    return f" ({lo:.2f}-{hi:.2f})"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok" or not b[key]:
        return "-"
    return f"{a[key] / b[key]:.3f}"


def report(results: list[dict], sizes: list[int]) -> str:
    by = {(r["impl"], r["n"]): r for r in results}
    lines = []
    for title, impls, anchor in (
        ("Two views (NT-Xent), d=128", TWO_VIEW, "lightly_ntxent"),
        ("Multi-positive (SupCon, K=4), d=128", MULTI_POSITIVE, "pml_supcon"),
    ):
        lines.append(f"**{title}**: time (forward+backward) / peak extra memory\n")
        lines.append("| N | " + " | ".join(impls) + f" | time ratio ours/{anchor} | memory ratio |")
        lines.append("|---" * (len(impls) + 3) + "|")
        for n in sizes:
            ours = by.get((impls[0], n))
            cells = [_cell(by.get((impl, n))) for impl in impls]
            lines.append(
                f"| {n} | "
                + " | ".join(cells)
                + f" | {_ratio(ours, by.get((anchor, n)), 'seconds')} | {_ratio(ours, by.get((anchor, n)), 'extra_mb')} |"
            )
        lines.append("")
    lines.append(
        "**Throughput**: engine GFLOP/s counts 4·N²·d flops (half the similarity matrix forward, "
        "recomputed in backward, two gradient matmuls); matmul = Z @ Z^T of the same shape, "
        "matmul tiles = the same product as cache-resident 1024² blocks\n"
    )
    lines.append(
        "| N | ntxent GFLOP/s | supcon GFLOP/s | matmul GFLOP/s | matmul tiles GFLOP/s | ntxent / matmul | ntxent / matmul tiles |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    ok = lambda r: r is not None and r.get("status") == "ok"  # noqa: E731
    for n in sizes:
        a, s, m, mt = (by.get((name, n)) for name in ("ours_ntxent", "ours_supcon", "matmul", "matmul_tiles"))
        g = lambda r, key: f"{r[key]:.0f}" if ok(r) and key in r else "-"  # noqa: E731
        frac = lambda r, a=a: f"{a['engine_gflops'] / r['gflops']:.2f}" if ok(a) and ok(r) else "-"  # noqa: E731
        lines.append(
            f"| {n} | {g(a, 'engine_gflops')} | {g(s, 'engine_gflops')} | {g(m, 'gflops')} | {g(mt, 'gflops')} | {frac(m)} | {frac(mt)} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case")
    parser.add_argument("--n", type=int)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="captures per identity for the multi-positive cases")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="for every case (default 0.1)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--only", nargs="+", help="run only these cases")
    parser.add_argument(
        "--anchor-python", default=sys.executable, help="interpreter with lightly / pytorch-metric-learning"
    )
    parser.add_argument(
        "--cap-gb", type=float, default=16.0, help="address-space cap per case above its size after imports"
    )
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per case (fresh process each); tables show the median"
    )
    parser.add_argument(
        "--wait-quiet", type=float, default=120.0, help="seconds to wait for idle CPUs before each case (0: don't)"
    )
    parser.add_argument("--json", help="append every result as a JSON line to this file")
    args = parser.parse_args(argv)

    if args.case:
        print(json.dumps(run_case(args.case, args.n, args.d, args.k, args.cap_gb, args.temperature)), flush=True)
        return
    cases = args.only or TWO_VIEW + MULTI_POSITIVE + ["matmul", "matmul_tiles"]
    results = []
    for n in args.sizes:
        for impl in cases:
            runs = []
            for _ in range(args.repeat):
                r = spawn(impl, n, args)
                runs.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
                if r.get("status") != "ok":
                    break
            results.append(median_of(runs))
    print(report(results, args.sizes))


if __name__ == "__main__":
    main()
