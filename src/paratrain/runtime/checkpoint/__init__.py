"""Fine-grained checkpointing after CheckFreq (Mohan et al., FAST'21) on ``torch.distributed.checkpoint``.

``paratrain train … --checkpoint-dir DIR [--checkpoint-every auto|N|Ns] [--keep N] [--resume]``.

- :mod:`.store` (no torch): the directory layout, the completion marker with every file's
  checksum, listing the newest complete checkpoint, keep-N pruning, the checks of ``--resume``.
- :mod:`.frequency` (no torch): ``--checkpoint-every`` and the CheckFreq tuner, pure functions of
  measured step time, snapshot stall and persist time.
- :mod:`.state`: what is saved, by full-model name (parameters, AdamW state, RNG of every rank).
- :mod:`.persist`: the two phases, *snapshot* (a host copy into shared memory overlapped with the
  next step's forward and backward, finished before the optimizer changes the weights) and
  *persist* (DCP in the rank's writer process, then the marker), at most one checkpoint in flight.
- :mod:`.writer`: the writer process (nice +10, its own gloo group, dies with its rank).
- :mod:`.reshard`: loading into whatever layout the run has (dp/tp/pp, FSDP2 or not) without
  unpickling code.
- :mod:`.export`: full weights as a safetensors file.

Importing this package does not import torch (the CLI checks ``--resume`` before torch loads).
"""

from __future__ import annotations

__all__: list[str] = []
