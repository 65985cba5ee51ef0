"""Trainer part of the GPU smoke check (issue 9, item 8): run by ``scripts/gpu-smoke.sh``.

Builds a ~100M-parameter Qwen2-shaped model locally (no network: hidden 512, 8 layers, 8 heads / 2
KV heads, FFN 1408, Qwen2.5's 151,936-token vocabulary, tied embeddings = 100.4M parameters), trains
it for ``--steps`` steps on synthetic GRPO batches shaped like real ones (16 groups x 8 responses,
prompts 64-256 tokens, long-tailed responses up to ``--max-response`` tokens) with the FSDP trainer
(or the torch trainer), then checkpoints, exports a bf16 Hugging Face folder and checks that
transformers reloads it with the trainer's log-probs. With Megatron it also checks that the weights
the ranks published (each pipeline stage's buckets, converted on the ranks) are exactly the
checkpoint's full model converted in the driver. Prints one JSON line of figures: trained
tokens/s, MFU (model FLOPs, ``6 x parameters`` per token, over the GPU's dense bf16 peak), step and
weight-gather seconds, peak GPU memory per rank, export seconds, log-prob gap.

On a CPU (``--size tiny --device cpu``) the same script runs the tiny model as a self-check, with a
batch to match (:data:`BATCHES`: 2 groups x 2 responses of up to 16 tokens, not 16 x 8 of up to 1,024).
``--dry-run`` imports what the chosen backend runs (the trainer, the export, megatron-core), says
which attention kernel its model would run on ``--device`` and stops: the import path of a machine
without vLLM and Ray. Neither may be imported on this path, nor pydantic or scipy (the check machine
has only torch, transformers, safetensors and what they need).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpu_smoke_verdict import FIGURES, figure_problems


def build_model(folder: Path, size: str) -> Path:
    import torch
    from staleflow.app.tiny_model import build_tokenizer, ensure_tiny_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if size == "tiny":
        return ensure_tiny_model(folder)
    if (folder / "config.json").is_file():
        return folder
    config = Qwen2Config(vocab_size=151_936, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="100MB")  # sharded, as real checkpoints are
    build_tokenizer().save_pretrained(folder)
    return folder


#: what the trainer-only path must not need: the GPU check machine has neither
ROLLOUT_PACKAGES = ("ray", "vllm")
#: the synthetic batch of each model size (``--groups``, ``--group-size``, ``--max-response`` by
#: default): a GRPO batch shaped like a real one for the 100M model on a GPU; a small one for the tiny
#: model's CPU self-check, which must end well inside a backend's 110 s limit on a 2-core machine
BATCHES = {"100m": {"groups": 16, "group_size": 8, "max_response": 1024}, "tiny": {"groups": 2, "group_size": 2, "max_response": 16}}


def peak_flops(gpu_name: str | None, override_tflops: float | None) -> tuple[float | None, str]:
    """The dense bf16 peak FLOP/s for MFU (``--peak-tflops``, else by the GPU's exact name; None: not
    known) and what it was taken from, or why there is none."""
    from staleflow.runtime.settings.devices import DEVICES, device_for_gpu_name

    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if gpu_name is None:
        return None, "no GPU: MFU is for GPUs"
    device = device_for_gpu_name(gpu_name)
    if device is None:
        return None, f"no peak FLOP/s known for {gpu_name!r}: give --peak-tflops"
    return DEVICES[device].flops, device


def import_backend(backend: str) -> None:
    """Import what ``backend``'s run needs, the MFU's figures included (a run that trained and
    exported then failed on their import, issue 46); raise if that pulled in vLLM or Ray."""
    import staleflow.adapters.rlkit.causal_lm  # noqa: F401
    import staleflow.app.export  # noqa: F401

    peak_flops(None, None)

    if backend == "fsdp":
        import staleflow.adapters.fsdp.trainer  # noqa: F401
    elif backend == "megatron":
        import megatron.core  # noqa: F401
        import staleflow.adapters.megatron.trainer  # noqa: F401
    else:
        import staleflow.adapters.torch.trainer  # noqa: F401
    pulled = [name for name in ROLLOUT_PACKAGES if name in sys.modules]
    if pulled:
        raise RuntimeError(f"the trainer-only path imported {', '.join(pulled)}: the GPU check machine has neither")


def planned_attention(backend: str, device: str) -> str:
    """The attention kernel ``backend``'s model runs on ``device``, in the dtype it trains in there."""
    if backend == "megatron":
        return "megatron-core's own"
    import torch
    from staleflow.adapters.rlkit.causal_lm import choose_attention_kernel

    return choose_attention_kernel(device == "cuda", torch.bfloat16 if device == "cuda" else torch.float32, flex=True)


