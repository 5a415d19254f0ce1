"""Tensor files written with the permissions the process's umask gives any other file.

safetensors (0.8) writes its files with mode 0600 whatever the umask, and transformers' ``save_pretrained`` writes
its weights through it: a model trained or inflated by one user could not be read by another (a server's service
account, a container with another uid) where every other file of the folder could. Every weights file specdec
writes goes through :func:`save_tensors`, or :func:`follow_umask` after transformers wrote it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str],
                 metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, the file then given the umask's permissions."""
    save_file(tensors, str(path), metadata=metadata)
    follow_umask(path)


def follow_umask(*paths: str | os.PathLike[str]) -> None:
    """Give each file of ``paths`` (a folder: its ``*.safetensors`` files) the mode a new file gets from the
    umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in map(Path, paths):
        for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            file.chmod(0o666 & ~mask)
