"""What the parallelisms do on 2 processes, in one torchrun (tests/conftest.py `parallel_probe`, read by
tests/test_parallel.py and tests/test_published.py).

Run as `torchrun --nproc-per-node 2 -m tests.parallel_probe OUT [MODEL_DIR ...]`.

Gradient accumulation and checkpoint shares. For ddp, fsdp and hsdp (2 replicas of 1
shard) in turn, an untied llama-shaped model (its embedding and output head are FSDP units of their own) runs two
micro-batches as the training loop does (trainer/parallel.py `accumulating`), the loss in one piece under ddp and
in chunks of 4 tokens under fsdp and hsdp (trainer/loss.py). Each rank writes OUT/rank_<r>.json:
the bytes of the tensors the first, unsynchronised micro-batch left alive (the gradients held until the next;
tests/allocations.py counts every storage, FSDP's own buffers included) and the model's fp32 gradient bytes; rank 0
writes each parallelism's whole gradients after the second micro-batch to OUT/<kind>.pt. Under hsdp, after an
optimizer step, the checkpoint's tensors (trainer/dcp_io.py): the bytes this rank holds and the bytes of its share
(what an asynchronous save stages), and whether the shares saved with DCP load back into every rank's whole state.

Published models. For each MODEL_DIR (a directory save_pretrained wrote), under ddp and fsdp: the trainer's model
for its config, its weights loaded by trainer/published.py (each rank reading its pieces), and the loss the training
loop calls on this rank's batch, beside transformers' own loss for the same batch from the same directory; each rank
writes them to OUT/published_rank_<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.allocations import LiveBytes
from trainer import dcp_io
from trainer.parallel import parallelize
from trainer.published import PublishedModel
from trainer.published_weights import load_weights

SHAPE = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
    "vocab_size": 1024,
    "max_position_embeddings": 64,
}


def main(out: Path, model_dirs: list[Path]) -> None:
    from transformers import AutoConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = AutoConfig.for_model("llama", **SHAPE)
    generator = torch.Generator().manual_seed(10 + rank)  # each rank its own data, as in training
    micro_batches = [torch.randint(0, SHAPE["vocab_size"], (2, 33), generator=generator) for _ in range(2)]
    record = {}
    for kind in ("ddp", "fsdp", "hsdp"):
        parallel = parallelize(config, kind, torch.device("cpu"), seed=1, local_world=1 if kind == "hsdp" else 2)
        if kind != "ddp":  # the chunked loss inside FSDP's output unit, 16 chunks: the gradients must be ddp's plain
            parallel.model.get_output_embeddings().chunk_elements = 4 * SHAPE["vocab_size"]
        for index, tokens in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with LiveBytes() as held, parallel.accumulating(last):
                (parallel.forward_loss(tokens[:, :-1], tokens[:, 1:]) / len(micro_batches)).backward()
            if not last:
                record[kind] = held.live
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in parallel.model.parameters()]
        record["model_grad_bytes"] = 4 * sum(g.numel() for g in grads)
        if rank == 0:
            torch.save(torch.cat([g.flatten() for g in grads]), out / f"{kind}.pt")
        if kind == "hsdp":
            record |= checkpoint_shares(parallel.model, out / "hsdp-checkpoint")
        del parallel, grads
    (out / f"rank_{rank}.json").write_text(json.dumps(record))
    (out / f"published_rank_{rank}.json").write_text(json.dumps(published_losses(model_dirs, rank)))
    dist.destroy_process_group()


def published_losses(model_dirs: list[Path], rank: int) -> dict[str, dict[str, float]]:
    """{model dir name: {"transformers": its loss, "ddp": ..., "fsdp": ...}} on this rank's batch."""
    from transformers import AutoModelForCausalLM

    losses = {}
    for path in model_dirs:
        published = PublishedModel.read(path)
        tokens = torch.randint(
            0, published.config["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(20 + rank)
        )
        # in fp32, the trainer's dtype (the Llama is saved in bfloat16, which from_pretrained would compute in)
        reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = reference(input_ids=tokens[:, :-1]).logits
            losses[path.name] = {"transformers": F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()}
        for kind in ("ddp", "fsdp"):
            parallel = parallelize(
                published.model_config(), kind, torch.device("cpu"), seed=1, local_world=2, initial_weights=False
            )
            load_weights(parallel.model, published)
            with torch.no_grad():
                losses[path.name][kind] = parallel.forward_loss(tokens[:, :-1], tokens[:, 1:]).item()
    return losses


def checkpoint_shares(model: torch.nn.Module, path: Path) -> dict[str, object]:
    """This rank's bytes of the checkpoint's tensors, of its share, and whether the shares load back whole."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    tensors, _ = dcp_io.split_state(model, optimizer)
    mine = dcp_io.share(tensors, dist.get_rank(), dist.get_world_size())
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    dcp.save(mine, storage_writer=dcp_io.writer(path))
    loaded = {key: torch.zeros_like(tensor) for key, tensor in tensors.items()}
    dcp.load(loaded, storage_reader=dcp_io.VerifyingReader(path))
    return {
        "held_bytes": sum(local(t).nbytes for t in tensors.values()),
        "share_bytes": sum(local(t).nbytes for t in mine.values()),
        "loads_back": all(torch.equal(local(loaded[k]), local(t)) for k, t in tensors.items()),
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
