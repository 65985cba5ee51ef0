"""Weight sync into a vLLM-CPU instance: seconds and bytes per sync, by broadcast and by file.

For each model (the built-in tiny one, and a ~100M-parameter Qwen2-shaped one built locally), one
in-process vLLM engine loads ``--syncs`` new versions from a parameter server, each way:

- ``broadcast``: vLLM's weight-transfer API, a broadcast in buckets (gloo here, NCCL on GPU) from the
  server into the engine's workers over their long-lived group, in the chosen wire dtype
  (``TransferWeights``);
- ``file``: the state dict written to a safetensors file (tmpfs) and reloaded (the default path of
  a state dict, and of a Ray-placed server's reference pulls).

It prints the median seconds per sync and the bytes moved per sync. The engine is built with the
rollout settings of a job (``--config`` and ``KEY=VALUE`` overrides; default the built-in job), as
``staleflow train`` builds it: on a GPU job bf16 with CUDA graphs, not the CPU defaults.

``--instances N``: transfers side by side instead. N engines in this process receive from one
parameter server placed as a Ray actor (as a job with ``servers.weight_transfer=broadcast`` places
it): after a first version (each instance's group made), version 2 goes to instance 0 alone (one
instance's transfer) and the next to all N at once, ``--repeats`` times in turn (both under the
same load). It prints each instance's pause (its scheduling held: its own transfer, the version
staged before), the version's total time, the bytes sent to each instance and the model's unique
bytes in the wire dtype, and the two ratios the goals bound (longest / shortest pause, total / one
instance's transfer: both at most 1.5), as medians over the repeats with every repeat's figure.
``cpu_s``: the CPU seconds each version cost (this process, its engines, and the Ray cluster it
started: its daemons and the parameter server's actor); ``least_ratio_on_these_cores``: the version to all's
CPU spread perfectly over this machine's cores, over one instance's time: no schedule of that work
on these cores could reach a smaller total / one instance ratio (on 2 cores, 4 instances that each
spend a core copying a version cannot load it in the time one does). ``receive_cpu_s``: each
instance's CPU seconds in its receive (``one_instance_receive_cpu_s``: alone) (the copies and the layerwise reload in its worker, which
the engines in this process run in the receiving thread), and ``least_ratio_from_receives`` the
same bound from those alone: work that no transport, collective or not, takes off the instances.

``--one-collective`` (with ``--instances N``): the version goes to all N in one collective instead
of N sends side by side (:mod:`staleflow.adapters.rlkit.collective`, what a global broadcast of the
``adaptive`` sync takes); a version to all N first makes the collective's group, so the measured
one is the steady state. ``server_bytes``: what the parameter server sent for the measured version
(the unique bytes once with the collective, N times side by side).

Both ends of one NCCL group cannot share a GPU (NCCL refuses: "Duplicate GPU detected"), and the
bench's engines and its sender would: where the transport would be NCCL it refuses, naming the way
out (``--backend gloo``, or ``staleflow train`` on a job whose instances have GPUs of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the ~100M-parameter shape (98M): Qwen2 layers at hidden 768, 16 layers, GQA 12/2 heads
MODELS = {
    "tiny": {},
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="job config overrides for the engine's rollout settings, e.g. rollout.gpus_per_instance=1")
    parser.add_argument("--config", metavar="YAML", help="job file whose rollout settings the engine uses (default: the built-in job)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "100m"])
    parser.add_argument("--syncs", type=int, default=5, help="versions loaded per model and way (default: 5)")
    parser.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--instances", type=int, metavar="N",
                        help="N instances pulling one version at once (transfers side by side; first model of --models)")
    parser.add_argument("--one-collective", action="store_true",
                        help="with --instances: the version to all N in one collective, not N sends side by side")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --instances: versions to one instance and to all, alternately, this many times each (default: 3)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="broadcast transport (auto: nccl where this process sees a GPU, which the bench refuses)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


class SharedDeviceError(ValueError):
    """Both ends of one NCCL group would be on one GPU."""


def check_transport(backend: str, cuda_available: bool, device_count: int) -> str:
    """The transport the bench broadcasts with; :class:`SharedDeviceError` where it would be NCCL:
    its sender and its engines run in this process, on the one GPU it uses, and NCCL refuses two
    ranks of a group on one device."""
    from staleflow.adapters.rlkit.weight_sender import TransferSettings

    resolved = TransferSettings(backend=backend).resolved_backend(cuda_available)
    if resolved == "nccl":
        raise SharedDeviceError(
            f"the bench would broadcast over NCCL with the sender and its engines on one GPU of this process (of {device_count} "
            "visible), and NCCL refuses two ranks of one group on one device ('Duplicate GPU detected'): run it with "
            "--backend gloo, or measure NCCL in a job whose instances have GPUs of their own (docs/gpu.md)"
        )
    return resolved


def run(args: argparse.Namespace) -> int:
    from staleflow.adapters.vllm.settings import set_vllm_env_defaults
    from staleflow.app.profile import run_engine_settings
    from staleflow.runtime.settings.config import ConfigError

    try:
        engine_kwargs = run_engine_settings(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    try:
        backend = check_transport(args.backend, torch.cuda.is_available(), torch.cuda.device_count())
    except (SharedDeviceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    set_vllm_env_defaults()
    command = "staleflow bench weight-sync " + " ".join(sys.argv[3:])
    if args.instances is not None:
        if args.instances < 1:
            print(f"error: --instances must be >= 1, got {args.instances}", file=sys.stderr)
            return 2
        if args.repeats < 1:
            print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
            return 2
        row = measure_side_by_side(args.models[0], args.instances, args.wire_dtype, args.bucket_mb << 20, engine_kwargs, backend,
                                   args.one_collective, args.repeats)
        print_side_by_side(row, command, args.json)
        return 0
    rows = [measure(name, args.syncs, args.wire_dtype, args.bucket_mb << 20, engine_kwargs) for name in args.models]
    if args.json:
        print(json.dumps({"rows": rows, "command": command}, indent=1))
        return 0
    print("| model | parameters | way | wire bytes per sync | seconds per sync (median) |")
    print("|---|---|---|---|---|")
    for row in rows:
        for way in ("broadcast", "file"):
            print(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M | {way} | {row[way]['bytes'] / 1e6:.1f} MB "
                  f"| {row[way]['seconds']:.3f} s |")
    print(f"\nreproduce: {command}")
    return 0


def measure(name: str, syncs: int, wire_dtype: str, bucket_bytes: int, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Median seconds and bytes per sync of model ``name``, each way, on an engine built with
    ``engine_kwargs`` (vLLM's ``EngineArgs`` of the run's rollout engines)."""
    import torch
    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer, TransferWeights
    from staleflow.adapters.vllm.engine import VLLMEngine
    from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model

    folder = Path(tempfile.gettempdir()) / f"staleflow-bench-model-{name}"
    model = ensure_tiny_model(folder, TinyModelSpec(**MODELS[name]))
    weights = load_file(str(model / "model.safetensors"))
    parameters = sum(t.numel() for t in weights.values())
    server = TransferParameterServer(keep=2, transfer={"wire_dtype": wire_dtype, "bucket_bytes": bucket_bytes})
    engine = VLLMEngine(f"bench-{name}", model, max_model_len=256, engine_kwargs=engine_kwargs)
    try:
        timings: dict[str, list[float]] = {"broadcast": [], "file": []}
        bytes_moved: dict[str, int] = {}
        version = 0
        for way in ("broadcast", "file"):
            for _ in range(syncs):
                version += 1
                server.push(version, {k: v + 1e-3 * torch.randn_like(v) for k, v in weights.items()})
                before = engine.bytes_received
                started = time.perf_counter()
                if way == "broadcast":
                    engine.load_weights(version, TransferWeights(server, version))
                    bytes_moved[way] = engine.bytes_received - before
                else:
                    engine.load_weights(version, server.pull(version)[1])
                    bytes_moved[way] = sum(t.numel() * t.element_size() for t in weights.values())
                timings[way].append(time.perf_counter() - started)
    finally:
        engine.close()
    return {
        "model": name,
        "parameters": parameters,
        **{way: {"seconds": statistics.median(t), "bytes": bytes_moved[way], "all_seconds": t} for way, t in timings.items()},
    }


