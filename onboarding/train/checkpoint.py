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

The root may be an fsspec URL (``s3://bucket/prefix``, ``gs://...``): DCP then writes through
its fsspec storage, and the marker, RNG files, listing and pruning go through the same
filesystem (s3fs for s3://; credentials and endpoint from the usual AWS variables, or
``FSSPEC_S3_ENDPOINT_URL``). A plain path keeps DCP's local writer.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from onboarding.train.parallel import Layout

MARKER = "COMPLETE"


def _barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def filesystem(path: str | Path):
    """(fsspec filesystem, path inside it) of a local path or a URL; a URL whose scheme has no
    installed filesystem (s3:// without s3fs) is bad input, said before any step runs."""
    import fsspec
    from fsspec.core import url_to_fs

    from onboarding.errors import InputError

    try:
        return url_to_fs(str(path))
    except (ImportError, ValueError) as exc:
        scheme = str(path).split("://", 1)[0]
        known = fsspec.available_protocols()
        hint = f"install its fsspec filesystem ({'s3fs' if scheme in ('s3', 's3a') else scheme})" \
            if scheme in known else "unknown scheme"
        raise InputError(f"{path}: cannot open this URL: {hint} ({exc})") from exc


class Checkpointer:
    def __init__(self, root: str | Path, layout: Layout, *, interval: int, keep: int = 2):
        self.url = is_url(root)
        self.fs, self._root = filesystem(root if self.url else Path(root).resolve())
        self.root = str(root).rstrip("/") if self.url else Path(root)
        self.layout, self.interval, self.keep = layout, interval, keep

    def _join(self, *parts: str) -> str:
        return "/".join([self._root.rstrip("/"), *parts])

    def _name(self, fs_path: str):
        """A filesystem path as the user names it: the URL, or a local `Path`."""
        name = fs_path.rstrip("/").rpartition("/")[2]
        return f"{self.root}/{name}" if self.url else Path(self.root) / name

    # ---- state ----------------------------------------------------------------------------
    def _view(self, t: torch.Tensor, expert: bool) -> torch.Tensor:
        if not expert or not self.layout.distributed:
            return t
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(t, self.layout.mesh, [Replicate(), Shard(0)], run_check=False)

    @staticmethod
    def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
        """Create AdamW's state (zeros, step 0) up front, as its first step would, so that a
        checkpoint can be loaded into it in place. The step lives where AdamW's first step puts
        it: on the parameter's device for the fused and capturable implementations (the fused
        kernel refuses a CPU step), a CPU scalar otherwise."""
        for group in opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                st = opt.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32,
                                             device=p.device if on_device else "cpu")
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state(self, params: list[tuple[str, nn.Parameter]], expert_ids: set[int],
              opt: torch.optim.Optimizer, step: int, extra: dict | None = None) -> dict:
        """The DCP state dict; ``extra``: further tensors that train without the optimizer
        (the routers' score-correction biases of bias balancing), saved and loaded in place."""
        self.init_optimizer_state(opt)
        sd: dict = {"step": torch.tensor(step, dtype=torch.int64)}
        sd.update({f"extra/{k}": t for k, t in (extra or {}).items()})
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

    def _storage(self, d: str, write: bool) -> dict:
        from torch.distributed.checkpoint import FileSystemReader

        if not self.url:
            return {"checkpoint_id": d} if write else {"storage_reader": FileSystemReader(d)}
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        url = self._name(d)
        return {"storage_writer": FsspecWriter(str(url))} if write else \
            {"storage_reader": FsspecReader(str(url))}

    def save(self, step: int, params, expert_ids, opt, extra: dict | None = None):
        import torch.distributed.checkpoint as dcp

        d = self._join(f"step_{step:06d}")
        if self.layout.rank == 0 and self.fs.exists(d):
            self.fs.rm(d, recursive=True)  # a partial save of the same step from a crashed run
        _barrier(self.layout)
        dcp.save(self.state(params, expert_ids, opt, step, extra), **self._storage(d, True))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        buf = io.BytesIO()
        torch.save(rng, buf)
        self.fs.pipe_file(f"{d}/rng_rank{self.layout.rank}.pt", buf.getvalue())
        _barrier(self.layout)
        if self.layout.rank == 0:
            self.fs.pipe_file(f"{d}/{MARKER}", f"{step}\n".encode())
            self._prune()
        _barrier(self.layout)
        return self._name(d)

    def _prune(self) -> None:
        done = self._complete()
        for old in done[:-self.keep] if self.keep > 0 else []:
            try:
                self.fs.rm(old, recursive=True)
            except (FileNotFoundError, OSError):
                pass

    def _complete(self) -> list[str]:
        self.fs.invalidate_cache()  # listings of object stores are cached by default
        if not self.fs.isdir(self._root):
            return []
        steps = [p for p in self.fs.ls(self._root, detail=False)
                 if p.rstrip("/").rpartition("/")[2].startswith("step_")]
        return sorted(p for p in steps if self.fs.isfile(f"{p.rstrip('/')}/{MARKER}"))

    def complete(self) -> list:
        return [self._name(p) for p in self._complete()]

    def latest(self):
        done = self.complete()
        return done[-1] if done else None

    def load(self, path, params, expert_ids, opt, extra: dict | None = None) -> int:
        """Load ``path`` (from `latest`) in place into the adapters and optimizer; returns its
        step."""
        import torch.distributed.checkpoint as dcp

        d = self._join(str(path).rstrip("/").rpartition("/")[2])
        sd = self.state(params, expert_ids, opt, 0, extra)
        storage = self._storage(d, False)
        saved = storage["storage_reader"].read_metadata().state_dict_metadata
        for key in [k for k in sd if k.startswith("extra/") and k not in saved]:
            del sd[key]  # a checkpoint from before these were saved: they keep their start
        dcp.load(sd, **storage)
        # Plain tensors (steps) are loaded in place too, but keep the optimizer's own objects.
        for name, p in params:
            opt.state[p]["step"].copy_(sd[f"optim/{name}/step"])
        rng_file = f"{d}/rng_rank{self.layout.rank}.pt"
        if self.fs.isfile(rng_file):
            rng = torch.load(io.BytesIO(self.fs.cat_file(rng_file)), weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return int(sd["step"])
