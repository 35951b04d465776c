"""Plot what the watch protocol costs against the number of members, from a
``launch/bench/simulate_watch.py --json`` file: the time until a SIGKILLed member is
known to every other (median and p99), and the heartbeats each member sends
per second, for the watch topology and the full mesh.  The full mesh's load
past its largest simulated size is its formula, ``(N - 1) / heartbeat_s``,
drawn dashed.

    python launch/bench/simulate_watch.py --sizes 64 256 1000 3000 10000 --mesh-sizes 16 64 256 \\
        --jitter 0 0.05 --trials 3 --json docs/data/watch-sim-sizes.json
    python launch/bench/plot_watch.py docs/data/watch-sim-sizes.json docs/watch-scale.png

matplotlib is not a dependency of commslayer: install it where you run this
(``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a simulate_watch.py --json file")
    p.add_argument("png")
    args = p.parse_args()
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_watch.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.data) as f:
        data = json.load(f)
    rows: List[Dict[str, Any]] = data["rows"]
    heartbeat_s = data["args"]["heartbeat"]
    k = data["args"]["k"]
    fig, (detect, load) = plt.subplots(1, 2, figsize=(11, 4.2))
    for full_mesh, name, color in ((False, f"watch topology, k = {k}", "tab:blue"), (True, "full mesh", "tab:red")):
        for jitter, style in ((0.0, ":"), (50.0, "-")):
            chosen = sorted((r for r in rows if r["full_mesh"] == full_mesh and r["jitter_ms"] == jitter),
                            key=lambda r: r["size"])
            if not chosen:
                continue
            sizes = [r["size"] for r in chosen]
            detect.plot(sizes, [r["kill_median_s"] * 1000 for r in chosen], style, marker="o", color=color,
                        label=f"{name}, jitter {jitter:g} ms: median")
            detect.plot(sizes, [r["kill_p99_s"] * 1000 for r in chosen], style, marker="^", color=color, alpha=0.5,
                        label=f"{name}, jitter {jitter:g} ms: p99")
        chosen = sorted((r for r in rows if r["full_mesh"] == full_mesh and r["jitter_ms"] == 50.0),
                        key=lambda r: r["size"])
        load.plot([r["size"] for r in chosen], [r["beats_median"] for r in chosen], "-", marker="o", color=color,
                  label=f"{name} (simulated)")
    sizes = sorted({r["size"] for r in rows})
    top = max(sizes)
    largest_mesh = max((r["size"] for r in rows if r["full_mesh"]), default=2)
    load.plot([largest_mesh, top], [(largest_mesh - 1) / heartbeat_s, (top - 1) / heartbeat_s], "--", color="tab:red",
              label="full mesh, (N − 1) / heartbeat")
    detect.set(xscale="log", xlabel="members (N)", ylabel="SIGKILL → declared by a member (ms)",
               title="Time until a killed member is known")
    detect.axhline(500, color="grey", lw=0.8)
    detect.text(sizes[0], 470, "target at 10,000 members: median ≤ 500 ms", fontsize=8, color="grey")
    load.set(xscale="log", yscale="log", xlabel="members (N)", ylabel="heartbeats sent per member per second",
             title=f"Load per member (heartbeat every {heartbeat_s:g} s)")
    detect.legend(fontsize=7)
    load.legend(fontsize=7)
    for ax in (detect, load):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("The watch protocol on the simulator (launch/bench/simulate_watch.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
