"""The printed table, the JSON file and the PNG plot of one benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

from distsync._syncbn.payload import payload_size

LAYER_TARGET, LAYER_GOAL = 1.5, 1.15
MODEL_TARGET, MODEL_GOAL = 1.25, 1.10
MEMORY_TARGET = 1.1
_AXIS_DIM = {"channels": 1, "batch": 0}
_STYLES = (("sync", "o-"), ("floor", "s--"), ("local", "^:"), ("allreduce_x2", "x:"), ("torch_syncbn", "d-."))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def _verdict(value: float, target: float, goal: float | None = None) -> str:
    if goal is not None and value <= goal:
        return "goal met"
    return "target met" if value <= target else "MISSED"


def _short(status: str | None) -> str | None:
    """'n/a: refuses CPU' from 'n/a: refuses CPU: <the error>' (the full text stays in the JSON)."""
    return status and ":".join(status.split(":")[:2])


def _layer_table(layers: dict) -> list[str]:
    torch_syncbn = _short(layers["torch_syncbn"])
    lines = [
        "| shape (N,C,H,W), dtype | distsync us | floor us | local BN us | 2x all_reduce us "
        "| distsync no-comm us "
        f"| nn.SyncBatchNorm | distsync/floor (target <={LAYER_TARGET}, goal {LAYER_GOAL}) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for entry in layers["shapes"]:
        med, ratio = entry["median_s"], entry["ratio_to_floor"]
        peer = (
            torch_syncbn
            if torch_syncbn
            else f"{_us(med['torch_syncbn'])} us ({ratio['torch_syncbn']:.2f}x floor)"
        )
        lines.append(
            f"| {tuple(entry['shape'])}, {entry['dtype']} | {_us(med['sync'])} | {_us(med['floor'])} "
            f"| {_us(med['local'])} "
            f"| {_us(med['allreduce_x2'])} | {_us(med['sync_nocomm'])} "
            f"({entry['nocomm_ratio_to_local']:.2f}x local) | {peer} | **{ratio['sync']:.2f}** "
            f"{_verdict(ratio['sync'], LAYER_TARGET, LAYER_GOAL)} |"
        )
    half = layers["half_memory"]
    sync, local = half["sync_nocomm"], half["local"]
    lines += [
        "",
        f"{half['dtype']} input {tuple(half['shape'])}, float32 parameters, one fwd+bwd: largest single "
        f"allocation {sync['largest_allocation']:.2f}x the {half['dtype']} activation for distsync, "
        f"{local['largest_allocation']:.2f}x for nn.BatchNorm2d (a float32 copy would be 2x); peak bytes "
        f"held {sync['peak']:.2f}x vs {local['peak']:.2f}x.",
    ]
    tiny = layers["overhead"]
    extra = tiny["median_s"]["sync_nocomm"] - tiny["median_s"]["local"]
    lines += [
        "",
        f"Fixed cost per call: at {tuple(tiny['shape'])} distsync without communication takes "
        f"{_us(tiny['median_s']['sync_nocomm'])} us per fwd+bwd vs {_us(tiny['median_s']['local'])} us for "
        f"nn.BatchNorm2d: {_us(extra)} us of Python/small-op overhead per layer per step.",
    ]
    return lines


def _allreduce_row(model: dict, latency: dict) -> str:
    ms = {key: value * 1e3 for key, value in latency.items() if key.endswith("_s")}
    added = 2 * model["collectives"]["bn_layers"]  # the all-reduces the floor adds to the local step
    return (
        f"| one BN all_reduce ({payload_size(latency['channels']) * 8} B): inside the step vs. back to back "
        f"on idle ranks | {model['allreduce_in_step_s'] * 1e3:.2f} ms = (floor - no-bcast local) / {added} "
        f"vs. idle p50 {ms['p50_s']:.2f} / p75 {ms['p75_s']:.2f} / p90 {ms['p90_s']:.2f} ms "
        f"(mean {ms['mean_s']:.2f}) | | sets the floor |"
    )


def _model_table(model: dict, torch_syncbn: str | None, latency: dict) -> list[str]:
    med, ratio, strict = model["median_s"], model["ratio_to_local"], model["ratio_to_local_nobcast"]
    mem, coll = model["memory"], model["collectives"]
    peak = mem["sync"]["peak_bytes"] / mem["local"]["peak_bytes"]
    saved = mem["sync"]["saved_bytes"] / mem["local"]["saved_bytes"]
    low, group, high = model["group_vs_default_quartiles"]
    group_verdict = "helps" if high < 1 else "hurts" if low > 1 else "no measurable difference"
    peer = _short(torch_syncbn) or f"{med['torch_syncbn'] * 1e3:.2f} ms ({ratio['torch_syncbn']:.2f}x local)"
    mib = 2**20
    return [
        "| figure | measured | target | status |",
        "|---|---|---|---|",
        f"| DDP step, local BN (broadcast_buffers=True) | {med['local'] * 1e3:.2f} ms | | |",
        f"| DDP step, local BN (broadcast_buffers=False) | {med['local_nobcast'] * 1e3:.2f} ms | | |",
        f"| DDP step, floor: local BN + 2 all_reduces per BN (hooks), no bcast | {med['floor'] * 1e3:.2f} ms "
        f"({ratio['floor']:.3f}x local) | | the best a synced BN can do here |",
        _allreduce_row(model, latency),
        f"| DDP step, distsync (broadcast_buffers=False) | {med['sync'] * 1e3:.2f} ms "
        f"({model['ratio_to_floor']['sync']:.3f}x the model floor) | | |",
        f"| model ratio distsync / local BN | **{ratio['sync']:.3f}** (vs no-bcast local: "
        f"{strict['sync']:.3f}) | <={MODEL_TARGET}, goal {MODEL_GOAL} "
        f"| {_verdict(ratio['sync'], MODEL_TARGET, MODEL_GOAL)} |",
        f"| peak bytes allocated in one step (profiler), sync / local | {peak:.3f} "
        f"({mem['sync']['peak_bytes'] / mib:.2f} / {mem['local']['peak_bytes'] / mib:.2f} MiB) "
        f"| <={MEMORY_TARGET} | {_verdict(peak, MEMORY_TARGET)} |",
        f"| bytes saved for backward (saved_tensors_hooks), sync / local | {saved:.3f} "
        f"({mem['sync']['saved_bytes'] / mib:.2f} / {mem['local']['saved_bytes'] / mib:.2f} MiB) "
        f"| <={MEMORY_TARGET} | {_verdict(saved, MEMORY_TARGET)} |",
        f"| BN all_reduces per layer per step | {coll['per_layer']:g} ({coll['bn_all_reduces_per_step']} for "
        f"{coll['bn_layers']} layers; {coll['gloo_all_reduces_per_step']} gloo all_reduces incl. DDP) "
        f"| 2 | {'ok' if coll['per_layer'] == 2 else 'MISSED'} |",
        f"| BN payload bytes per all_reduce | {', '.join(map(str, coll['payload_bytes']))} "
        f"(= (2C+15) x 8 bytes in a power-of-two size class, >= 2 KiB; C={32}) | O(C) | ok |",
        f"| BN on a dedicated group: step {med['sync_group'] * 1e3:.2f} ms | {group:.3f}x the default group "
        f"(quartiles {low:.3f}-{high:.3f}) | keep only if < 1 | {group_verdict} |",
        f"| nn.SyncBatchNorm DDP step | {peer} | | |",
    ]


def table(results: dict) -> str:
    """The whole report as Markdown tables (readable in a terminal, pasteable into README)."""
    meta = results["meta"]
    lines = [
        f"distsync benchmark: {meta['world_size']} gloo ranks x 1 thread on {meta['device']}, torch "
        f"{meta['torch']}; medians of {meta['reps']} interleaved repetitions, slowest rank per repetition"
        f"{' (--quick)' if meta['quick'] else ''}; machine load (1-min average) before/after: "
        f"{meta['load_avg_1m'][0]} / {meta['load_avg_1m'][1]}",
        "",
        "Layer: one BN forward+backward; floor = native nn.BatchNorm2d fwd+bwd + 2 all_reduces of the "
        "payload (2C+15 f64, size class)",
        *_layer_table(results["layers"]),
        "",
        "Model: DDP training step, 7 conv-BN-ReLU blocks, C=32, 32x32, batch 16 per rank",
        *_model_table(results["model"], results["layers"]["torch_syncbn"], results["allreduce_latency"]),
        "",
        *_resnet_table(results.get("resnet18")),
    ]
    return "\n".join(lines)


def _resnet_table(resnet: dict | None) -> list[str]:
    title = "ResNet-18 (torchvision): DDP step on FakeData 3x32x32, batch 16 per rank"
    if resnet is None:
        return [f"{title}: skipped, torchvision does not import beside this torch"]
    med, floor, local = resnet["median_s"], resnet["ratio_to_floor"], resnet["ratio_to_local"]
    return [
        title,
        "| figure | measured |",
        "|---|---|",
        f"| local BN (no buffer broadcast) | {med['local_nobcast'] * 1e3:.1f} ms |",
        f"| floor: local BN + 2 all_reduces per BN ({resnet['bn_layers']} BN layers) | "
        f"{med['floor'] * 1e3:.1f} ms ({local['floor']:.3f}x local) |",
        f"| distsync | {med['sync'] * 1e3:.1f} ms: **{floor['sync']:.3f}x the floor**, "
        f"{local['sync']:.3f}x local |",
    ]


def write(results: dict, out: Path) -> list[Path]:
    """Write ``results.json`` and ``syncbn.png`` under ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "results.json", out / "syncbn.png"
    json_path.write_text(json.dumps(results, indent=1))
    _plot(results["layers"]["sweeps"], png_path)
    return [json_path, png_path]


def _plot(sweeps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.2), squeeze=False)
    for ax, (axis, entries) in zip(axes[0], sweeps.items(), strict=True):
        xs = [entry["shape"][_AXIS_DIM[axis]] for entry in entries]
        for name, style in _STYLES:
            if name in entries[0]["median_s"]:
                ax.plot(xs, [entry["median_s"][name] * 1e6 for entry in entries], style, label=name)
        fixed = [d for i, d in enumerate(entries[0]["shape"]) if i != _AXIS_DIM[axis]]
        ax.set(xscale="log", yscale="log", xlabel=axis, ylabel="fwd+bwd time per layer (us)")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"BN layer vs {axis} (other dims {fixed})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
