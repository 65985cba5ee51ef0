"""AReaL 1.0.4's real ``PPOTrainer`` (SPMD mode) with :class:`~staleflow_protocol.bindings.areal_trainer.ProtocolTrainerHooks`,
on CPU, two data-parallel trainer ranks, run INSIDE AReaL's own venv (tests/test_areal_dropin.py builds
it; ``python -I`` this file).

``python areal_ppo_trainer_run.py OUT [STEPS] [RECOVER_AT] [LAYOUT]`` makes, under OUT, a tiny Qwen2 model
(2 layers, hidden 64) and a word-level tokenizer (``save_pretrained``, no model hub), a tiny prompt
dataset and starts the fake vLLM server below; then two lives of the trainer, each ``RANKS`` processes
with the environment AReaL's SPMD launcher (torchrun) gives its ranks (``RANK``, ``WORLD_SIZE``, one
``MASTER_ADDR`` / ``MASTER_PORT``), ``actor.backend="fsdp:d2"``, each rank with its own protocol
(``batch_size`` = ``consumer_batch_size // 2``) and trace:

- life 0 trains steps ``0..RECOVER_AT`` with ``PPOTrainer.train``, AReaL's ``RecoverHandler`` dumping
  its recover checkpoint after every step (rank 0 writes it, with every rank's dataloader state), and
  both ranks die (``os._exit``) with episodes in flight;
- life 1 is built again: ``PPOTrainer.__init__`` runs ``RecoverHandler.load`` on each rank (the FSDP
  actor's DCP checkpoint, the rank's dataloader state, where ``RecoverableLoader`` carries its
  protocol, and a weight push to the server, by rank 0) and ``on_version_recovered``, then trains to STEPS.

What each rank does is AReaL's: its ``DistributedSampler`` shard of the dataset, its own
``RemotevLLMEngine`` and executor on the one server; rank 0 alone pauses the server and pushes the
weights, every rank sets its engine's version; ``DistRolloutCoordinator`` all-gathers the ranks'
batches and splits them again by sequence length, so a rank trains whole groups of either rank's
batch (all at the step's version) and the FSDP gradients are reduced over both.

Real: ``PPOTrainer`` (its ``__init__``, ``train`` loop, saver / evaluator / stats logger / recover
handler), the ``FSDPPPOActor`` (FSDP2 on two CPU ranks over gloo: the batch redistribution, log-probs,
advantages, PPO update, DCP checkpoints, HF export for the weight update), AReaL's ``RemotevLLMEngine``
client (its HTTP requests, interruptible generation and per-token version stamps), ``WorkflowExecutor``
machinery (dispatcher, async task runner) as :class:`~staleflow_protocol.bindings.areal.ProtocolWorkflowExecutor`,
AReaL's ``RLVRWorkflow`` and the protocol.
Faked: the inference server only (:class:`FakeVLLMServer`: the HTTP endpoints AReaL's vLLM backend calls,
sampling from the tiny model it last loaded from disk, in one thread of the parent process).
Test-only: :class:`RecordingActor` and :class:`RecordingWorkflow` record what was consumed and trained
and which prompt each task had, without changing what AReaL does.

The parent checks, per rank, every consumed sample's bound, each consumed id once, the recover and the
trace (``python -m staleflow_protocol.check``); over both ranks, that each step trained exactly the
union of their consumed batches and that no prompt was trained twice; it prints one JSON line.

LAYOUT ``d1t2`` (default ``d2``): ``actor.backend="fsdp:d1t2"``, tensor parallelism over the two ranks;
rank 0, the data-parallel head, consumes the whole batch, rank 1 never consumes and recovers with its
protocol at version 0 (:func:`check_tensor_parallel` says what is checked).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

ETA, BATCH, RANKS, GROUP, PROMPTS = 1, 4, 2, 2, 64  # groups per step (all ranks), data-parallel ranks, samples per group, dataset size
#: The actor's layout over the RANKS processes (``actor.backend="fsdp:<layout>"``): two data-parallel ranks, or
#: tensor parallelism (one data-parallel group of both ranks: rank 1 is not a data-parallel head and never consumes).
LAYOUTS = ("d2", "d1t2")


def rank_batch(layout: str) -> int:
    """Each data-parallel head's protocol batch: consumer_batch_size // dp, as AReaL's own manager divides it."""
    return BATCH // int(layout[1])

VOCAB = ["<pad>", "<eos>"] + [f"w{i}" for i in range(30)]
REWARDED = [f"w{i}" for i in range(15)]  # the reward: share of completion words among these (groups rarely tie)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- assets (made locally)
def make_assets(root: Path) -> Path:
    """A word-level tokenizer and a random tiny Qwen2 model, both ``save_pretrained`` to ``root/model``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = root / "model"
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, pad_token_id=0, bos_token_id=1,
                         tie_word_embeddings=True, torch_dtype="float32")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def dataset_rows() -> list[dict[str, Any]]:
    return [{"id": i, "question": " ".join(f"w{(i * 7 + k) % 30}" for k in range(3)), "rewarded": REWARDED} for i in range(PROMPTS)]


