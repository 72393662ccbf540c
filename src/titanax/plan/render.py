"""plan.png: the cluster as the plan uses it. One panel per mesh axis in use: nodes as boxes,
their GPUs coloured by the GPU's coordinate along that axis, NVLink domains outlined, rails
(the GPUs at the same local rank, one InfiniBand rail each) labelled; under every GPU a bar of
its memory against its HBM. A last panel breaks the per-device memory down."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from titanax.parallel.mesh import device_index_grid
from titanax.parallel.rules import MESH_AXES
from titanax.plan.lora import lora_title

MAX_NODES_DRAWN = 32


def device_coordinates(layout: dict) -> dict[str, np.ndarray]:
    """axis -> [n_devices] coordinate of each device (by device index) along that axis."""
    deg, inner, outer = layout["degrees"], layout["inside_nvlink_domain"], layout["across_domains"]
    grid = device_index_grid(deg, inner, outer)
    coords = {}
    for i, axis in enumerate(MESH_AXES):
        c = np.empty(grid.size, int)
        c[grid.reshape(-1)] = np.indices(grid.shape)[i].reshape(-1)
        coords[axis] = c
    return coords


def _draw_cluster(ax, plan: dict, coords: np.ndarray | None, axis: str, cmap):
    import matplotlib.patches as mpatches

    c = plan["cluster"]
    gpn, nodes = c["gpus_per_node"], min(c["nodes"], MAX_NODES_DRAWN)
    domain = plan["layout"]["nvlink_domain_size"]
    cols_gpu = min(gpn, 4)
    rows_gpu = math.ceil(gpn / cols_gpu)
    node_cols = min(nodes, 8)
    node_w, node_h = cols_gpu + 0.6, rows_gpu * 1.35 + 0.7
    degree = plan["layout"]["degrees"].get(axis, 1)
    frac = plan["per_device_bytes"] / plan["device_memory_bytes"]
    for n in range(nodes):
        x0 = (n % node_cols) * (node_w + 0.4)
        y0 = -(n // node_cols) * (node_h + 0.5)
        ax.add_patch(mpatches.FancyBboxPatch((x0, y0 - node_h), node_w, node_h,
                                             boxstyle="round,pad=0.05", fc="#f4f4f4",
                                             ec="#555", lw=1))
        ax.text(x0 + 0.1, y0 - 0.25, f"node {n}", fontsize=6, va="center")
        for g in range(gpn):
            idx = n * gpn + g
            gx = x0 + 0.3 + (g % cols_gpu)
            gy = y0 - 0.55 - (g // cols_gpu) * 1.35
            value = coords[idx] if coords is not None else 0
            color = cmap(value / max(degree - 1, 1)) if coords is not None else "#9ecae1"
            ax.add_patch(mpatches.Rectangle((gx, gy - 0.8), 0.9, 0.8, fc=color, ec="k", lw=0.4))
            ax.text(gx + 0.45, gy - 0.4, str(value) if coords is not None else str(g),
                    fontsize=5, ha="center", va="center")
            ax.text(gx + 0.45, gy - 0.05, f"r{g}", fontsize=4, ha="center", va="bottom",
                    color="#333")
            # memory bar: filled share of the GPU's HBM, red when over
            ax.add_patch(mpatches.Rectangle((gx, gy - 1.05), 0.9, 0.15, fc="white", ec="#777",
                                            lw=0.3))
            ax.add_patch(mpatches.Rectangle((gx, gy - 1.05), 0.9 * min(frac, 1.0), 0.15,
                                            fc="#2ca25f" if plan["fits"] else "#de2d26", lw=0))
        # NVLink domain outline: domains are whole nodes, or groups of nodes (NVL72)
        if domain > gpn and n % (domain // gpn) == 0:
            members = range(n, min(n + domain // gpn, nodes))
            for row in sorted({m // node_cols for m in members}):  # one outline per row
                cols = [m % node_cols for m in members if m // node_cols == row]
                x_lo, y_top = min(cols) * (node_w + 0.4), -row * (node_h + 0.5)
                width = (max(cols) - min(cols)) * (node_w + 0.4) + node_w
                ax.add_patch(mpatches.Rectangle((x_lo - 0.15, y_top - node_h - 0.15),
                                                width + 0.3, node_h + 0.3, fill=False,
                                                ec="#3182bd", lw=1.2, ls="--"))
    rows = math.ceil(nodes / node_cols)
    ax.set_xlim(-0.5, node_cols * (node_w + 0.4))
    ax.set_ylim(-rows * (node_h + 0.5), 0.3)
    ax.set_aspect("equal")
    ax.axis("off")


def render(plan: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = plan["layout"]
    coords = device_coordinates(layout)
    axes_used = [a for a in MESH_AXES if layout["degrees"][a] > 1] or ["data"]
    c = plan["cluster"]
    n_panels = len(axes_used) + 1
    node_rows = math.ceil(min(c["nodes"], MAX_NODES_DRAWN) / 8)
    panel_h = 0.6 + 1.3 * node_rows * (2 if c["gpus_per_node"] > 4 else 1.3) / 2
    fig, axs = plt.subplots(n_panels, 1, figsize=(11, panel_h * len(axes_used) + 2.4),
                            gridspec_kw={"height_ratios": [panel_h] * len(axes_used) + [1.6]})
    cmap = plt.get_cmap("viridis")
    for ax, axis in zip(axs[:-1], axes_used):
        _draw_cluster(ax, plan, coords[axis], axis, cmap)
        inner = layout["inside_nvlink_domain"][axis]
        outer = layout["across_domains"][axis]
        where = ("inside NVLink domains" if outer == 1 else
                 f"{inner} inside x {outer} across domains (InfiniBand rails)")
        ax.set_title(f"mesh axis '{axis}' = {layout['degrees'][axis]} ({where})"
                     f"{_axis_note(plan, axis)}: GPU colour and number = coordinate; rN = rail "
                     "(local rank); bar = memory", fontsize=8)
    _draw_memory(axs[-1], plan)
    shown = "" if c["nodes"] <= MAX_NODES_DRAWN else f" (first {MAX_NODES_DRAWN} nodes drawn)"
    fig.suptitle(f"{c['description']}{shown}\nlayout {layout['description']}; NVLink domains "
                 f"of {layout['nvlink_domain_size']} (dashed when a domain spans nodes); "
                 f"predicted {plan['predicted_tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU "
                 f"{plan['predicted_mfu']:.1%}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _axis_note(plan: dict, axis: str) -> str:
    """What a panel's coordinate means where the axis name alone does not say it."""
    if axis != "context":
        return ""
    c, s = plan["layout"]["degrees"]["context"], plan["settings"]
    return (f"; each sequence in 2 x {c} chunks, {s['seq_len'] // c} tokens per GPU, K/V by "
            f"{s['context_strategy']}")


