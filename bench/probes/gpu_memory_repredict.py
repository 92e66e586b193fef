"""Re-predict a GPU run's memory rows with today's memory model, on the CPU.

``bench/gpu/check.py`` measured each quarter's Adam training step on a GPU and kept, per row, the
measured peak and the model's prediction of then. This rebuilds the same graphs here (GPT-2 medium
and the Llama-7B-shaped model, from configs, on the CPU), costs them with the run's analytic device
and asks ``partita.cost.memory.device_memory`` again for every row, as the script does: what a
change to the memory model does to its error against those measurements, without a GPU. ``then``:
the model with the single-tensor optimizer step everywhere (as at the run; it also says how far
this CPU's graphs reproduce the run's predictions); ``now``: the model as it is.

Usage: python bench/probes/gpu_memory_repredict.py [bench/results/gpu/gpu_check_h100.json.gz]
"""

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import check  # noqa: E402  (bench/gpu/check.py: its model zoo and its prediction, unchanged)

import partita  # noqa: E402
from partita.cost import memory  # noqa: E402
from partita.cost.analytic import analytic_costs  # noqa: E402
from partita.types.devices import device_from_dict  # noqa: E402


def _ranges_by_label(graph, prefix: str) -> dict[str, tuple[int, int]]:
    """The script's stage ranges on this graph, by their labels (joined as its ``prepare_ranges``
    joins them): node positions may differ from the GPU's graph, the layers they cover do not."""
    ranges: dict[tuple[int, int], str] = {}
    for cuts, keep in check.range_sets(graph, prefix):
        for k, (label, _) in sorted(keep.items()):
            key = (cuts[k], cuts[k + 1])
            ranges[key] = f"{ranges[key]} = {label}" if key in ranges else label
    return {label: key for key, label in ranges.items()}


def _error(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default="bench/results/gpu/gpu_check_h100.json.gz")
    path = Path(parser.parse_args().report)
    data = json.load(gzip.open(path) if path.suffix == ".gz" else path.open())
    torch.set_num_threads(2)
    device = device_from_dict(data["analytic_device"])
    options = SimpleNamespace(**data["options"])
    specs = {s.key: s for s in check.full_settings(options).models}
    rows = data["memory_rows"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["dtype"]), []).append(row)
    table, recorded = [], []
    for (model, dtype), group in groups.items():
        spec = specs[model]
        built = check.build_model(spec, torch.device("cpu"), check.DTYPES[dtype])
        args, kwargs, _ = built.make_batch(max(2, *spec.microbatches), 0)
        graph = partita.capture(built.model, args, kwargs)
        by_label = _ranges_by_label(graph, check.LAYER_PREFIX[spec.family])
        costs = {}
        for row in group:
            mb = row["microbatch_size"]
            if mb not in costs:
                costs[mb] = analytic_costs(graph, device, mb, dtype=check.ANALYTIC_DTYPE[dtype])
            start, stop = by_label[row["stage"]]
            stage = SimpleNamespace(start=start, stop=stop)
            now = check.predicted_memory(costs[mb], stage, row["in_flight"], row["recompute"])
            with mock.patch.object(memory, "steps_foreach", lambda device: False):  # the model of the run
                then = check.predicted_memory(costs[mb], stage, row["in_flight"], row["recompute"])
            measured = row["measured"]["total"]
            table.append((row, then["total"], now["total"], measured, row["measured"]["peak_in"]))
            recorded.append(abs(_error(then["total"], row["predicted_analytic"]["total"])))
        del built, graph, costs
    print(f"{path}: {len(table)} rows, device {device.name}; error % = (predicted - measured) / measured")
    print(
        f"the run's model on this CPU's graphs against the run's own predictions: median "
        f"{statistics.median(recorded):.2f}%, worst {max(recorded):.2f}% apart"
    )
    print("| rows | where the peak was | then: median / worst abs error % | now |")
    print("|---|---|---|---|")
    for label, keep in (
        ("all", lambda peak: True),
        ("backward", lambda peak: peak == "backward"),
        ("adam.step", lambda peak: peak == "adam.step"),
    ):
        chosen = [t for t in table if keep(t[4])]
        if not chosen:
            continue
        then = [abs(_error(t[1], t[3])) for t in chosen]
        now = [abs(_error(t[2], t[3])) for t in chosen]
        print(
            f"| {len(chosen)} | {label} | {statistics.median(then):.1f} / {max(then):.1f} | "
            f"{statistics.median(now):.1f} / {max(now):.1f} |"
        )
    worst = sorted(table, key=lambda t: -abs(_error(t[2], t[3])))[:5]
    print("worst now: model dtype mb stage in-flight recompute | measured MiB | then % | now %")
    for row, then, now, measured, peak in worst:
        print(
            f"  {row['model']} {row['dtype']} {row['microbatch_size']} {row['stage']} {row['in_flight']} "
            f"{row['recompute']} ({peak}) | {measured / 2**20:.0f} | {_error(then, measured):+.1f} | "
            f"{_error(now, measured):+.1f}"
        )


if __name__ == "__main__":
    main()