def measure_side_by_side(name: str, instances: int, wire_dtype: str, bucket_bytes: int, engine_kwargs: dict[str, Any] | None,
                         backend: str, one_collective: bool = False, repeats: int = 1) -> dict[str, Any]:
    """Pauses, bytes, times and CPU seconds of ``instances`` engines of model ``name`` pulling one
    version at once from a Ray-placed parameter server, side by side or in ``one_collective``
    (module docstring), ``repeats`` times: each repeat a version to instance 0 alone, then one to
    all, so both see the same load on the machine; the figures are the repeats' medians."""
    import threading

    from safetensors.torch import load_file
    from staleflow.adapters.ray.parameter_server import RemoteParameterServer
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.adapters.rlkit.staged_version import unique_tensors
    from staleflow.adapters.rlkit.weight_sender import wire_dtype as wire_of
    from staleflow.adapters.vllm.engine import VLLMEngine
    from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    folder = Path(tempfile.gettempdir()) / f"staleflow-bench-model-{name}"
    model = ensure_tiny_model(folder, TinyModelSpec(**MODELS[name]))
    weights = load_file(str(model / "model.safetensors"))
    wire = wire_of(wire_dtype)
    unique = sum(t.numel() * (wire.itemsize if t.is_floating_point() else t.element_size()) for _, t in unique_tensors(weights.items()))
    placement = RayPlacement(num_cpus=2, include_dashboard=False)
    engines: list[Any] = []
    solo: list[tuple[float, float]] = []  # (seconds, CPU seconds) of each repeat
    together: list[tuple[float, float]] = []
    pauses: list[list[float]] = []
    reloads: list[list[float]] = []  # each instance's receive CPU seconds in each version to all
    solo_receives: list[float] = []
    try:
        server = RemoteParameterServer.place(placement, keep=2,
                                             broadcast={"backend": backend, "wire_dtype": wire_dtype, "bucket_bytes": bucket_bytes})
        engines = [VLLMEngine(f"bench-{name}-{i}", model, max_model_len=256, engine_kwargs=engine_kwargs) for i in range(instances)]
        version = 0

        def pull(chosen: list[Any], collective: bool = False) -> tuple[float, float]:
            nonlocal version
            version += 1
            server.push(version, {k: v + 1e-3 * version for k, v in weights.items()})
            reference = server.pull(version)[1]
            if collective:
                reference = reference.in_collective([engine.instance_id for engine in chosen])
            threads = [threading.Thread(target=engine.load_weights, args=(version, reference)) for engine in chosen]
            cpu_before, started = bench_cpu(), time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds, cpu = time.perf_counter() - started, cpu_since(cpu_before)
            if any(engine.version != version for engine in chosen):
                raise RuntimeError(f"version {version} did not load into every instance")
            return seconds, cpu

        pull(engines)  # every instance's group made
        collective = one_collective and instances > 1
        if collective:
            pull(engines, collective)  # the collective's group made
        for _ in range(repeats):
            solo.append(pull(engines[:1]))
            solo_receives.append(engines[0].weight_sync.client.receive_cpu_s[-1])
            before, sent_before = [engine.bytes_received for engine in engines], server.bytes_sent()
            together.append(pull(engines, collective))
            server_bytes = server.bytes_sent() - sent_before
            pauses.append([engine.weight_sync.pauses[-1] for engine in engines])
            reloads.append([engine.weight_sync.client.receive_cpu_s[-1] for engine in engines])
            sent = [engine.bytes_received - b for engine, b in zip(engines, before)]
    finally:
        for engine in engines:
            engine.close()
        placement.close()
    total, one = statistics.median(s for s, _ in together), statistics.median(s for s, _ in solo)
    cores = len(os.sched_getaffinity(0))
    cpu_together = statistics.median(c for _, c in together)
    return {
        "model": name, "instances": instances, "backend": backend, "wire_dtype": wire_dtype,
        "mode": "one-collective" if collective else "side-by-side", "server_bytes": server_bytes, "repeats": repeats,
        "pauses_s": [statistics.median(p[i] for p in pauses) for i in range(instances)],
        "pause_ratio": statistics.median(max(p) / min(p) for p in pauses), "pause_ratios": [max(p) / min(p) for p in pauses],
        "total_s": total, "one_instance_s": one, "total_to_one_instance": total / one,
        "totals_s": [s for s, _ in together], "one_instance_runs_s": [s for s, _ in solo],
        "cpu_s": {"version_to_all": cpu_together, "one_instance": statistics.median(c for _, c in solo)}, "cores": cores,
        "least_ratio_on_these_cores": cpu_together / cores / one,
        "receive_cpu_s": [statistics.median(r[i] for r in reloads) for i in range(instances)],
        "one_instance_receive_cpu_s": statistics.median(solo_receives),
        "least_ratio_from_receives": statistics.median(sum(r) for r in reloads) / cores / one,
        "bytes_sent": sent, "unique_bytes": unique,
    }