# ----------------------------------------------------------------------------- the fake inference server
def weights_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class FakeVLLMServer:
    """The HTTP endpoints AReaL 1.0.4's ``RemotevLLMEngine`` calls on its vLLM server
    (``areal.engine.vllm_ext.areal_vllm_server``) with ``weight_update_mode="disk"``: ``GET /health``;
    ``POST /v1/completions`` (``prompt`` as token ids, ``max_tokens``, ``temperature``,
    ``stop_token_ids``; answers ``choices[0].finish_reason`` and ``choices[0].logprobs`` with
    ``tokens`` as ``"token:ID"`` and ``token_logprobs``, as vLLM does with ``return_tokens_as_token_ids``);
    ``/areal_update_weights`` (loads the HF checkpoint the trainer saved); ``/areal_pause_generation``
    and ``/areal_continue_generation`` (a request arriving while paused waits until continued).

    FAKED: this is not vLLM. It samples from the tiny model with plain forward passes (no KV cache,
    no batching) and stamps nothing: AReaL's client stamps each token's version, as with vLLM.
    (The vLLM backend, not SGLang: PPOTrainer._init_rollout builds SGLang's server arguments even in
    SPMD mode, which requires the ``sglang`` package to be installed.)"""

    def __init__(self, model_path: Path) -> None:
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.loads: list[str] = []  # a digest of the weights of each checkpoint loaded
        self.generated = 0
        self.model = self._load(model_path)
        self.initial = weights_digest(self.model)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any], status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer({"ok": True})

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                try:
                    self._answer(server.handle(self.path, payload))
                except Exception as error:  # e.g. a checkpoint path that does not exist: an HTTP error, as vLLM gives
                    self._answer({"error": repr(error)}, status=500)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.address = f"127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @staticmethod
    def _load(path: Path | str) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def handle(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        if endpoint == "/v1/completions":
            self.running.wait()
            return self.generate(payload["prompt"], payload)
        if endpoint == "/areal_update_weights":
            model = self._load(payload["model_path"])
            with self.lock:
                self.model = model
                self.loads.append(weights_digest(model))
            return {"success": True, "message": "loaded"}
        if endpoint == "/areal_pause_generation":
            self.running.clear()
        elif endpoint == "/areal_continue_generation":
            self.running.set()
        return {"success": True}

    def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        stop = set(params.get("stop_token_ids") or [])
        tokens, out = list(input_ids), []
        finish = "length"
        with self.lock, torch.no_grad():
            for _ in range(int(params["max_tokens"])):
                logits = self.model(torch.tensor([tokens])).logits[0, -1] / max(float(params.get("temperature") or 1.0), 1e-3)
                logprobs = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(logprobs.exp(), 1))
                out.append((token, float(logprobs[token])))
                tokens.append(token)
                if token in stop:
                    finish = "stop"
                    break
            self.generated += 1
        return {"choices": [{"finish_reason": finish, "logprobs": {"tokens": [f"token:{t}" for t, _ in out],
                                                                  "token_logprobs": [lp for _, lp in out]}}]}


# ----------------------------------------------------------------------------- one life of the trainer
def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """AReaL's reward-function signature; the dataset row comes as keywords."""
    words = completion.split()
    return sum(w in data["rewarded"] for w in words) / max(1, len(words))


