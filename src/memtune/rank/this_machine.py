"""What a rank checks of the machine it runs on before it loads anything: the files train.py
used on its own machine (a hostfile job's ranks run on others), and the threads it may take."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from memtune.config import ConfigError, RunConfig
from memtune.config.architecture import checkpoint_config_file
from memtune.machine import usable_cores
from memtune.rundir import DataRecord, RunDir


def threads_for_this_machine() -> None:
    """A rank started without OMP_NUM_THREADS (the hostfile form's on another node: DeepSpeed's
    launcher there sets none, and train.py's figure is its own machine's cores) shares this
    machine's cores with the ranks beside it (LOCAL_SIZE), as train.py's ranks do: else each
    ran a thread per core, and the CPU optimizer's threads fought over them. The cores are
    those this rank may use (its CPU affinity: a Slurm job's on a shared node), not the node's."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    beside = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, usable_cores() // max(1, beside)))


def check_this_machine(cfg: RunConfig, rd: RunDir, data: DataRecord) -> None:
    """ConfigError for what train.py found on its machine and this rank's lacks, naming the
    machine and the setting to move: the tokenized data it wrote (data.json) and the base
    checkpoint it read from disk (base.json). A hostfile job's ranks on other nodes see them
    only through a filesystem every node shares; without one, each failed deep in its data
    loader or in from_pretrained, a traceback per rank."""
    here = socket.gethostname()
    if not Path(data.dir).is_dir():
        raise ConfigError(
            f"the tokenized data train.py wrote ({data.dir}, {rd.data.name}) is not on this "
            f"machine ({here}): put data.cache_dir (or $MEMTUNE_CACHE_DIR) on a filesystem every "
            "node shares, as the run dir is"
        )
    name = cfg.model.name_or_path
    base = rd.read_base() if rd.base.is_file() else None
    on_disk = base is not None and base.fingerprint is not None
    # A hub name (org/model) may come from each node's own cache, or be downloaded there:
    # only a path must be where train.py read it.
    hub_name = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if on_disk and not hub_name and checkpoint_config_file(name, cfg.model.revision) is None:
        raise ConfigError(
            f"model.name_or_path={name}: train.py read it from disk on its machine, and this "
            f"machine ({here}) has no {Path(name).expanduser() / 'config.json'}: every node "
            "needs the model at the same path (a shared filesystem, or a copy on each; a hub "
            "name in each node's Hugging Face cache)"
        )
    adapter = cfg.peft.init_from
    read_there = base is not None and base.init_from_fingerprint is not None and adapter
    if read_there and not Path(str(adapter)).expanduser().is_dir():
        raise ConfigError(
            f"peft.init_from={adapter}: train.py read it on its machine, and this machine "
            f"({here}) has no such directory: every node needs it at the same path"
        )
