"""Start-up cost of the command line: `receipt-embed --help`, a subcommand's --help, and
`receipt-embed plugins` (which discovers every plugin), each in a fresh process.

    python benchmarks/cli_startup.py [--repeat 10]

Reports the median and max wall time, peak RSS, and whether torch was imported (it must not
be for --help). Run from the repository root so ./plugins is discovered like a user's folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

CASES = {
    "receipt-embed --help": ["--help"],
    "receipt-embed train --help": ["train", "--help"],
    "receipt-embed plugins": ["plugins"],
}

PROBE = """
import resource, sys, time
from receipt_embed.cli import main
try:
    main(sys.argv[1:], prog_name="receipt-embed")
except SystemExit:
    pass
sys.stderr.write("\\nPROBE " + str(int("torch" in sys.modules)) + " "
                 + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) + "\\n")
"""


def run(args: list[str], repeat: int) -> dict:
    exe = shutil.which("receipt-embed")
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([exe, *args], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    probe = subprocess.run([sys.executable, "-c", PROBE, *args], check=True, capture_output=True, text=True)
    torch_loaded, rss_kb = probe.stderr.strip().splitlines()[-1].split()[1:]
    return {
        "median_s": statistics.median(times),
        "max_s": max(times),
        "peak_rss_mb": int(rss_kb) / 1024,
        "imports_torch": torch_loaded == "1",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {name: run(argv, args.repeat) for name, argv in CASES.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| command | median | max | peak RSS | imports torch |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| `{name}` | {r['median_s'] * 1000:.0f} ms | {r['max_s'] * 1000:.0f} ms | {r['peak_rss_mb']:.0f} MB | "
            f"{'yes' if r['imports_torch'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
