"""The FSDP2 trainer on CPU: 2 ranks over gloo train like the one-process trainer, gather full weights,
and checkpoint/restore sharded (each rank its own shards, at any world size) with every file and key checked first."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import pytest
import torch
from staleflow.adapters.fsdp.trainer import FSDPTrainer
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.torch.trainer import TorchTrainer
from trainer_batches import make_batch


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model  # the session's (tests/conftest.py)


def _damaged_copy(checkpoint: Path, target: Path, shard: str = "__1_0.distcp", keep_bytes: int | None = 10) -> Path:
    """A copy of ``checkpoint`` whose ``shard`` file is cut to ``keep_bytes`` (None: removed)."""
    import shutil

    shutil.copytree(checkpoint, target)
    path = target / "shards" / shard
    if keep_bytes is None:
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:keep_bytes])
    return target


def _shard_files(checkpoint: Path) -> dict[str, int]:
    """The shard files of a sharded checkpoint and their sizes."""
    return {p.name: p.stat().st_size for p in sorted((checkpoint / "shards").glob("*.distcp"))}


def test_two_gloo_ranks_match_one_process_and_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    # Two minibatches (the proximal pass and two optimiser steps per batch), tiny micro-batches and chunks.
    settings = TrainerSettings(lr=1e-3, lr_warmup_steps=2, minibatches=2, micro_batch_tokens=64, logprob_chunk=16,
                               activation_checkpointing=True, loss=LossSettings(correction=Correction.DECOUPLED_PPO, weight_cap=3.0))
    fsdp = FSDPTrainer(model_dir, settings=settings, world_size=2, seed=1)
    single = TorchTrainer(model_dir, settings=settings, seed=1)
    try:
        initial = {k: v.clone() for k, v in fsdp.weights().items()}
        assert set(initial) == set(single.weights()) and all(torch.equal(v, single.weights()[k]) for k, v in initial.items())
        for step in range(2):
            batch = make_batch(version=step, groups=4, size=4, seed=step)
            fsdp.start_step(batch)
            single.start_step(batch)
            got, want = fsdp.wait(timeout=300), single.wait(timeout=300)
            assert got.version == want.version == step + 1
            for key in ("loss", "grad_norm", "update_norm", "behaviour_kl", "clip_fraction", "rejected_fraction", "lr", "tokens"):
                assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-6), key
            assert got.metrics["update_norm"] > 0
        worst = max(float((fsdp.weights()[k] - v).abs().max()) for k, v in single.weights().items())
        assert worst < 5e-5, worst  # fp32, different reduction order: agreement far below the update (lr 1e-3)
        assert all(not torch.equal(fsdp.weights()[k], v) for k, v in initial.items())
        saved_before_refusals = {k: v.clone() for k, v in fsdp.weights().items()}

        # Each rank writes its own shards of the weights and the AdamW state: two files of about half
        # the state each, and no file of the full weights or optimiser state.
        fsdp.save_checkpoint(tmp_path / "ckpt")
        shards = _shard_files(tmp_path / "ckpt")
        assert list(shards) == ["__0_0.distcp", "__1_0.distcp"], shards
        assert all(0.35 < size / sum(shards.values()) < 0.65 for size in shards.values()), shards
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["shards", "trainer_state.pt"]
        state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)
        assert state["format"] == "staleflow-fsdp/2" and "optimizer" not in state and state["version"] == 2

        # Refused before any rank is touched: another trainer's state, the full format that came
        # before (by name), a missing or cut shard file; the trainer keeps its weights.
        single.save_checkpoint(tmp_path / "torch-ckpt")
        with pytest.raises(ValueError, match="is not an FSDP trainer state"):
            fsdp.load_checkpoint(tmp_path / "torch-ckpt")
        with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
            single.load_checkpoint(tmp_path / "ckpt")  # the torch trainer's checkpoints are whole
        import shutil

        shutil.copytree(tmp_path / "torch-ckpt", tmp_path / "full")
        full = torch.load(tmp_path / "full" / "trainer_state.pt", weights_only=False)
        torch.save({**full, "format": "staleflow-fsdp/1"}, tmp_path / "full" / "trainer_state.pt")
        with pytest.raises(ValueError, match="is of the full format staleflow-fsdp/1 .* restores sharded checkpoints"):
            fsdp.load_checkpoint(tmp_path / "full")
        with pytest.raises(FileNotFoundError, match="lacks the shard file __1_0.distcp"):
            fsdp.load_checkpoint(_damaged_copy(tmp_path / "ckpt", tmp_path / "no-shard", keep_bytes=None))
        with pytest.raises(ValueError, match="__0_0.distcp holds 10 bytes; its index needs"):
            fsdp.load_checkpoint(_damaged_copy(tmp_path / "ckpt", tmp_path / "cut", shard="__0_0.distcp"))
        assert all(torch.equal(v, fsdp.weights()[k]) for k, v in saved_before_refusals.items())

        # Restored, the next step lands exactly where the original's did (weights, AdamW moments and
        # schedule restored: the update, not only the loss, is the same).
        assert fsdp.version == 2
        saved = {k: v.clone() for k, v in fsdp.weights().items()}
        batch = make_batch(version=2, groups=4, size=4, seed=7)
        fsdp.start_step(batch)
        after = fsdp.wait(timeout=300)
        stepped = {k: v.clone() for k, v in fsdp.weights().items()}
        assert fsdp.load_checkpoint(tmp_path / "ckpt") == 2
        assert all(torch.equal(v, fsdp.weights()[k]) for k, v in saved.items())
        fsdp.start_step(batch)
        again = fsdp.wait(timeout=300)
        assert again.metrics["loss"] == pytest.approx(after.metrics["loss"], rel=1e-5)
        assert again.metrics["lr"] == after.metrics["lr"]
        assert all(torch.equal(v, fsdp.weights()[k]) for k, v in stepped.items())
    finally:
        fsdp.close()
        single.close()

    # At another world size (torch.distributed.checkpoint reshards): one rank restores the two ranks' shards.
    alone = FSDPTrainer(model_dir, settings=settings, world_size=1, seed=1)
    try:
        assert alone.load_checkpoint(tmp_path / "ckpt") == 2
        assert all(torch.equal(v, alone.weights()[k]) for k, v in saved.items())
        alone.start_step(batch)
        assert alone.wait(timeout=300).metrics["loss"] == pytest.approx(after.metrics["loss"], rel=1e-4)
        assert max(float((alone.weights()[k] - v).abs().max()) for k, v in stepped.items()) < 1e-6
    finally:
        alone.close()


def test_a_failed_or_dead_rank_stops_the_group_instead_of_hanging() -> None:
    import time

    from staleflow.adapters.rlkit.worker_group import ProcessWorkers, WorkerGroupError

    # Each rank holds a namespace whose ``run`` evaluates an expression: rank 0 blocks (as in a collective).
    workers = ProcessWorkers(functools.partial(types.SimpleNamespace, run=eval), 2, timeout_s=120)
    assert workers.call_all("run", [("6 * 7",), ("1 + 1",)]) == [42, 2]
    started = time.monotonic()
    with pytest.raises(WorkerGroupError, match="rank 1 died during 'run' \\(exit code 3\\)"):
        workers.call_all("run", [("__import__('time').sleep(300)",), ("__import__('os')._exit(3)",)])
    assert time.monotonic() - started < 60  # noticed at once; the blocked rank is stopped too
    with pytest.raises(WorkerGroupError, match="stopped"):
        workers.call_all("run", [("1",), ("1",)])
    workers = ProcessWorkers(functools.partial(types.SimpleNamespace, run=eval), 2, timeout_s=120)
    with pytest.raises(WorkerGroupError, match="(?s)rank 0 failed in 'run':.*ZeroDivisionError"):
        workers.call_all("run", [("1 / 0",), ("__import__('time').sleep(300)",)])
    workers = ProcessWorkers(functools.partial(types.SimpleNamespace, run=eval), 1, timeout_s=120)
    workers.timeout_s = 0.5  # (after the start-up, which imports torch in the child)
    with pytest.raises(WorkerGroupError, match=r"ranks \[0\] did not answer 'run' within 0 s"):
        workers.call_all("run", [("__import__('time').sleep(300)",)])  # a rank that hangs is stopped, not waited for
    with pytest.raises(WorkerGroupError, match="(?s)rank 0 failed in 'start':.*invalid literal for int"):
        ProcessWorkers(functools.partial(int, "not a number"), 1, timeout_s=120)  # the rank's object cannot be built


#: Evaluated in a Ray actor: writes the actor's line coverage so far, when the suite measures it (a
#: Ray actor's process ends by ``ray.kill``, which runs no exit handler, so nothing would be written).
_SAVE_COVERAGE = "(lambda cov: cov and cov.save())(__import__('coverage').Coverage.current())"


def test_ray_ranks_answer_in_rank_order_in_their_bundles_and_a_failed_or_dead_rank_stops_the_group(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """The Ray launcher (what FSDP and Megatron use on a cluster), on the shared CPU cluster's logical GPUs."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from staleflow.adapters.rlkit.worker_group import RayWorkers, WorkerGroupError, rank_address

    ray = ray_cluster
    rank = functools.partial(types.SimpleNamespace, run=eval, address=rank_address)
    group = placement_group([{"GPU": 1}, {"GPU": 1}])
    ray.get(group.ready(), timeout=120)
    try:
        workers = RayWorkers(rank, 2, num_gpus=1, num_cpus=0, placement_group=group)
        assert workers.call_all("run", [("6 * 7",), ("1 + 1",)]) == [42, 2]
        devices = workers.call_all("run", [("__import__('os').environ['CUDA_VISIBLE_DEVICES']",)] * 2)
        assert len(set(devices)) == 2  # one logical GPU each, as Ray assigns them
        node = ray.util.get_node_ip_address()
        assert all(a.startswith(f"tcp://{node}:") for a in workers.call_all("address"))  # inside an actor: the node's address
        assert rank_address().startswith(f"tcp://{node}:")  # so in any process that joined the cluster
        workers.call_all("run", [(_SAVE_COVERAGE,)] * 2)
        with pytest.raises(WorkerGroupError, match="(?s)rank 1 failed in 'run'.*ZeroDivisionError"):
            workers.call_all("run", [("__import__('time').sleep(300)",), ("1 / 0",)])
        assert workers._actors == []  # every rank was killed, the blocked one too
        with pytest.raises(WorkerGroupError, match="stopped \\(rank 1 failed in 'run'"):
            workers.call_all("run")
    finally:
        remove_placement_group(group)
    workers = RayWorkers(rank, 2, num_cpus=0)
    with pytest.raises(WorkerGroupError, match="(?is)rank 0 failed in 'run'.*actor"):
        workers.call_all("run", [("__import__('os')._exit(3)",), ("__import__('time').sleep(300)",)])
    workers.close()
    with pytest.raises(WorkerGroupError, match="stopped \\(rank 0 failed"):
        workers.call_all("run")