def prompt_ids(text: str, tokenizer: Any, enable_thinking: bool) -> list[int]:
    return list(tokenizer.encode(text))


def extract_prompt(data: dict[str, Any]) -> str:
    return str(data["question"])


def build_config(out: Path, model: Path, steps: int, layout: str) -> Any:
    from areal.api.cli_args import (
        ClusterSpecConfig,
        GenerationHyperparameters,
        InferenceEngineConfig,
        MicroBatchSpec,
        NameResolveConfig,
        OptimizerConfig,
        PPOActorConfig,
        PPOConfig,
        RecoverConfig,
        TrainDatasetConfig,
    )

    names = {"experiment_name": "staleflow", "trial_name": "ppo"}
    fileroot = str(out / "fileroot")
    config = PPOConfig(
        **names, seed=1, total_train_epochs=1, total_train_steps=steps, tokenizer_path=str(model),
        cluster=ClusterSpecConfig(fileroot=fileroot, name_resolve=NameResolveConfig(type="nfs", nfs_record_root=str(out / "name_resolve"))),
        train_dataset=TrainDatasetConfig(path="local", batch_size=BATCH, shuffle=False),  # AReaL gives each rank BATCH // RANKS
        gconfig=GenerationHyperparameters(n_samples=GROUP, max_new_tokens=6, temperature=1.0),
        rollout=InferenceEngineConfig(**names, backend="vllm:d1", consumer_batch_size=BATCH, max_head_offpolicyness=ETA,
                                      max_concurrent_rollouts=2 * BATCH, setup_timeout=60, request_timeout=60, pause_grace_period=0.0),
        actor=PPOActorConfig(**names, backend=f"fsdp:{layout}", path=str(model), dtype="float32", grad_reduce_dtype="float32",
                             attn_impl="sdpa", weight_update_mode="disk", kl_ctl=0.0, ppo_n_minibatches=1,
                             mb_spec=MicroBatchSpec(n_mbs=1), optimizer=OptimizerConfig(lr=1e-3)),
        recover=RecoverConfig(**names, fileroot=fileroot, mode="on", freq_steps=1),
    )
    for part in (config.saver, config.evaluator, config.stats_logger):
        part.experiment_name, part.trial_name, part.fileroot = names["experiment_name"], names["trial_name"], fileroot
    return config


