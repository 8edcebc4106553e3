"""Checkpoint rotation and cleaning (issue 18, item 14): a kill during the deletion of an old
checkpoint must never leave a ``step-*`` folder that holds part of a checkpoint."""
from __future__ import annotations

import shutil

import torch
from torch import nn

from rankwise.recipes import checkpoint
from rankwise.recipes.checkpoint import FILES, clean_incomplete, list_checkpoints, save_checkpoint


def _save(run, step, keep=2):
    return save_checkpoint(run, step, nn.Linear(2, 2), {"optimizer": {}, "torch_rng": torch.get_rng_state()},
                           keep=keep)


def test_rotation_renames_before_it_deletes(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step)
    deleted, rmtree = [], shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # a kill -9 after the first file went
        if not path.exists():
            return rmtree(path, ignore_errors=ignore_errors)
        deleted.append(path.name)
        next(p for p in sorted(path.iterdir())).unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    try:
        _save(tmp_path, 3)
    except SystemExit:
        pass
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert deleted[-1] == ".step-0000001.old"  # the half-deleted folder is out of step-*
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-0000002",
                                                                                    "step-0000003"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000002", "step-0000003"]
    assert clean_incomplete(tmp_path) == []  # hidden leftovers go silently
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002", "step-0000003"]


def test_a_checkpoint_missing_any_file_is_incomplete(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=3)
    root = tmp_path / "checkpoints"
    for step, name in zip((1, 2), ("meta.json", "state.pt")):  # each file alone makes it partial
        (root / f"step-{step:07d}" / name).unlink()
    (root / "notes.txt").write_text("mine")  # anything else is left alone
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000003"]
    assert [p.name for p in clean_incomplete(tmp_path)] == ["step-0000001", "step-0000002"]
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "step-0000003"]
    assert sorted(p.name for p in (root / "step-0000003").iterdir()) == sorted(FILES)
    shutil.rmtree(root)
    assert clean_incomplete(tmp_path) == []