def _draw_memory(ax, plan: dict) -> None:
    model = {k: v for k, v in plan["memory_model_bytes"].items() if k != "total"}
    left = 0.0
    # one colour per row (LoRA plans have eight at most: four state rows, activations,
    # transient, accumulation, context K/V)
    colors = ["#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#fdd0a2", "#e377c2", "#bcbd22",
              "#17becf", "#8c564b"]
    for (name, v), color in zip(model.items(), colors):
        ax.barh(1, v / 1e9, left=left, color=color, label=name.replace("_", " "))
        left += v / 1e9
    comp = plan.get("compile") or {}
    if comp.get("ok"):
        m = comp["memory"]
        ax.barh(0, m["arguments"] / 1e9, color="#3182bd", label="compiled: arguments")
        ax.barh(0, (m["total"] - m["arguments"]) / 1e9, left=m["arguments"] / 1e9,
                color="#e6550d", label="compiled: temporaries + outputs")
    hbm = plan["device_memory_bytes"] / 1e9
    ax.axvline(hbm, color="k", lw=1.5)
    ax.axvline(plan["usable_memory_bytes"] / 1e9, color="k", lw=0.8, ls=":")
    ax.text(hbm, 1.45, f" HBM {hbm:.0f} GB", fontsize=7, va="bottom")
    ax.set_yticks([0, 1], ["compiled" if comp.get("ok") else "", "cost model"], fontsize=7)
    ax.set_xlabel("GB per device", fontsize=7)
    verdict = "fits" if plan["fits"] else "does NOT fit"
    ax.set_title(f"{lora_title(plan)}memory per device: {plan['per_device_bytes'] / 1e9:.1f} GB "
                 f"({plan['per_device_bytes_source']}), {verdict}", fontsize=8)
    ax.legend(fontsize=6, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.32))
    ax.tick_params(labelsize=7)
