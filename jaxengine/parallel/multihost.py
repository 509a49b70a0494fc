"""Multi-host serving with `jax.distributed`: process 0 runs the scheduler (and the HTTP server) and shares
every device command with the other processes through JAX's own collectives; every process then runs the
same compiled program on its devices.

Each command is a fixed-size header broadcast first (kind, bucket shape, variant), then its payload, whose
shapes the header fixes. A follower that dies is detected by the coordination service's heartbeat, which
terminates the leader (it fails loudly instead of hanging); the leader's STOP command ends the followers.

Nothing compiles once the engine is warm: each broadcast's program (one per payload structure) is compiled in
the warm-up (`warm_up_channel`), and host arrays go to the devices through `put`, which compiles nothing.
"""

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

STOP, STEP, RESET_SLOT, SET_ALLOWED = 0, 1, 2, 3
_HEADER = 4  # kind, num_tokens, num_reqs, variant index


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
               heartbeat_timeout_s: int = 30) -> None:
    """Arguments left None come from the environment (Cloud TPU VMs provide them)."""
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
    logger.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def put(tree, sharding):
    """Host arrays (the same on every process) onto `sharding`. Across processes each process puts only its own
    devices' shards: `jax.device_put` first checks that the processes' arrays agree by all-gathering each of them
    (every weight of a model at load, and a program compiled for each shape)."""
    if jax.process_count() == 1 or sharding is None:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                               lambda index: np.asarray(x)[index]), tree)


def warm_up_channel(payloads) -> None:
    """Runs, on every process in the same order, the broadcast of a header and of each payload (a structure of
    host arrays a command sends), compiling their programs: otherwise a bucket's first command would compile its
    own while serving."""
    multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32))
    for payload in payloads:
        multihost_utils.broadcast_one_to_all(payload)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated (possibly multi-process) array as numpy, from this process's own copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class CommandChannel:
    """The leader's side sends, the followers' side receives; both go through the same collectives."""

    def send(self, kind: int, shape: tuple[int, int, int] = (0, 0, 0), payload=None):
        header = np.array((kind, *shape), np.int32)
        multihost_utils.broadcast_one_to_all(header)
        return multihost_utils.broadcast_one_to_all(payload) if payload is not None else None

    def receive(self, payload_like) -> tuple[int, tuple[int, int, int], object]:
        """payload_like(kind, shape) gives a dummy of the payload's structure for that command."""
        header = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32))
        kind, shape = int(header[0]), tuple(int(v) for v in header[1:])
        like = payload_like(kind, shape)
        return kind, shape, multihost_utils.broadcast_one_to_all(like) if like is not None else None