def life_main(out: Path, server: str, steps: int, life: int, rank: int, master_port: int, layout: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(RANKS),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "AREAL_LLM_SERVER_ADDRS": server,
                       "AREAL_SPMD_MODE": "1"})  # what AReaL's SPMD launcher (torchrun) sets for each rank: no single controller
    import torch.distributed as dist
    from areal.engine import FSDPPPOActor
    from areal.infra import workflow_context
    from areal.trainer.rl_trainer import PPOTrainer
    from areal.utils import name_resolve, names
    from areal.workflow.rlvr import RLVRWorkflow
    from datasets import Dataset
    from staleflow_protocol import LockedStalenessManager
    from staleflow_protocol.bindings.areal_trainer import ProtocolTrainerHooks

    prompt_of_task: dict[int, int] = {}
    log = (out / f"trained-{rank}.jsonl").open("a")

    class RecordingWorkflow(RLVRWorkflow):
        """AReaL's RLVRWorkflow; records which prompt each task (the protocol's group id) had."""

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
            prompt_of_task[workflow_context.get().task_id] = int(data["id"])
            return await super().arun_episode(engine, data)

    def sequences(trajectories: list[dict[str, Any]]) -> list[list[int]]:
        return sorted(row[mask.bool()].tolist() for t in trajectories for row, mask in zip(t["input_ids"], t["attention_mask"]))

    class RecordingActor(FSDPPPOActor):
        """AReaL's FSDP PPO actor; logs the rank's consumed batch behind each ``prepare_batch``, what the
        rank trains (AReaL's ``DistRolloutCoordinator`` all-gathers the data-parallel ranks' batches and
        splits them again by sequence length) and counts updates."""

        updates = 0

        def prepare_batch(self, *args: Any, **kwargs: Any) -> Any:
            trained = super().prepare_batch(*args, **kwargs)
            last = self.rollout_engine.workflow_executor.batches.last
            if last is None:  # not a data-parallel head: it consumed nothing and trains its head's batch
                row = {"life": life, "rank": rank, "actor_version": self.get_version(), "trained": sequences(trained)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                return trained
            log.write(json.dumps({
                "life": life, "rank": rank, "step": last.batch.version, "actor_version": self.get_version(),
                "ids": [int(g) for g in last.batch.group_ids], "reserved": list(last.batch.group_versions),
                "dropped": [int(g) for g in last.batch.dropped], "prompts": [prompt_of_task[int(g)] for g in last.batch.group_ids],
                "heads": [int(t["versions"][t["loss_mask"].bool()].min()) for t in last.trajectories],  # generated tokens only
                "tails": [int(t["versions"][t["loss_mask"].bool()].max()) for t in last.trajectories],
                "consumed": sequences(last.trajectories), "trained": sequences(trained),
                "trained_groups": len(trained)}) + "\n")
            log.flush()
            return trained

        def ppo_update(self, *args: Any, **kwargs: Any) -> Any:
            RecordingActor.updates += 1
            return super().ppo_update(*args, **kwargs)

    class ProtocolPPOTrainer(ProtocolTrainerHooks, PPOTrainer):
        def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
            engine = RecordingActor(config=actor_config)
            engine.create_process_group(parallel_strategy=alloc.parallel)
            return engine

    model = out / "model"
    config = build_config(out, model, steps, layout)
    name_resolve.reconfigure(config.cluster.name_resolve)  # what AReaL's launcher does before it starts a trial
    if rank == 0:  # once per trial, as the launcher does (the first record is added after the ranks' first barrier)
        name_resolve.clear_subtree(names.trial_root(experiment_name=config.experiment_name, trial_name=config.trial_name))
    trainer = ProtocolPPOTrainer(config, train_dataset=Dataset.from_list(dataset_rows()),
                                 protocol=LockedStalenessManager.create(ETA, rank_batch(layout)), trace_path=out / f"trace-{rank}.jsonl")
    executor = trainer.rollout.workflow_executor
    batches = executor.batches
    started = {"protocol_version": batches.protocol.version, "engine_version": trainer.rollout.get_version(),
               "actor_version": trainer.actor.get_version(), "dp_rank": trainer.actor.data_parallel_rank,
               "recovered_step": None if trainer.recover_info is None else trainer.recover_info.last_step_info.global_step,
               "retry": [p["id"] for p in batches.state_dict()["prompts"]],
               "max_concurrent_rollouts": executor.staleness.max_concurrent_rollouts}
    workflow = RecordingWorkflow(reward_fn=reward, gconfig=config.gconfig, tokenizer=trainer.tokenizer,
                                 get_input_ids_fn=prompt_ids, data_extract_prompt_fn=extract_prompt)
    trainer.train(workflow=workflow)
    state = trainer.train_dataloader.state_dict()["staleflow_protocol"]
    result = {"life": life, "rank": rank, "started": started, "updates": RecordingActor.updates, "outstanding": batches.outstanding,
              "saved": [p["id"] for p in state["prompts"]], "version": batches.protocol.version}
    if life == 0:  # the dump of the last step is on disk: die with the episodes in flight
        from areal.utils.recover import RecoverHandler, RecoverInfo

        dist.barrier()  # rank 0 writes the dump (every rank's dataloader state, all-gathered): read it once written
        recover = config.recover
        # with torch.distributed initialized, RecoverInfo.load picks this rank's dataloader state, as RecoverHandler.load does
        info = RecoverInfo.load(RecoverHandler.recover_info_path(recover.experiment_name, recover.trial_name, recover.fileroot))
        result["dumped"] = {"step": info.last_step_info.global_step,
                            "prompts": [p["id"] for p in info.dataloader_info["staleflow_protocol"]["prompts"]],
                            "protocol_version": info.dataloader_info["staleflow_protocol"]["protocol"]["version"]}
        (out / f"life-0-{rank}.json").write_text(json.dumps(result))
        log.close()
        os._exit(0)
    (out / f"life-1-{rank}.json").write_text(json.dumps(result))
    trainer.close()


# ----------------------------------------------------------------------------- the parent
def run_life(out: Path, server: FakeVLLMServer, steps: int, life: int, layout: str) -> None:
    """The ``RANKS`` trainer processes of one life, with the environment AReaL's SPMD launcher
    (torchrun) gives each rank, each in its own session; once they have exited (or one failed: the
    other then waits in a collective), whatever they forked (AReaL's reward process pool, orphaned by
    life 0's ``os._exit``) is killed with their process groups."""
    # TORCHDYNAMO_DISABLE: AReaL torch.compiles its log-prob gather; on CPU inductor's C++ build of it
    # costs about a minute per process; eager gives the same numbers
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "TORCHDYNAMO_DISABLE": "1"}
    port, procs, codes = free_port(), [], {}
    try:
        for rank in range(RANKS):
            with (out / f"life-{life}-{rank}.log").open("w") as sink:
                procs.append(subprocess.Popen(
                    [sys.executable, "-I", __file__, "--life", str(out), server.address, str(steps), str(life), str(rank), str(port),
                     layout],
                    env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 600
        while len(codes) < RANKS and not any(codes.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            codes.update({rank: proc.returncode for rank, proc in enumerate(procs) if proc.poll() is not None})
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if len(codes) < RANKS or any(codes.values()):
        logs = "".join(f"\n--- rank {rank} ({codes.get(rank, 'killed')}):\n" + (out / f"life-{life}-{rank}.log").read_text()[-4000:]
                       for rank in range(RANKS))
        raise RuntimeError(f"life {life} failed:{logs}")


def check(out: Path, steps: int, recover_at: int) -> dict[str, Any]:
    """Per rank: its consumed batches, the bound, the recover and its trace. Over both ranks: each
    step trained the union of the ranks' consumed batches (redistributed), no prompt twice."""
    from staleflow_protocol.trace import read_trace

    rows = {rank: [json.loads(line) for line in (out / f"trained-{rank}.jsonl").read_text().splitlines()] for rank in range(RANKS)}
    ranks: dict[str, Any] = {}
    for rank, got in rows.items():
        lives = [json.loads((out / f"life-{life}-{rank}.json").read_text()) for life in (0, 1)]
        assert [r["step"] for r in got] == list(range(steps)), [r["step"] for r in got]
        assert [r["life"] for r in got] == [0] * (recover_at + 1) + [1] * (steps - recover_at - 1)
        ids = [i for r in got for i in r["ids"]]
        prompts = [p for r in got for p in r["prompts"]]
        dumped, resumed = lives[0]["dumped"], lives[1]["started"]
        trace = subprocess.run([sys.executable, "-m", "staleflow_protocol.check", str(out / f"trace-{rank}.jsonl")],
                               capture_output=True, text=True, check=False)
        ranks[str(rank)] = {
            "updates": [life["updates"] for life in lives], "groups_per_step": sorted({len(r["ids"]) for r in got}),
            "trained_groups_per_step": sorted({r["trained_groups"] for r in got}),
            "trained_own_batch_steps": sum(r["trained"] == r["consumed"] for r in got),  # what the redistribution left it
            "ids_once": len(ids) == len(set(ids)) == steps * rank_batch("d2"), "prompts_once": len(prompts) == len(set(prompts)),
            "bound_ok": all(v <= head <= tail <= r["step"] <= v + ETA
                            for r in got for v, head, tail in zip(r["reserved"], r["heads"], r["tails"])),
            "actor_at_batch_version": all(r["actor_version"] == r["step"] for r in got),
            "stale": sum(r["step"] - v == ETA for r in got for v in r["reserved"]),
            "dumped_step": dumped["step"], "dumped_protocol_version": dumped["protocol_version"],
            "in_flight_at_death": lives[0]["outstanding"], "resumed": resumed, "dumped_prompts": dumped["prompts"],
            "dumped_prompts_kept": set(dumped["prompts"]) <= set(prompts) | set(lives[1]["saved"]),
            "final_version": lives[1]["version"], "trace_rc": trace.returncode, "trace": (trace.stdout + trace.stderr).strip(),
            # the batches the trace's consumes took, over both lives' segments (the recovered life appends)
            "trace_batches": sorted({event.batch.version for segment in read_trace(out / f"trace-{rank}.jsonl")
                                     for event in segment.events if event.batch is not None}),
        }
    by_step = [[rows[rank][step] for rank in range(RANKS)] for step in range(steps)]
    prompts = [p for got in rows.values() for r in got for p in r["prompts"]]
    return {
        "steps": steps, "ranks": ranks,
        # every step, the ranks together trained exactly the union of their consumed batches
        "trained_is_consumed": all(sorted(s for r in step for s in r["trained"]) == sorted(s for r in step for s in r["consumed"])
                                   for step in by_step),
        "samples_per_step": sorted({sum(len(r["trained"]) for r in step) for step in by_step}),
        "prompts_once": len(prompts) == len(set(prompts)),
    }


def check_tensor_parallel(out: Path, steps: int, recover_at: int) -> dict[str, Any]:
    """``fsdp:d1t2``: rank 0, the data-parallel head, consumes the whole batch each step (bound, ids once,
    recover, trace); rank 1 never consumes: its protocol is at version 0 in both lives, its second life
    passed ``on_version_recovered`` with its actor and engine at the recovered version, and each step it
    trained exactly what the head trained (the batch AReaL broadcasts within the group)."""
    from staleflow_protocol.trace import read_trace

    rows = {rank: [json.loads(line) for line in (out / f"trained-{rank}.jsonl").read_text().splitlines()] for rank in range(RANKS)}
    lives = {rank: [json.loads((out / f"life-{life}-{rank}.json").read_text()) for life in (0, 1)] for rank in range(RANKS)}
    head, member = rows[0], rows[1]
    assert [r["step"] for r in head] == list(range(steps)) and len(member) == steps, ([r["step"] for r in head], len(member))
    ids = [i for r in head for i in r["ids"]]
    traces = {rank: subprocess.run([sys.executable, "-m", "staleflow_protocol.check", str(out / f"trace-{rank}.jsonl")],
                                   capture_output=True, text=True, check=False) for rank in range(RANKS)}
    return {
        "steps": steps, "updates": {rank: [life["updates"] for life in lives[rank]] for rank in range(RANKS)},
        "head": {"ids_once": len(ids) == len(set(ids)) == steps * rank_batch("d1t2"),
                 "bound_ok": all(v <= h <= t <= r["step"] <= v + ETA
                                 for r in head for v, h, t in zip(r["reserved"], r["heads"], r["tails"])),
                 "stale": sum(r["step"] - v == ETA for r in head for v in r["reserved"]),
                 "dumped_protocol_version": lives[0][0]["dumped"]["protocol_version"], "resumed": lives[0][1]["started"],
                 "trace_rc": traces[0].returncode, "trace": traces[0].stdout.strip(),
                 "trace_batches": sorted({event.batch.version for segment in read_trace(out / "trace-0.jsonl")
                                          for event in segment.events if event.batch is not None})},
        "member": {"protocol_versions": [life["version"] for life in lives[1]],
                   "dumped_protocol_version": lives[1][0]["dumped"]["protocol_version"],
                   "resumed": lives[1][1]["started"], "saved": [life["saved"] for life in lives[1]],
                   "actor_versions": [r["actor_version"] for r in member],
                   "trained_the_heads_batch": all(m["trained"] == h["trained"] for m, h in zip(member, head)),
                   "trace_rc": traces[1].returncode},
    }


def main(argv: list[str]) -> None:
    if argv[0] == "--life":
        life_main(Path(argv[1]), argv[2], int(argv[3]), int(argv[4]), int(argv[5]), int(argv[6]), argv[7])
        return
    out = Path(argv[0])
    steps = int(argv[1]) if len(argv) > 1 else 6
    recover_at = int(argv[2]) if len(argv) > 2 else steps // 2 - 1
    layout = argv[3] if len(argv) > 3 else "d2"
    if layout not in LAYOUTS:
        raise SystemExit(f"layout {layout!r}: expected one of {LAYOUTS}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    server = FakeVLLMServer(make_assets(out))
    run_life(out, server, recover_at + 1, life=0, layout=layout)
    run_life(out, server, steps, life=1, layout=layout)
    result = check(out, steps, recover_at) if layout == "d2" else check_tensor_parallel(out, steps, recover_at)
    result.update({"initial_weights": server.initial, "weight_loads": server.loads, "server_generated": server.generated,
                   "seconds": round(time.perf_counter() - started, 1)})
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
