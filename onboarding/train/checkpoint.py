"""DCP checkpoints of a LoRA run: adapters, AdamW state, step (= data position), RNG.

Layout: ``<out>/train/ckpt/<role>/step_NNNNNN/`` holds the DCP files (adapter parameters and
their AdamW moments keyed by parameter path, the step), one ``rng_rank<r>.pt`` per rank, and a
``COMPLETE`` marker written by rank 0 after every rank finished. Resuming takes the newest
directory with the marker, so a crash during a save falls back to the previous checkpoint.

Dense adapters are FSDP DTensors already. Expert adapters (and their moments) are plain local
tensors, EP-sharded by expert and replicated over the "fsdp" sub-mesh: they are saved as
DTensor views over the ("fsdp", "ep") mesh with placements (Replicate, Shard(0)), so DCP sees
their global shape and writes each expert once. Data order is a function of the step (the
packed rows of step s are fixed by the seed), so the step is the data position.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from onboarding.train.parallel import Layout

MARKER = "COMPLETE"


def _barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()


class Checkpointer:
    def __init__(self, root: Path, layout: Layout, *, interval: int, keep: int = 2):
        self.root, self.layout, self.interval, self.keep = Path(root), layout, interval, keep

    # ---- state ----------------------------------------------------------------------------
    def _view(self, t: torch.Tensor, expert: bool) -> torch.Tensor:
        if not expert or not self.layout.distributed:
            return t
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(t, self.layout.mesh, [Replicate(), Shard(0)], run_check=False)

    @staticmethod
    def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
        """Create AdamW's state (zeros, step 0) up front, as its first step would, so that a
        checkpoint can be loaded into it in place."""
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state(self, params: list[tuple[str, nn.Parameter]], expert_ids: set[int],
              opt: torch.optim.Optimizer, step: int) -> dict:
        self.init_optimizer_state(opt)
        sd: dict = {"step": torch.tensor(step, dtype=torch.int64)}
        for name, p in params:
            ex = id(p) in expert_ids
            st = opt.state[p]
            sd[f"adapter/{name}"] = self._view(p.data, ex)
            sd[f"optim/{name}/exp_avg"] = self._view(st["exp_avg"], ex)
            sd[f"optim/{name}/exp_avg_sq"] = self._view(st["exp_avg_sq"], ex)
            sd[f"optim/{name}/step"] = st["step"]
        return sd

    # ---- save / load ----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def save(self, step: int, params, expert_ids, opt) -> Path:
        import torch.distributed.checkpoint as dcp

        d = self.root / f"step_{step:06d}"
        if self.layout.rank == 0 and d.exists():
            shutil.rmtree(d)  # a partial save of the same step from a crashed run
        _barrier(self.layout)
        dcp.save(self.state(params, expert_ids, opt, step), checkpoint_id=str(d))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, d / f"rng_rank{self.layout.rank}.pt")
        _barrier(self.layout)
        if self.layout.rank == 0:
            (d / MARKER).write_text(f"{step}\n")
            self._prune()
        _barrier(self.layout)
        return d

    def _prune(self) -> None:
        done = self.complete()
        for old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / MARKER).is_file())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def load(self, path: Path, params, expert_ids, opt) -> int:
        """Load ``path`` in place into the adapters and optimizer; returns its step."""
        import torch.distributed.checkpoint as dcp

        sd = self.state(params, expert_ids, opt, 0)
        dcp.load(sd, checkpoint_id=str(path))
        # Plain tensors (steps) are loaded in place too, but keep the optimizer's own objects.
        for name, p in params:
            opt.state[p]["step"].copy_(sd[f"optim/{name}/step"])
        rng_file = Path(path) / f"rng_rank{self.layout.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return int(sd["step"])