@pytest.mark.ray
def test_ray_ranks_publish_into_the_object_store_and_rank_0_checkpoints_and_decodes(tmp_path: Path, ray_cluster,  # type: ignore[no-untyped-def]
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With Ray actors as ranks the driver holds only a reference to rank 0's copy of each version:
    another process (a parameter server's actor, an engine) fetches the weights, the checkpoint and
    the greedy evaluation are rank 0's, and a refused checkpoint leaves the group able to train. The
    model has tied embeddings: rank 1, built on the meta device, gets the shared weight from rank 0."""
    from staleflow.adapters.ray.object_weights import ObjectStoreWeights
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.adapters.rlkit.causal_lm import PublishedWeightsDecoder
    from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model
    from staleflow.runtime.interfaces import TransferFailedError, resolve_weights
    from staleflow.runtime.servers.parameter_server import ParameterServer

    ray = ray_cluster

    def fetch_in_driver(self: ObjectStoreWeights) -> None:
        raise AssertionError("the driver fetched weights")

    model_dir = ensure_tiny_model(tmp_path / "tied", TinyModelSpec(tie_word_embeddings=True))
    settings = TrainerSettings(lr=1e-3, lr_warmup_steps=2, micro_batch_tokens=64, logprob_chunk=16)
    fsdp = FSDPTrainer(model_dir, settings=settings, world_size=2, seed=1, launcher="ray")
    single = TorchTrainer(model_dir, settings=settings, seed=1)
    placement = RayPlacement()
    try:
        with monkeypatch.context() as driver:
            driver.setattr(ObjectStoreWeights, "fetch", fetch_in_driver)  # this process only
            assert isinstance(fsdp.weights(), ObjectStoreWeights) and fsdp.weights().version == 0
            same = ray.remote(lambda held, want: resolve_weights(held).keys() == want.keys()
                              and all(torch.equal(resolve_weights(held)[k], v) for k, v in want.items()))
            # the meta-built rank's shards came from rank 0; the tied output layer is published once, as the
            # embedding (the single-process trainer's CPU copy still holds it under both names)
            untied = {name: tensor for name, tensor in single.weights().items() if name != "lm_head.weight"}
            assert ray.get(same.remote(fsdp.weights(), untied))
            batch = make_batch(version=0, groups=4, size=4, seed=3)
            fsdp.start_step(batch)
            single.start_step(batch)
            got, want = fsdp.wait(timeout=300), single.wait(timeout=300)
            assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-4, abs=1e-6)
            reference = fsdp.weights()
            assert isinstance(reference, ObjectStoreWeights) and reference.version == 1
            # The parameter server's actor keeps the reference; what it hands out resolves in another process.
            server = placement.place(ParameterServer, keep=2, copy_weights=lambda weights: weights)
            server.push(1, reference)
            stored = server.pull(1)[1]
            assert isinstance(stored, ObjectStoreWeights)  # a reference, not a copy of the weights
            sums = ray.get(ray.remote(lambda held: {k: float(v.double().sum()) for k, v in resolve_weights(held).items()}).remote(stored))
            untied = {name: tensor for name, tensor in single.weights().items() if name != "lm_head.weight"}
            assert sums.keys() == untied.keys()
            assert all(sums[k] == pytest.approx(float(v.double().sum()), rel=1e-4, abs=1e-3) for k, v in untied.items())

            prompts = [[5, 9, 11], [7, 3]]
            decoded = fsdp.generate_greedy(prompts, 6, eos_id=1)  # by rank 0
            fsdp.save_checkpoint(tmp_path / "ckpt")  # each rank its own shards
            assert list(_shard_files(tmp_path / "ckpt")) == ["__0_0.distcp", "__1_0.distcp"]
            with pytest.raises(FileNotFoundError, match="has no trainer_state.pt"):
                fsdp.load_checkpoint(tmp_path / "missing")
            with pytest.raises(ValueError, match="holds 10 bytes; its index needs"):
                fsdp.load_checkpoint(_damaged_copy(tmp_path / "ckpt", tmp_path / "bad"))  # refused by rank 0; the group goes on
            assert fsdp.load_checkpoint(tmp_path / "ckpt") == 1
            fsdp.start_step(make_batch(version=1, groups=4, size=4, seed=4))
            assert fsdp.wait(timeout=300).version == 2
        # The same responses as the published version-1 weights decoded here (a check outside the trainer).
        weights = resolve_weights(reference)
        assert decoded == PublishedWeightsDecoder(model_dir, 0).generate(weights, prompts, 6, 1)
        from staleflow.app.export import trainer_weights

        saved = trainer_weights(tmp_path / "ckpt", model_dir)  # the ranks' shards, read as staleflow export reads them
        assert saved.keys() - {"lm_head.weight"} == weights.keys() and all(torch.equal(saved[k].to(v.dtype), v) for k, v in weights.items())
        assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])  # the tie, published once
        assert torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)["version"] == 1
    finally:
        placement.close()
        fsdp.close()
        single.close()
    import time

    deadline = time.monotonic() + 60
    with pytest.raises(TransferFailedError, match="weights of version 2 are not in Ray's object store"):
        while time.monotonic() < deadline:  # its owner, rank 0, was killed (Ray notices within seconds)
            fsdp.weights().fetch()
            time.sleep(0.5)


def test_the_model_state_estimate_and_the_offload_it_chooses() -> None:
    """Finding 5 (issue 35): nothing estimated an FSDP rank's model state or moved it off the GPU (7B
    on 2 ranks: about 57 GiB of fp32 weights, gradients and AdamW state per GPU). The estimate is 16
    bytes per parameter per rank share; ``auto`` offloads where it takes more than half the GPU."""
    from staleflow.runtime.settings.memory_estimate import choose_offload, rank_state_bytes

    qwen7b, qwen1_5b, gib = 7_615_616_512, 1_543_714_304, 1 << 30
    state = rank_state_bytes(qwen7b, 2)
    assert (state.weights, state.gradients, state.optimizer) == (qwen7b // 2 * 4, qwen7b // 2 * 4, qwen7b // 2 * 8)
    assert round(state.total / gib, 1) == 56.7
    h100 = 80 * 10**9
    assert choose_offload("auto", qwen7b, 2, h100) and not choose_offload("auto", qwen7b, 8, h100)
    assert not choose_offload("auto", qwen1_5b, 2, h100) and not choose_offload("auto", qwen7b, 2, None)  # CPU: nothing to offload
    assert choose_offload("on", 1, 1, h100) and not choose_offload("off", qwen7b, 1, h100)
    assert not choose_offload("on", 1, 1, None)  # a CPU rank's state is in CPU memory (and the policy needs a GPU)
    with pytest.raises(ValueError, match="train.cpu_offload must be one of auto, on, off, got 'yes'"):
        choose_offload("yes", 1, 1, None)



def test_a_dead_ranks_exit_code_is_reported_when_its_pipe_closes_before_it_is_reaped() -> None:
    """A rank's pipe closes as it exits, before the process is reaped: the group read the exit code at
    once and reported "exit code None" on a loaded machine (seen in a full run). The rank process
    here answers ``exitcode`` only once joined, as a not yet reaped process does."""
    from staleflow.adapters.rlkit.worker_group import ProcessWorkers, WorkerGroupError

    class NotYetReaped:
        def __init__(self, proc) -> None:  # type: ignore[no-untyped-def]
            self._proc, self._joined = proc, False

        def join(self, timeout=None) -> None:  # type: ignore[no-untyped-def]
            self._proc.join(timeout)
            self._joined = True

        @property
        def exitcode(self):  # type: ignore[no-untyped-def]
            return self._proc.exitcode if self._joined else None

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self._proc, name)

    workers = ProcessWorkers(functools.partial(types.SimpleNamespace, run=eval), 1, timeout_s=120)
    workers._procs[0] = NotYetReaped(workers._procs[0])
    with pytest.raises(WorkerGroupError, match=r"rank 0 died during 'run' \(exit code 7\)"):
        workers.call_all("run", [("__import__('os')._exit(7)",)])