def bench_cpu() -> dict[tuple[int, float], float]:
    """CPU seconds used so far by each process of the bench, keyed by pid and start time: this process
    (its engines' workers run in it, or in its children) and every process under it (the Ray cluster it
    started: the daemons and the workers, the parameter server's actor among them)."""
    import psutil

    me = psutil.Process()
    used: dict[tuple[int, float], float] = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            used[(process.pid, process.create_time())] = times.user + times.system + times.children_user + times.children_system
        except psutil.Error:  # ended meanwhile
            continue
    return used


def cpu_since(before: dict[tuple[int, float], float]) -> float:
    """The CPU seconds the bench's processes used since ``before`` (:func:`bench_cpu`): each process
    still running its own increase, a new one all it used; one that ended in between counts where its
    parent reaped it (so never a negative figure, as a plain difference of totals could give)."""
    return sum(cpu - before.get(key, 0.0) for key, cpu in bench_cpu().items())


def print_side_by_side(row: dict[str, Any], command: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**row, "command": command}, indent=1))
        return
    print(f"model {row['model']}, {row['instances']} instances pulling one version at once, {row['mode']} "
          f"({row['backend']}, {row['wire_dtype']})")
    print("| instance | pause | bytes sent |")
    print("|---|---|---|")
    for i, (pause, sent) in enumerate(zip(row["pauses_s"], row["bytes_sent"])):
        print(f"| {i} | {pause:.3f} s | {sent / 1e6:.2f} MB |")
    print(f"\nunique bytes of the model (wire dtype): {row['unique_bytes'] / 1e6:.2f} MB; "
          f"sent by the parameter server for the version: {row['server_bytes'] / 1e6:.2f} MB")
    print(f"longest / shortest pause: {row['pause_ratio']:.2f} (goal <= 1.5)")
    print(f"version to all: {row['total_s']:.3f} s; one instance alone: {row['one_instance_s']:.3f} s; "
          f"ratio {row['total_to_one_instance']:.2f} (goal <= 1.5); medians of {row['repeats']} repeats")
    print(f"CPU seconds: {row['cpu_s']['version_to_all']:.2f} for the version to all, {row['cpu_s']['one_instance']:.2f} to one; "
          f"on {row['cores']} cores no schedule reaches a ratio below {row['least_ratio_on_these_cores']:.2f}")
    print(f"each instance's receive (copies, layerwise reload): {', '.join(f'{c:.2f}' for c in row['receive_cpu_s'])} CPU s "
          f"({row['one_instance_receive_cpu_s']:.2f} alone); "
          f"from these alone the ratio cannot go below {row['least_ratio_from_receives']:.2f}")
    print(f"\nreproduce: {command}")
