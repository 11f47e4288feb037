"""PNG plots of benchmark summaries (matplotlib with the Agg backend: no display needed)."""
from __future__ import annotations


def plot_serve(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in summary["per_request"] if r["ok"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    title = (f"{summary['model']} @ {summary['base_url']}: {summary['output_throughput']:.0f} "
             f"out tok/s, {summary['request_throughput']:.2f} req/s")
    fig.suptitle(title)
    panels = [
        (axes[0][0], [r["ttft"] * 1000 for r in ok], "TTFT (ms)"),
        (axes[0][1], summary.get("itl_all_ms") or [], "inter-token latency (ms)"),
        (axes[1][0], [r["e2e"] * 1000 for r in ok], "end-to-end latency (ms)"),
    ]
    for ax, values, label in panels:
        if values:
            ax.hist(values, bins=40, color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes[1][1]
    if ok:
        t0 = min(r["start"] for r in ok)
        ax.scatter([r["start"] - t0 for r in ok], [r["e2e"] * 1000 for r in ok], s=8)
    ax.set_xlabel("request start (s since first)")
    ax.set_ylabel("end-to-end latency (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
