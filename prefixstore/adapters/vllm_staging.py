"""Staging files: how KV bytes travel between vLLM's workers and the scheduler's engine.

The engine (catalog, journal, shard files of every rank) lives in the scheduler
process, which holds no KV tensors; each worker holds its rank's paged KV. A job moves
one request's run of blocks through one file per rank in the staging folder (tmpfs,
``/dev/shm`` by default, so nothing here touches a disk):

- **save** job ``J``: worker ``r`` writes ``sJ.r{r}`` while the forward pass runs and
  reports it done; when every rank has, the scheduler's engine stores the checkpoint
  from those files (publishing it only once every rank's shard is durable) and unlinks
  them.
- **load** job ``J``: the scheduler's engine restores (verifying every shard) into
  ``lJ.r{r}`` for each rank, then writes the status ``lJ.status`` (JSON: how many blocks
  it restored); each worker waits for the status, copies its file into its KV blocks
  and reports; the scheduler unlinks what is left once every rank has.

A file holds ``tokens`` rows of every layout tensor in layout order, each tensor's rows
contiguous: exactly the per-rank ``segments`` ``Engine.store`` takes and
``Engine.restore`` returns. Nothing is pickled: raw tensor bytes and one JSON status.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from prefixstore.base.layout import Layout


class Staging:
    """The staging folder of one cache and the byte layout of its files."""

    def __init__(self, root: str, layout: Layout) -> None:
        self.root = root
        self.layout = layout
        self.offsets: list[tuple[str, int, int, tuple[int, ...], torch.dtype]] = []
        row = 0
        for spec in layout.segments:  # (name, bytes of the rows before it, bytes of one row, ...)
            self.offsets.append((spec.name, row, spec.nbytes, spec.shape, spec.torch_dtype))
            row += spec.nbytes
        self.row_bytes = row

    def save_file(self, job: int, rank: int) -> str:
        return os.path.join(self.root, f"s{job}.r{rank}")

    def load_file(self, job: int, rank: int) -> str:
        return os.path.join(self.root, f"l{job}.r{rank}")

    def status_file(self, job: int) -> str:
        return os.path.join(self.root, f"l{job}.status")

    def nbytes(self, tokens: int) -> int:
        """Bytes of one rank's file holding ``tokens`` rows."""
        return tokens * self.row_bytes

    def views(self, buf: torch.Tensor, tokens: int) -> dict[str, torch.Tensor]:
        """Each layout tensor's ``(tokens, *shape)`` view of a file's bytes ``buf``."""
        out = {}
        for name, before, row, shape, dtype in self.offsets:
            start = before * tokens
            out[name] = buf[start:start + row * tokens].view(dtype).view(tokens, *shape)
        return out

    def create(self, path: str, tokens: int) -> torch.Tensor:
        """A new file of ``tokens`` rows with its space reserved (a full tmpfs raises
        OSError here, never a fault later), mapped shared: a uint8 tensor of its bytes."""
        n = self.nbytes(tokens)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            if n:
                os.posix_fallocate(fd, 0, n)
        except OSError:
            self.remove(path)  # no empty file left behind for the scheduler to trip on
            raise
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=n, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)

    def open(self, path: str, tokens: int) -> torch.Tensor:
        """An existing file's ``tokens`` rows as a private mapping; OSError when it is
        missing or shorter."""
        n = self.nbytes(tokens)
        st = os.stat(path, follow_symlinks=False)
        if st.st_size < n:
            raise OSError(f"{path}: {st.st_size} bytes, expected {n}")
        return torch.from_file(path, shared=False, size=n, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)

    def write(self, path: str, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Write ``tokens`` rows of each layout tensor (in layout order) to a new file."""
        buf = self.create(path, tokens)
        for name, view in self.views(buf, tokens).items():
            view.copy_(tensors[name][:tokens])

    def write_status(self, job: int, blocks: int, error: str | None = None) -> None:
        """Publish a load's outcome (written aside, then renamed into place)."""
        path = self.status_file(job)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"blocks": blocks, "error": error}, f)
        os.replace(tmp, path)

    def read_status(self, job: int) -> dict[str, Any] | None:
        """A load's outcome, or None while it is not published."""
        try:
            with open(self.status_file(job)) as f:
                got = json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            return {"blocks": 0, "error": "unreadable status"}
        return got if isinstance(got, dict) else {"blocks": 0, "error": "unreadable status"}

    def reset(self) -> None:
        """Empty the folder (the scheduler, once its engine holds the directory lock)."""
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    @staticmethod
    def remove(*paths: str) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)



@dataclass(frozen=True)
class LoadJob:
    """Restore ``len(block_ids)`` blocks of a request into vLLM blocks ``block_ids``."""

    job: int
    req_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class SaveJob:
    """Copy vLLM blocks ``block_ids`` (``len(block_ids)`` whole blocks) into a save file."""

    job: int
    req_id: str
    block_ids: list[int]
