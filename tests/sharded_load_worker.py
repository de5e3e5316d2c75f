"""Run under torchrun by test_train.py: fsdp.build_model on a checkpoint, then report this rank's
peak host memory during the load and (rank 0) the full state dict, for comparison with
ParVL.from_pretrained. Not a test module (pytest does not collect it)."""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from shell.cli import start_processes  # noqa: E402
from training import fsdp  # noqa: E402

folder, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = train.TrainConfig(
    model=str(folder),
    data="",
    out=str(out),
    pv=2,
    pl=2,
    dtype="fp32",
    activation_checkpointing=False,
)
device = start_processes(torch.cuda.is_available(), always=True)
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = fsdp.build_model(cfg, device, mesh)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    save_file(
        {
            k: v.contiguous()
            for k, v in full.items()
            if k != "language_model.lm_head.weight" or not model.cfg.llm.tie_word_embeddings
        },
        str(out / "gathered.safetensors"),
    )
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"before": before, "peak": peak}))
dist.barrier()
dist.destroy_process_group()
