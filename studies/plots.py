"""The figures only the deployment and llama.cpp studies draw, from their reports' rows: the deployment
study's (studies.deploy_report) increase.png, the exported model's loss increase against tokens per
parameter, and pareto.png, the exported val loss against bits per weight; the llama.cpp study's
(studies.gguf_report) gguf.png, llama.cpp's val loss of each GGUF file against its bits per weight."""
import os

from figures import DPI, FIGSIZE, pyplot

DEPLOY_MARKERS = "osD^vP*Xh<>p"


def deploy_panel(fmt):
    """What a format is deployed as, and the panel of increase.png it is drawn in: its own, or for a
    per-block mix its budget (every mix at one budget is one deployment question, whoever allocated it)."""
    return f"int2/3/4 mix at {fmt.partition('@')[2]} bits" if "@" in fmt else fmt


def plot_deploy(rows, out, longest):
    """The deployment study's two figures from deploy_report.deploy_rows: increase.png, the exported model's
    loss increase (%) against tokens per parameter, one panel per format (the mixes at one budget share
    one), one line per arm (log x, symlog y); pareto.png, at the longest length, exported val loss
    against bits per weight (mean over seeds, ± std as bars; log y, so that int2's PTQ does not
    flatten the rest). An arm has one colour and one marker in every panel of both. Returns the paths
    written."""
    plt = pyplot()
    done = [r for r in rows if r["seeds"]]
    arms = list(dict.fromkeys(r["arm"] for r in done))
    panels = list(dict.fromkeys(deploy_panel(r["format"]) for r in done))
    # tab10's ten distinct colours first (tab20 pairs would put two arms in near shades), Dark2's after
    colour = {a: plt.get_cmap("tab10")(i) if i < 10 else plt.get_cmap("Dark2")((i - 10) % 8)
              for i, a in enumerate(arms)}
    marker = {a: DEPLOY_MARKERS[i % len(DEPLOY_MARKERS)] for i, a in enumerate(arms)}
    lines = {}
    for r in done:
        lines.setdefault((deploy_panel(r["format"]), r["arm"], r["format"]), []).append(r)
    fig, axes = plt.subplots(1, len(panels), figsize=FIGSIZE, dpi=DPI, sharex=True, sharey=True, squeeze=False)
    for (panel, arm, fmt), rs in lines.items():
        rs = sorted(rs, key=lambda r: r["tokens_per_param"])
        label = f"{arm} ({fmt})" if "@" in fmt and " mix " not in arm else arm
        axes[0, panels.index(panel)].errorbar(
            [r["tokens_per_param"] for r in rs], [r["increase_pct"]["mean"] for r in rs],
            yerr=[r["increase_pct"]["std"] or 0 for r in rs], marker=marker[arm], color=colour[arm], ms=4,
            capsize=2, lw=1.2, ls=":" if label != arm else "-", label=label)
    for panel, ax in zip(panels, axes[0]):
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)  # linear within ±1 %, logarithmic past it: int2's +200 % beside +1 %
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xlabel("tokens per parameter", fontsize=8)
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("exported val loss over the bf16 run's (%, symlog)", fontsize=8)
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center right")
    fig.suptitle("deploy: the exported model's loss increase against training length, per format", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    paths = [os.path.join(out, "increase.png"), os.path.join(out, "pareto.png")]
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    labelled = set()
    for r in (r for r in done if r["steps"] == longest and r["bits_per_weight"]["n"]):
        ax.errorbar(r["bits_per_weight"]["mean"], r["exported"]["mean"], yerr=r["exported"]["std"] or 0,
                    marker=marker[r["arm"]], color=colour[r["arm"]], ms=6, capsize=2,
                    label=None if r["arm"] in labelled else r["arm"])
        labelled.add(r["arm"])
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight of the quantized Linears (scales included)")
    ax.set_ylabel("exported val loss (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"deploy at {longest} steps: exported val loss against bits per weight", fontsize=10)
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def plot_gguf(rows, bf16, path):
    """gguf.png from gguf_report.gguf_rows: llama.cpp's val loss of each file (mean over seeds, ± std as
    bars) against the bits per weight of its block Linears; llama-quantize's files with the importance
    matrix as one curve, without it as another, each trained arm kind as points, each point named by its
    type or format; bf16 (the trunks' mean val loss) as a line. Returns path."""
    plt = pyplot()
    done = [r for r in rows if r["seeds"]]
    groups = {}
    for r in done:
        kind = ("llama-quantize with imatrix" if r["imatrix"] else "llama-quantize without imatrix" if r["llama_cpp"]
                else r["arm"].split(" at ")[0])
        groups.setdefault(kind, []).append(r)
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for k, (kind, rs) in enumerate(groups.items()):
        rs = sorted(rs, key=lambda r: r["bits_per_weight"]["mean"])
        x, y = [r["bits_per_weight"]["mean"] for r in rs], [r["val_loss"]["mean"] for r in rs]
        curve = kind.startswith("llama-quantize")
        ax.errorbar(x, y, yerr=[r["val_loss"]["std"] or 0 for r in rs], marker=DEPLOY_MARKERS[k % len(DEPLOY_MARKERS)],
                    color=plt.get_cmap("tab10")(k % 10), ms=5, capsize=2, lw=1.2 if curve else 0,
                    ls="-" if "with imatrix" in kind else "--", label=kind)
        for r, xi, yi in zip(rs, x, y):
            ax.annotate(r["spec"].removesuffix("+imatrix"), (xi, yi), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    if bf16 is not None:
        ax.axhline(bf16, color="k", lw=0.8, ls=":", label="bf16 (train.py)")
    ax.set_xlabel("bits per weight of the block Linears (scales included)")
    ax.set_ylabel("llama.cpp val loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("gguf: llama.cpp's val loss of each file against its size", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
