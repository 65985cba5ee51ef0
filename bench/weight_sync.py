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
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def run(args: argparse.Namespace) -> int:
    from staleflow.adapters.vllm.settings import set_vllm_env_defaults
    from staleflow.app.profile import run_engine_settings
    from staleflow.runtime.settings.config import ConfigError

    try:
        engine_kwargs = run_engine_settings(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    set_vllm_env_defaults()
    rows = [measure(name, args.syncs, args.wire_dtype, args.bucket_mb << 20, engine_kwargs) for name in args.models]
    command = "staleflow bench weight-sync " + " ".join(sys.argv[3:])
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