def packed_logprobs(model: Any, device: str, kernel: str) -> Any:
    """``model``'s log-probs of one packed row of three sequences through attention ``kernel``, on
    ``device``, in float32 (flash-attention, which has none, in bfloat16)."""
    import torch
    from staleflow.adapters.rlkit.packing import LogProbModel, PackedSequence, micro_batches

    generator = torch.Generator().manual_seed(0)
    sequences = [PackedSequence(tuple(torch.randint(4, 250, (n,), generator=generator).tolist()), n // 2, (0.0,) * (n - n // 2),
                                (0,) * (n - n // 2), 0.0, 0.0) for n in (37, 64, 21)]
    (row,) = micro_batches(sequences, 10**6)
    dtype = torch.bfloat16 if kernel == "flash_attention_2" else torch.float32
    row, model = row.to(torch.device(device)), model.to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(kernel)
    with torch.no_grad():
        return LogProbModel(model)(row.input_ids, row.position_ids, row.targets).float()


def packed_attention_gap(model: Any, device: str, kernel: str) -> float:
    """The largest log-prob gap (nats) between ``kernel`` and sdpa's dense block-diagonal mask on the
    packed row of :func:`packed_logprobs`, ``model`` holding the trained weights: the packed kernel
    the GPU ranks train with against the mask it stands in for. Reported, not judged: no GPU has
    measured its size yet."""
    return float((packed_logprobs(model, device, kernel) - packed_logprobs(model, device, "sdpa")).abs().max())


def synthetic_batch(version: int, rng: random.Random, groups: int, size: int, max_response: int, vocab: int):  # type: ignore[no-untyped-def]
    from staleflow.runtime.types import TrainingBatch, Trajectory

    out = {}
    for g in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(64, 256))]
        trajs = []
        for i in range(size):
            n = max(1, int(math.exp(rng.uniform(0, math.log(max_response)))))  # log-uniform: a long tail
            trajs.append(Trajectory(
                request_id=f"{version}-{g}-{i}", group_id=f"{version}-{g}", prompt_ids=prompt,
                output_ids=[rng.randrange(4, vocab) for _ in range(n)],
                logprobs=[-math.log(vocab) + rng.uniform(-0.1, 0.1) for _ in range(n)],
                versions=[version] * n, finish_reason="stop", reward=float(rng.random() < 0.3),
            ))
        out[f"{version}-{g}"] = trajs
    return TrainingBatch(version=version, groups=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/staleflow-gpu-smoke"))
    parser.add_argument("--size", choices=("100m", "tiny"), default="100m")
    parser.add_argument("--backend", choices=("fsdp", "torch", "megatron"), default="fsdp")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="megatron only")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="megatron only")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups", type=int, help="default: by --size (BATCHES)")
    parser.add_argument("--group-size", type=int, help="default: by --size (BATCHES)")
    parser.add_argument("--max-response", type=int, help="default: by --size (BATCHES)")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--logprob-chunk", type=int, default=2048)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: by GPU name)")
    parser.add_argument("--dry-run", action="store_true", help="import the backend's path (no vLLM, no Ray) and stop")
    args = parser.parse_args()
    for name, value in BATCHES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    import_backend(args.backend)
    if args.dry_run:
        print(f"GPU-SMOKE-DRY-RUN {args.backend}: imports ok without {' or '.join(ROLLOUT_PACKAGES)}; "
              f"attention kernel on {args.device}: {planned_attention(args.backend, args.device)}")
        return 0
    import torch
    from staleflow.adapters.rlkit.algorithms import token_logprobs
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm
    from staleflow.adapters.rlkit.packing import PACKED_KERNELS, LogProbModel, batch_sequences, micro_batches
    from staleflow.adapters.rlkit.settings import TrainerSettings
    from staleflow.adapters.torch.trainer import TorchTrainer
    from staleflow.app.export import export

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-smoke: no CUDA device (use --device cpu --size tiny for the CPU self-check)", file=sys.stderr)
        return 2
    if args.backend == "megatron" and args.device != "cuda":
        print("GPU-SMOKE-SKIPPED megatron: trains on CUDA only; its imports are checked, its run needs a GPU")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    run = args.out / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(args.out / "export", ignore_errors=True)
    model_dir = build_model(args.out / f"model-{args.size}", args.size)
    shutil.copytree(model_dir, run / "model-v0")
    vocab = 260  # the byte tokenizer's ids; the model's vocabulary (151,936) is what the log-softmax spans
    settings = TrainerSettings(lr=1e-5, lr_warmup_steps=0, micro_batch_tokens=args.micro_batch_tokens,
                               logprob_chunk=args.logprob_chunk, activation_checkpointing=True)
    began = time.perf_counter()
    if args.backend == "fsdp":
        from staleflow.adapters.fsdp.trainer import FSDPTrainer

        trainer = FSDPTrainer(run / "model-v0", settings=settings, world_size=args.world_size, device=args.device)
    elif args.backend == "megatron":
        from staleflow.adapters.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(run / "model-v0", settings=settings, world_size=args.world_size,
                                  tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel)
    else:
        trainer = TorchTrainer(run / "model-v0", settings=settings, device=args.device)
    startup = time.perf_counter() - began
    rng = random.Random(0)
    steps = []
    try:
        for step in range(args.steps):
            trainer.start_step(synthetic_batch(step, rng, args.groups, args.group_size, args.max_response, vocab))
            result = trainer.wait(timeout=600)
            steps.append(result.metrics)
            m = result.metrics
            print(f"step {step + 1}: {m['packed_tokens']:.0f} tokens in {m['train_s']:.2f} s "
                  f"({m['packed_tokens'] / m['train_s']:.0f} tok/s), gather {m.get('gather_s', 0):.2f} s, "
                  f"GPU peak {m.get('gpu_peak_gib', 0):.1f} GiB, loss {m['loss']:.4f}", flush=True)
        folder = run / "checkpoints" / f"step-{args.steps:06d}"
        trainer.save_checkpoint(folder / "trainer")
        (folder / "loop_state.json").write_text("{}")
        trained = trainer.weights()
    finally:
        trainer.close()
    t0 = time.perf_counter()
    export(run, args.out / "export", dtype="bf16", max_shard_bytes=100 * 1024**2)
    export_s = time.perf_counter() - t0
    seq = [s for g in batch_sequences(synthetic_batch(99, rng, 1, 2, 64, vocab)) for s in g][0]
    (mb,) = micro_batches([seq], 10**6)
    reference = load_causal_lm(run / "model-v0")
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    # the export's values: each weight rounded to bf16 once (FSDP and Megatron publish bf16 on a GPU
    # already, the torch backend fp32), so both sides of the log-prob comparison hold the same weights
    exported_values = {name: tensor.to(torch.bfloat16) for name, tensor in trained.items()}
    missing, unexpected = reference.load_state_dict(exported_values, strict=False)  # a tied lm_head is the embedding, published or not
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"the published weights do not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    matches = published_matches_checkpoint(trained, folder / "trainer", reference.config) if args.backend == "megatron" else None
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(args.out / "export"), dtype=torch.float32)
    with torch.no_grad():
        want = LogProbModel(reference)(mb.input_ids, mb.position_ids, mb.targets)[:-1]
        got = token_logprobs(exported(input_ids=mb.input_ids).logits, mb.input_ids)[0]
    kernel = planned_attention(args.backend, args.device)
    packed_gap = packed_attention_gap(reference, args.device, kernel) if kernel in PACKED_KERNELS else None
    timed = steps[1:] or steps  # the first step includes warm-up (kernels, allocator)
    parameters = sum(p.numel() for p in reference.parameters())
    tokens_per_s = sum(m["packed_tokens"] for m in timed) / sum(m["train_s"] for m in timed)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    peak, peak_from = peak_flops(gpu, args.peak_tflops)
    in_process_peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0  # the torch backend's
    figures = {
        "size": args.size, "backend": args.backend, "world_size": args.world_size, "device": args.device,
        "parameters": parameters, "startup_s": round(startup, 1),
        "steps": len(steps), "train_tokens_per_s": round(tokens_per_s),
        "attention_kernel": kernel, "packed_attention_gap": packed_gap,
        "gpu": gpu, "peak_tflops": round(peak / 1e12) if peak else None, "peak_from": peak_from,
        "mfu": round(6 * parameters * tokens_per_s / peak, 4) if peak else None,
        "step_s_mean": round(sum(m["train_s"] for m in timed) / len(timed), 3),
        "gather_s_mean": round(sum(m.get("gather_s", 0.0) for m in timed) / len(timed), 3),
        "gpu_peak_gib_max": round(max(in_process_peak, *(m.get("gpu_peak_gib", 0.0) for m in steps)), 2),
        "export_s": round(export_s, 1), "export_logprob_gap_bf16": float((got - want).abs().max()),
        "losses": [round(m["loss"], 4) for m in steps],
        "published_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in trained.values()}),
        "published_matches_checkpoint": matches,
    }
    print(FIGURES + json.dumps(figures))
    return 1 if figure_problems(figures, args.steps) else 0


def published_matches_checkpoint(published: Any, checkpoint: Path, hf_config: Any) -> bool:
    """Megatron: whether the weights the ranks published (each stage's buckets, gathered across the
    tensor-parallel ranks and converted one layer at a time on the ranks) are exactly the checkpoint's
    full model (joined and converted in the driver) in the published dtype: same names, same values."""
    import torch
    from staleflow.adapters.megatron.trainer import CHECKPOINT_FILE, megatron_to_hf

    saved = megatron_to_hf(torch.load(checkpoint / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["model"], hf_config)
    same = list(published) == list(saved) and all(torch.equal(published[k], saved[k].to(published[k].dtype)) for k in saved)
    if not same:
        print(f"gpu-smoke: the published weights differ from the checkpoint's: names {sorted(set(published) ^ set(saved))[:5]}, "
              f"values {[k for k in saved if k in published and not torch.equal(published[k], saved[k].to(published[k].dtype))][:5]}",
              file=sys.stderr)
    return same


if __name__ == "__main__":
    sys.exit(main())
