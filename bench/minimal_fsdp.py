"""The smallest honest FSDP2 training loop: the baseline that bench/fsdp.py holds `train_ddp.py --parallelism fsdp` to.

The trainer's model spread as trainer/parallel.py spreads it under fsdp, written out plainly: built on the meta
device, `fully_shard` on every transformer block and then on the root over one mesh dimension of every rank, given
memory and the trainer's initial weights (`trainer.parallel.initialize`: the same draw as DDP's for the seed), and
fused AdamW with the trainer's parameter groups, as the trainer builds it. The loop is bench/minimal_ddp.py's (the
same data order, schedule, clipping at 1.0 and cross-entropy, no checkpoints, metrics or stop-signal agreement); it
times steps [warmup, max_steps) and prints one JSON line. gloo on CPU, fp32. Run it under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/minimal_fsdp.py \\
        --data-dir <root>/datasets/<name>/tokenized --preset small --max-steps 120 --warmup 20
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

if __package__ in (None, ""):  # run as a script, as torchrun does: make the trainer package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minimal_ddp import leave, param_groups, parse_args, token_batches, train

from trainer.model import build_model, model_config, without_attention_masks
from trainer.parallel import blocks, initialize


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    batches, meta = token_batches(args, dist.get_rank(), world)

    config = model_config(args.preset, meta["vocab_size"], args.seq_len, meta["eos_id"])
    with torch.device("meta"):
        model = without_attention_masks(build_model(config))
    template = copy.deepcopy(model)  # the unsharded shapes the initial weights are drawn in
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model).values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.tie_weights()
    initialize(model, template, args.seed)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), fused=True)
    train(lambda inputs: model(input_ids=inputs, use_cache=False).logits, model, optimizer, batches, args)
    return 0


if __name__ == "__main__":
    leave(main())
